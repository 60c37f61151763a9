"""Fused elementwise kernels for the CUDA hot path (Triton), each beside the plain PyTorch formula it computes.

Four kernels, each replacing a chain of PyTorch kernels and its passes over the activations (and `gelu_tanh_`, SigLIP's
GELU in place, one pass in float32 math):

- `geglu(gate, up)` = gelu_tanh(gate) * up: one kernel instead of two (GELU, then the product), 3 instead of 5
  tensor-sizes of traffic. At case (a) batch 64 the LM's GeGLU tensors are (62k, 16384).
- `add_norm(x, delta, ...)`: the residual add (plain, or gated: x + gate * delta) fused with the next RMSNorm
  (Gemma's (1 + w) weight, or adaRMS's (1 + scale) and shift). One read of x and delta, one write of the new
  residual and of the normalised output, instead of an add/addcmul kernel, the norm kernel and the modulation
  kernel (plus, for the LM, the two small kernels that build (1 + w) in the compute dtype every call).
  `add_layer_norm(x, delta, ...)` is the same kernel in LayerNorm mode, for SigLIP: the add, F.layer_norm and
  the two casts of its float32 weight and bias become one kernel, computed as the unfused path does.
- `qkv_rope(...)`: RoPE on q and k and the copy of v in one kernel, reading the projection output in its
  token-major layout and writing q token-major (the "gemm" attention's folded rows are then a free view) and
  k/v straight into their (B, Nkv, T, hd) cache slots. It replaces the layout copy before the half swap, the
  flip, the two products per tensor and the K/V cache copies.
- `denoise_update(...)`: one Euler step of the sampler (`sampler.step_update`: `transition`, x + std xi,
  `gaussian_log_prob` and the weighted log-prob accumulation) on the float32 action state: one kernel instead of
  38 small ones per denoise step. Unlike the three above it is exact, not a re-rounding: see its docstring.

Rounding semantics of the three layer kernels (what the references below compute, and the kernels up to float32
summation order and fused multiply-adds): every input is read in its own dtype and converted to float32; all
arithmetic is float32; each output is rounded once to its dtype. The only intermediate rounding is the new residual
of `add_norm`: it is rounded to the compute dtype (it is stored so and the next layer reads it so) and the norm
statistics are taken of that rounded value, as the unfused code does. The unfused PyTorch code rounds more often
(the normalised value before the modulation, x * cos before adding the rotated half), so the fused results are at
least as close to a float32 model; they are not bitwise equal to the unfused ones. `add_layer_norm` instead
follows its unfused path operation for operation (the LayerNorm affine parameters rounded to the compute dtype,
as the unfused casts do): it differs from it only in the float32 summation of the statistics.

Where they run: Triton on CUDA half-precision tensors outside autograd (the rollout path: the eager warm-up compiles
them before any graph is captured); `denoise_update` on the CUDA float32 action state, whatever the model's dtype.
`fused_path(enabled, x)` (`denoise_serves` for the step kernel) is the call sites' test, made once per stack call:
the blocks (`gemma.py`'s `add_norm` and `project`, `siglip.add_layer_norm`) take its answer and run the PyTorch
reference ops for every other case (CPU, float32/float64 layers, autograd, no Triton, kernels not requested), which
are bit-identical to what ran before these kernels existed. With ``TRITON_INTERPRET=1`` set before import, Triton's
interpreter runs the same kernels on CPU tensors (slow; what the CPU tests use to check them against the references).
The interpreter (Triton 3.6) truncates float32 -> bfloat16 where the GPU rounds to nearest even, so on CPU the kernels
agree with the references to one bfloat16 ulp, on the GPU to float32 summation order.

Example:
    >>> import torch
    >>> gate, up = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    >>> bool(torch.allclose(geglu(gate, up), torch.nn.functional.gelu(gate, approximate="tanh") * up))
    True
    >>> x, d, w = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.zeros(8)
    >>> res, y = add_norm(x, d, w, 1e-6, add_one=True)
    >>> bool(torch.allclose(y, torch.nn.functional.rms_norm(x + d, (8,), eps=1e-6), atol=1e-6))
    True
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .sampler import StepInputs

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "") == "1"
"""Whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1 at import): tests only."""
_BLOCK = 1024
_GELU_BLOCK = 4096
_HALF = (torch.bfloat16, torch.float16)

_FLOAT32 = (torch.float32,)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)  # sampler.gaussian_log_prob's constant
# IEEE float32 arithmetic, as PyTorch's elementwise CUDA kernels: no mul+add contraction into FMAs, libdevice
# without flush-to-zero (the `denoise_update` launch options)
_EXACT = dict(enable_fp_fusion=False, enable_reflect_ftz=False)

if HAS_TRITON:  # pragma: no cover - needs a CUDA GPU or the interpreter
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _gelu_tanh(g):
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi) (g + 0.044715 g^3)
        tanh = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0  # saturates to +-1 without overflow trouble
        return 0.5 * g * (1.0 + tanh)

    @triton.jit
    def _geglu_kernel(g_ptr, u_ptr, o_ptr, n_cols, g_stride, u_stride, o_stride, BLOCK: tl.constexpr):  # noqa: N803
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = cols < n_cols
        g = tl.load(g_ptr + row * g_stride + cols, mask=keep, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * u_stride + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(o_ptr + row * o_stride + cols, (_gelu_tanh(g) * u).to(o_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _gelu_kernel(x_ptr, n, BLOCK: tl.constexpr):  # noqa: N803
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        x = tl.load(x_ptr + offs, mask=keep, other=0.0).to(tl.float32)
        tl.store(x_ptr + offs, _gelu_tanh(x).to(x_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _add_norm_kernel(
        x_ptr, d_ptr, g_ptr, s_ptr, b_ptr, r_ptr, y_ptr,
        n_cols, rows_per_group, x_stride, d_stride, r_stride, y_stride, g_stride, s_stride, b_stride, eps,
        HAS_DELTA: tl.constexpr, HAS_GATE: tl.constexpr, HAS_SHIFT: tl.constexpr,  # noqa: N803
        ADD_ONE: tl.constexpr, STORE_RES: tl.constexpr, LAYER_NORM: tl.constexpr, LIBDEVICE: tl.constexpr,  # noqa: N803
        BLOCK: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        # One row per program: r = x + [gate *] delta (rounded, stored), y = rms(r) * scale [+ shift]; with
        # LAYER_NORM, y = (r - mean) rstd * w + b as F.layer_norm's CUDA half kernel (see `add_layer_norm`).
        row = tl.program_id(0).to(tl.int64)
        group = row // rows_per_group  # the modulation row (batch index; 0 when broadcast with stride 0)
        cols = tl.arange(0, BLOCK)
        keep = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=keep, other=0.0).to(tl.float32)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * d_stride + cols, mask=keep, other=0.0).to(tl.float32)
            if HAS_GATE:
                x = x + tl.load(g_ptr + group * g_stride + cols, mask=keep, other=0.0).to(tl.float32) * d
            else:
                x = x + d
            x = x.to(r_ptr.dtype.element_ty)  # the residual stream is stored in the compute dtype
            if STORE_RES:
                tl.store(r_ptr + row * r_stride + cols, x, mask=keep)
            x = x.to(tl.float32)
        if LAYER_NORM:  # centred; the variance below is then the biased one (F.layer_norm's)
            x = tl.where(keep, x - tl.sum(x, axis=0) / n_cols, 0.0)
        ms = tl.sum(x * x, axis=0) / n_cols + eps
        if LAYER_NORM and LIBDEVICE:
            rstd = libdevice.rsqrt(ms)  # __nv_rsqrtf: the rsqrtf of F.layer_norm's CUDA kernel
        else:
            rstd = 1.0 / tl.sqrt(ms)  # (the interpreter has no libdevice)
        scale = tl.load(s_ptr + group * s_stride + cols, mask=keep, other=0.0).to(tl.float32)
        if ADD_ONE:
            scale = scale + 1.0
        if LAYER_NORM:  # the float32 weight rounded to the compute dtype, as the unfused call's cast
            scale = scale.to(r_ptr.dtype.element_ty).to(tl.float32)
        y = x * rstd * scale
        if HAS_SHIFT:
            shift = tl.load(b_ptr + group * b_stride + cols, mask=keep, other=0.0).to(tl.float32)
            if LAYER_NORM:  # the bias likewise
                shift = shift.to(r_ptr.dtype.element_ty).to(tl.float32)
            y = y + shift
        # rounded once to the compute dtype, then stored in the output's dtype (float32 for the final norm)
        y = y.to(r_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * y_stride + cols, y, mask=keep)

    @triton.jit
    def _rope_tile(
        src, s_b, s_t, s_h, dst, o_b, o_t, o_h, cos, sin, c_b, c_t, b, t0, head, n_tok, hd, rows,
        ROTATE: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        toks = (t0 + tl.arange(0, BLOCK_T))[:, None].to(tl.int64)
        base = src + b * s_b + toks * s_t + head * s_h
        if HAS_ROWS:  # the destination row of each token (a permutation of the tokens)
            dst_rows = tl.load(rows + b * n_tok + toks, mask=toks < n_tok, other=0)
        else:
            dst_rows = toks
        out = dst + b * o_b + dst_rows * o_t + head * o_h
        if ROTATE:  # [x1 | x2] -> [x1 c1 + x2 s1 | x2 c2 + x1 s2]: the signed sin table carries the minus
            half = hd // 2  # each half one contiguous tile (vectorised loads, no gather for the swap)
            d = tl.arange(0, BLOCK_D // 2)[None, :]
            keep = (toks < n_tok) & (d < half)
            x1 = tl.load(base + d, mask=keep, other=0.0).to(tl.float32)
            x2 = tl.load(base + half + d, mask=keep, other=0.0).to(tl.float32)
            tab = b * c_b + toks * c_t + d
            c1 = tl.load(cos + tab, mask=keep, other=0.0).to(tl.float32)
            c2 = tl.load(cos + tab + half, mask=keep, other=0.0).to(tl.float32)
            s1 = tl.load(sin + tab, mask=keep, other=0.0).to(tl.float32)
            s2 = tl.load(sin + tab + half, mask=keep, other=0.0).to(tl.float32)
            tl.store(out + d, (x1 * c1 + x2 * s1).to(dst.dtype.element_ty), mask=keep)
            tl.store(out + half + d, (x2 * c2 + x1 * s2).to(dst.dtype.element_ty), mask=keep)
        else:
            d = tl.arange(0, BLOCK_D)[None, :]
            keep = (toks < n_tok) & (d < hd)
            tl.store(out + d, tl.load(base + d, mask=keep, other=0.0).to(dst.dtype.element_ty), mask=keep)

    @triton.jit
    def _qkv_rope_kernel(
        q_src, qs_b, qs_t, qs_h, q_dst, qo_b, qo_t, qo_h,
        k_src, ks_b, ks_t, ks_h, k_dst, ko_b, ko_t, ko_h,
        v_src, vs_b, vs_t, vs_h, v_dst, vo_b, vo_t, vo_h,
        cos, sin, c_b, c_t, n_tok, n_q, n_kv, hd, t_blocks, kv_rows,
        HAS_ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        # Program (token block of one batch row, head): heads [0, n_q) are q, then n_kv k heads, then n_kv v heads.
        # K and V rows go to `kv_rows` (B, T) where HAS_ROWS; q keeps the token order.
        pid = tl.program_id(0)
        head = tl.program_id(1)
        b = (pid // t_blocks).to(tl.int64)
        t0 = (pid % t_blocks) * BLOCK_T
        if head < n_q:
            _rope_tile(q_src, qs_b, qs_t, qs_h, q_dst, qo_b, qo_t, qo_h, cos, sin, c_b, c_t, b, t0, head, n_tok, hd,
                       kv_rows, True, False, BLOCK_T, BLOCK_D)  # fmt: skip
        elif head < n_q + n_kv:
            _rope_tile(k_src, ks_b, ks_t, ks_h, k_dst, ko_b, ko_t, ko_h, cos, sin, c_b, c_t, b, t0, head - n_q,
                       n_tok, hd, kv_rows, True, HAS_ROWS, BLOCK_T, BLOCK_D)  # fmt: skip
        else:
            _rope_tile(v_src, vs_b, vs_t, vs_h, v_dst, vo_b, vo_t, vo_h, cos, sin, c_b, c_t, b, t0,
                       head - n_q - n_kv, n_tok, hd, kv_rows, False, HAS_ROWS, BLOCK_T, BLOCK_D)  # fmt: skip

    @triton.jit
    def _denoise_update_kernel(
        x_ptr, v_ptr, xi_ptr, ls_ptr, lp_ptr, xo_ptr, lpo_ptr,
        t_ptr, delta_ptr, sigma_ptr, stoch_ptr, sde_ptr, ls_on_ptr, w_ptr,
        n, row_len, x_b, v_b, xi_b, ls_b, lp_b, stoch_b, log_sqrt_2pi,
        HAS_LEARNED: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        # Element (b, j) of the flattened (B, H*D) state; every operation below is one PyTorch kernel of
        # sampler.step_update, in its order and association (each rounds once, as here: no contraction).
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        row = offs // row_len
        col = offs % row_len
        x = tl.load(x_ptr + row * x_b + col, mask=keep, other=0.0)
        v = tl.load(v_ptr + row * v_b + col, mask=keep, other=0.0)
        xi = tl.load(xi_ptr + row * xi_b + col, mask=keep, other=0.0)
        stoch = tl.load(stoch_ptr + row * stoch_b, mask=keep, other=0.0)
        t, delta, sigma = tl.load(t_ptr), tl.load(delta_ptr), tl.load(sigma_ptr)  # read per replay: tables refresh
        sde_on = tl.load(sde_ptr)
        # transition: mean = (x - delta v) - shrink x1_hat, std = stochastic (sde_on sqrt(delta) sigma [+ learned])
        ode_mean = x - delta * v
        x1_hat = x + (1.0 - t) * v
        shrink = tl.div_rn(stoch * sde_on * (sigma * sigma) * delta, 2.0 * t)
        mean = ode_mean - shrink * x1_hat
        std = sde_on * (tl.sqrt_rn(delta) * sigma)
        if HAS_LEARNED:
            std = std + tl.load(ls_on_ptr) * tl.load(ls_ptr + row * ls_b + col, mask=keep, other=0.0)
        std = stoch * std
        x_next = mean + std * xi
        # gaussian_log_prob(x_next, mean, std), 0 where std == 0; then lp + w * element
        positive = std > 0
        safe = tl.where(positive, std, 1.0)
        if LIBDEVICE:
            log_safe = libdevice.log(safe)  # __nv_logf, the CUDA math library's logf (what torch.log calls)
        else:
            log_safe = tl.log(safe)  # the interpreter has no libdevice
        z = tl.div_rn(x_next - mean, safe)
        element = tl.where(positive, -log_safe - log_sqrt_2pi - 0.5 * (z * z), 0.0)
        lp = tl.load(lp_ptr + row * lp_b + col, mask=keep, other=0.0) + tl.load(w_ptr) * element
        tl.store(xo_ptr + offs, x_next, mask=keep)
        tl.store(lpo_ptr + offs, lp, mask=keep)


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """`x` as (rows, cols) with unit column stride, without a copy; None when that is not a view."""
    if x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def triton_usable(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = _HALF) -> bool:
    """Whether the fused kernels serve this tensor (CUDA, one of `dtypes` (half precision), no autograd)."""
    return (
        HAS_TRITON
        and x.is_cuda
        and x.dtype in dtypes
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def triton_serves(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = _HALF) -> bool:
    """`triton_usable`, or such a CPU tensor under the interpreter (the CPU tests of the kernels)."""
    return triton_usable(x, dtypes) or (
        INTERPRETED and x.device.type == "cpu" and x.dtype in dtypes and not torch.is_grad_enabled()
    )


def fused_path(enabled: bool, x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = _HALF) -> bool:
    """The call sites' test: fused kernels requested (`SchedulerConfig.fused_kernels`) and served for `x`.

    `dtypes`: the kernel's input dtypes (half precision for the layer kernels, float32 for `denoise_update`).
    """
    return enabled and triton_serves(x, dtypes)


def denoise_serves(enabled: bool, *tensors: torch.Tensor | None) -> bool:
    """`fused_path` for `denoise_update`: requested, and every given tensor (x, v, learned std) float32 it serves."""
    return enabled and all(t is None or triton_serves(t, _FLOAT32) for t in tensors)


# ------------------------------------------------------------------------------------------------------ GeGLU
def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, shape and dtype of `gate` (one fused kernel on CUDA half tensors)."""
    if triton_usable(gate) and not (torch.is_grad_enabled() and up.requires_grad) and gate.shape == up.shape:
        g, u = _rows(gate), _rows(up)
        if g is not None and u is not None and g.shape[0] > 0:
            out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
            o = out.view(-1, gate.shape[-1])
            cols = g.shape[1]
            block = min(_BLOCK, triton.next_power_of_2(cols))  # rows of a `geglu_gemm` stack's GEMM are 128 wide
            grid = (g.shape[0], triton.cdiv(cols, block))
            _geglu_kernel[grid](g, u, o, cols, g.stride(0), u.stride(0), o.stride(0), BLOCK=block, num_warps=4)
            return out
    if gate.dtype in _HALF:  # float32 math, one rounding: what the kernel computes
        return (F.gelu(gate.float(), approximate="tanh") * up.float()).to(gate.dtype)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x), in place on contiguous CUDA half tensors (one pass: read and write once), else `F.gelu`'s result.

    For activations nothing else reads (SigLIP's fc1 output). Float32 math, one rounding, as `geglu`.
    """
    if triton_serves(x) and x.is_contiguous() and x.numel() > 0:
        _gelu_kernel[(triton.cdiv(x.numel(), _GELU_BLOCK),)](x, x.numel(), BLOCK=_GELU_BLOCK, num_warps=4)
        return x
    return F.gelu(x, approximate="tanh")


# ------------------------------------------------------------------------------------- residual add + (ada)RMS
def add_norm_reference(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    scale: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    add_one: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `add_norm` computes, in PyTorch: r = x + [gate *] delta rounded to x's dtype; y = rms(r) scale + shift.

    Float32 arithmetic; r rounded once to x's dtype (its statistics taken of the rounded value); y rounded once
    to x's dtype and then stored as `out_dtype` (default x's dtype). `scale` is (1 + scale) of adaRMS, or the
    norm weight w with `add_one` (1 + w in float32).
    """
    r = x
    if delta is not None:
        d = delta.float() if gate is None else gate.float() * delta.float()
        r = (x.float() + d).to(x.dtype)
    rf = r.float()
    s = scale.float() + 1.0 if add_one else scale.float()
    y = rf * torch.rsqrt(rf.square().mean(dim=-1, keepdim=True) + eps) * s
    if shift is not None:
        y = y + shift.float()
    return r, y.to(x.dtype).to(out_dtype or x.dtype)


def _group_stride(t: torch.Tensor, batch: int, width: int, name: str) -> int:
    """Row stride of a (width,), (1 or B, 1, width) or (1 or B, width) per-row parameter (0 when broadcast)."""
    if t.shape[-1] != width or t.stride(-1) != 1 or t.numel() not in (width, batch * width):
        raise ValueError(f"add_norm: {name} must be (width,) or (B or 1, 1, width) with unit stride, got "
                         f"{tuple(t.shape)} strides {t.stride()}.")  # fmt: skip
    return 0 if t.numel() == width else t.stride(0)


def _launch_add_norm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    scale: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None,
    shift: torch.Tensor | None,
    add_one: bool,
    out_dtype: torch.dtype | None,
    store_residual: bool,
    layer_norm: bool,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`_add_norm_kernel` on (B, T, W) x: (r, y) of `add_norm` / `add_layer_norm`; None where it does not serve.

    `num_warps`: a benchmark's override of the launch. Default: one warp per 256 columns of the power-of-two block
    (RMS mode; at most 8), per 1,024 in LayerNorm mode (SigLIP's 1152 columns: 2 warps ran at 4.0-4.1 TB/s on the
    H200 against 3.3 with 8, `prefix_parts.jsonl`).
    """
    if not triton_serves(x) or x.dim() != 3:
        return None
    b, t, w = x.shape
    xr = _rows(x)
    dr = _rows(delta) if delta is not None else xr
    if xr is None or dr is None or (delta is not None and delta.shape != x.shape):
        return None
    residual = torch.empty_like(x, memory_format=torch.contiguous_format) if delta is not None else x
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    rr, yr = residual.view(-1, w), y.view(-1, w)
    s_stride = _group_stride(scale, b, w, "scale")
    g_stride = _group_stride(gate, b, w, "gate") if gate is not None else 0
    b_stride = _group_stride(shift, b, w, "shift") if shift is not None else 0
    if xr.shape[0] == 0:
        return residual, y
    block = triton.next_power_of_2(w)
    _add_norm_kernel[(xr.shape[0],)](
        xr, dr, gate if gate is not None else scale, scale, shift if shift is not None else scale, rr, yr,
        w, t, xr.stride(0), dr.stride(0), rr.stride(0), yr.stride(0), g_stride, s_stride, b_stride, eps,
        HAS_DELTA=delta is not None, HAS_GATE=gate is not None, HAS_SHIFT=shift is not None, ADD_ONE=add_one,
        STORE_RES=store_residual, LAYER_NORM=layer_norm, LIBDEVICE=not INTERPRETED, BLOCK=block,
        num_warps=num_warps or min(max(block // (1024 if layer_norm else 256), 1), 8),
    )  # fmt: skip
    return residual, y


def add_norm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    scale: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    add_one: bool = False,
    out_dtype: torch.dtype | None = None,
    store_residual: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with the next RMSNorm: (r, y) for x, delta (B, T, W); see `add_norm_reference`.

    The LM's norm: `scale` = w (W,) with `add_one`; the expert's adaRMS: `scale` = 1 + scale, `shift` and the
    previous branch's `gate`, each (W,) or (B or 1, 1, W). `delta` None: r is x itself (the first norm).
    `store_residual=False` skips writing r (the final norm; r is then returned unwritten). One Triton kernel
    where `fused_path` holds, the reference elsewhere.
    """
    out = _launch_add_norm(x, delta, scale, eps, gate, shift, add_one, out_dtype, store_residual, layer_norm=False)
    return out if out is not None else add_norm_reference(x, delta, scale, eps, gate, shift, add_one, out_dtype)


# --------------------------------------------------------------------------------- residual add + LayerNorm
def add_layer_norm_reference(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the unfused SigLIP code computes: r = x + delta in x's dtype, y = `siglip.layer_norm_fp32(r)`.

    The add rounds the float32 sum once to x's dtype; the norm is F.layer_norm of r with the float32 weight and
    bias cast to r's dtype (for half r: float32 mean, biased variance and affine, rounded once).
    """
    r = x if delta is None else x + delta
    return r, F.layer_norm(r, weight.shape, weight.to(r.dtype), bias.to(r.dtype), eps)


def add_layer_norm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    store_residual: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with the next LayerNorm (SigLIP's): (r, y) for x, delta (B, T, W), y in x's dtype.

    `weight`, `bias`: the (W,) float32 LayerNorm parameters, read by the kernel itself (no per-call casts).
    `delta` None: r is x itself (the first norm); `store_residual=False` skips writing r (the final norm; r is
    then returned unwritten). One `_add_norm_kernel` launch in LayerNorm mode where `fused_path` holds,
    `add_layer_norm_reference` elsewhere.

    Rounding: what the unfused path computes (`add_layer_norm_reference`), operation for operation as
    F.layer_norm's vectorized CUDA half kernel: r = x + delta rounded once to x's dtype; float32 mean and biased
    variance of r, rstd = rsqrtf(var + eps), y = w_h (rstd (r - mean)) + b_h rounded once, where w_h and b_h
    are the parameters rounded to x's dtype in registers (the values of the unfused call's casts). The one
    difference left is the float32 summation of mean and variance (a two-pass tree sum here, per-thread Welford
    updates there): the statistics differ by float32 rounding, so an output can fall on the other side of a
    half-precision rounding boundary (one ulp, in a small fraction of the elements).
    """
    out = _launch_add_norm(x, delta, weight, eps, None, bias, False, None, store_residual, layer_norm=True)
    return out if out is not None else add_layer_norm_reference(x, delta, weight, bias, eps)


# ---------------------------------------------------------------------------------------- RoPE + K/V write
def rope_reference(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on (..., T, heads, hd) with cos/sin (B or 1, T, hd): float32 math, rounded once."""
    half = x.shape[-1] // 2
    xf = x.float()
    swapped = torch.cat([xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos.float()[:, :, None] + swapped * signed_sin.float()[:, :, None]).to(x.dtype)


def qkv_rope_reference(q, k, v, cos, sin, q_out, k_out, v_out, kv_rows=None) -> None:
    """What `qkv_rope` writes, in PyTorch (same arguments): rope(q) -> q_out, rope(k) -> k_out, v -> v_out."""
    if q is not None:
        q_out.copy_(rope_reference(q, cos, sin))
    k_rot = rope_reference(k, cos, sin)
    if kv_rows is None:
        k_out.copy_(k_rot)
        v_out.copy_(v)
        return
    index = kv_rows[:, :, None, None].expand(k.shape)
    k_out.scatter_(1, index, k_rot.to(k_out.dtype))
    v_out.scatter_(1, index, v.to(v_out.dtype))


def qkv_rope(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor | None,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    kv_rows: torch.Tensor | None = None,
) -> None:
    """RoPE on q and k and the copy of v, written into `q_out`, `k_out`, `v_out` in one kernel.

    Every tensor is indexed (B, T, heads, hd) (any strides, unit stride in hd): q and q_out with Nq heads, k, v,
    k_out and v_out with Nkv heads; e.g. the projection output viewed (B, T, heads, hd) and the cache slot
    `keys[:, :, start:end].transpose(1, 2)`. cos/sin: (B or 1, T, hd) from `rope_cos_sin(...)[:, 0]`. q may be
    None (the LM's last layer needs no queries). `kv_rows` (B, T) int64, a permutation of each row's tokens: token
    t's K and V go to row ``kv_rows[b, t]`` of k_out / v_out (the prefix's valid keys first); None keeps the order.
    Triton where `fused_path` holds, `qkv_rope_reference` elsewhere.
    """
    unit = all(t.stride(-1) == 1 for t in (k, v, k_out, v_out, cos)) and cos.stride() == sin.stride()
    if q is not None:
        unit = unit and q_out is not None and q.stride(-1) == 1 and q_out.stride(-1) == 1
    rows_ok = kv_rows is None or (kv_rows.dtype == torch.int64 and kv_rows.is_contiguous())
    if not (triton_serves(k) and unit and rows_ok):
        qkv_rope_reference(q, k, v, cos, sin, q_out, k_out, v_out, kv_rows)
        return
    b, t, n_kv, hd = k.shape
    n_q = q.shape[2] if q is not None else 0
    if b * t == 0:
        return
    qs, qo = (q, q_out) if q is not None else (k, k_out)
    c_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    block_t = 16 if hd <= 128 else 8
    t_blocks = triton.cdiv(t, block_t)
    _qkv_rope_kernel[(b * t_blocks, n_q + 2 * n_kv)](
        qs, qs.stride(0), qs.stride(1), qs.stride(2), qo, qo.stride(0), qo.stride(1), qo.stride(2),
        k, k.stride(0), k.stride(1), k.stride(2), k_out, k_out.stride(0), k_out.stride(1), k_out.stride(2),
        v, v.stride(0), v.stride(1), v.stride(2), v_out, v_out.stride(0), v_out.stride(1), v_out.stride(2),
        cos, sin, c_b, cos.stride(1), t, n_q, n_kv, hd, t_blocks, k if kv_rows is None else kv_rows,
        HAS_ROWS=kv_rows is not None, BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(hd), num_warps=4,
    )  # fmt: skip


# ------------------------------------------------------------------------------------- one denoise step's math
def _batch_rows(t: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, int]:
    """`t` (B, H, D) with each batch row contiguous (a copy where it is not) and that row stride."""
    if t.shape != shape:
        raise ValueError(f"denoise_update: expected a {tuple(shape)} tensor, got {tuple(t.shape)}.")
    if t.stride(-1) != 1 or (shape[1] > 1 and t.stride(1) != shape[2]):
        t = t.contiguous()
    return t, t.stride(0)


def denoise_update(
    x: torch.Tensor, v: torch.Tensor, xi: torch.Tensor, step: StepInputs, learned_std: torch.Tensor | None,
    lp: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`sampler.step_update` in one Triton kernel: (x_{i+1}, lp + w * log N(x_{i+1}; mean, std)), both new tensors.

    x, v, xi (the step's noise, e.g. a `xi[:, i]` view), learned_std and lp: (B, H, D) float32; `step`'s
    scalars are 1-element float32 tensors on x's device, read by the kernel (views of the step tables, so a
    captured graph follows their in-place refreshes), its `stochastic` (B,). Callers test `denoise_serves` first.

    Exactness: every operation is the float32 operation of one PyTorch kernel of the reference, in its order
    and association, each rounded once (no FMA contraction, IEEE division and square root), so x_{i+1} is
    bitwise the reference's on CUDA. The log-prob's only non-IEEE operation is log: libdevice's logf (the
    CUDA math library's, which torch.log calls too; max error 1 ulp), so lp is expected bitwise and bounded by
    one float32 ulp of the log term. Under the interpreter log is numpy's (within an ulp of PyTorch's CPU log).
    """
    shape = x.shape
    b, h, d = shape
    out_x = torch.empty(shape, dtype=torch.float32, device=x.device)
    out_lp = torch.empty(shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n == 0:
        return out_x, out_lp
    (x, x_b), (v, v_b), (xi, xi_b), (lp, lp_b) = (_batch_rows(u, shape) for u in (x, v, xi, lp))
    ls, ls_b = _batch_rows(learned_std, shape) if learned_std is not None else (x, 0)
    for name in ("t", "delta", "sigma", "sde_on", "learned_std_on", "row_weight"):
        scalar = getattr(step, name)
        if scalar.numel() != 1 or scalar.device != x.device or scalar.dtype != torch.float32:
            raise ValueError(f"denoise_update: {name} must be a 1-element float32 tensor on {x.device}, got "
                             f"{tuple(scalar.shape)} {scalar.dtype} on {scalar.device}.")  # fmt: skip
    stochastic = step.stochastic
    if stochastic.shape != (b,) or stochastic.dtype != torch.float32:
        raise ValueError(f"denoise_update: stochastic must be ({b},) float32, got {tuple(stochastic.shape)} "
                         f"{stochastic.dtype}.")  # fmt: skip
    grid = (triton.cdiv(n, _BLOCK),)
    _denoise_update_kernel[grid](
        x, v, xi, ls, lp, out_x, out_lp,
        step.t, step.delta, step.sigma, stochastic, step.sde_on, step.learned_std_on, step.row_weight,
        n, h * d, x_b, v_b, xi_b, ls_b, lp_b, stochastic.stride(0), _LOG_SQRT_2PI,
        HAS_LEARNED=learned_std is not None, LIBDEVICE=not INTERPRETED, BLOCK=_BLOCK, num_warps=4, **_EXACT,
    )  # fmt: skip
    return out_x, out_lp
