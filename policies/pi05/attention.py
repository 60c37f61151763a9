"""Attention backends (eager reference, PyTorch SDPA, flash-attn, folded-MQA GEMMs) chosen for each call site.

Every PI0.5 attention is either unmasked (SigLIP) or masked by *key validity* only (prefix: bidirectional over
valid tokens; suffix: valid prefix keys plus all action tokens). So one signature serves all sites:
``attend(q (B, Nh, T, hd), k (B, Nkv, S, hd), v, key_mask (B, S) bool | None, scale)``.

The "gemm" backend serves the denoise loop: a few action tokens against a long prefix cache, with one K/V head.
There the fused attention kernels launch one tile of queries per (batch, head) and walk the whole cache
sequentially, few tiles for a small batch: at batch 1 that is most of the denoise time. Folding the query heads
that share the K/V head into rows makes attention two batched GEMMs and a softmax over (B, Nh*T, S) scores:
float32 scores (bf16 operands, float32 accumulation and output on CUDA), float32 softmax, probabilities cast
to the value dtype for the second GEMM. Where it does not apply (several K/V heads, very large score tensors outside
autograd) it hands over to "flash" (FlashAttention-4 where it runs, else SDPA). Under autograd (the PPO trainer's
`evaluate()`) it always serves, with operands upcast to float32 (exact for bf16 values), so the trainer computes its
scores as the rollout's graphs do.

The "triton" backend is the same folded-row attention as one Triton kernel (`attention_kernel`: an online
softmax split over the keys, plus a combine kernel at small batches) in place of "gemm"'s five; it serves
forward-only CUDA half calls with one K/V head at any size (it holds no score tensor) and hands every other call
(autograd, several K/V heads) to "gemm". "triton_flash" runs it except for calls of at least the device's
``flash_min_scores`` (`tuning.Thresholds`) score elements where FlashAttention-4 runs (those go to "flash"): what
the prefix LM uses.

The "flash" backend is FlashAttention-4 (`flash_attn.cute`, the CuTe-DSL kernels of the ``flash-attn-4``
distribution; see `flash_attn_status`). Key validity reaches it as lengths: the keys are a set (RoPE is already in
them), so each row's valid keys are moved to the front (a stable scatter computed on the device, no host sync) and
the kernel reads the first ``seqused_k`` of them. It serves forward-only calls on CUDA sm90/sm100 in half dtypes
with a head width it compiles (8..256, a multiple of 8); any other call, and every call when the package is
missing or its probe kernel failed, hands over to SDPA.

Routing is written once: `_refusal` holds each backend's rule and `HANDOVER` where it sends the calls it refuses;
`_route` walks that chain for a call's shape (`served_by` reports it, `attend` follows it and then checks what only
the tensors tell: the Triton kernel's layout rules, the flash probe), and `AttentionConfig.resolve` picks each
site's "auto" backend from `AUTO` with the device-wide parts of the same rules.

Query rows of padded tokens are never read downstream; the additive mask uses a large *finite* negative
(-2.3819763e38, as openpi/LeRobot) so such rows stay finite (uniform attention) instead of NaN.

Example:
    >>> import torch
    >>> q = torch.randn(1, 4, 3, 8); k = torch.randn(1, 1, 5, 8); v = torch.randn(1, 1, 5, 8)
    >>> mask = torch.tensor([[True, True, False, True, True]])
    >>> a = attend(q, k, v, mask, 8 ** -0.5, "eager"); b = attend(q, k, v, mask, 8 ** -0.5, "sdpa")
    >>> bool(torch.allclose(a, b, atol=1e-5))
    True
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import attention_kernel, kernels, tuning

MASK_VALUE = -2.3819763e38
"""Additive mask value for disallowed keys (finite, as openpi and LeRobot)."""

BACKENDS = ("eager", "sdpa", "flash", "flash_large", "gemm", "triton", "triton_flash")
SITES = ("vision", "prefix", "expert")


FLASH_DISTRIBUTION = "flash-attn-4"
"""The distribution that provides `flash_attn.cute` (the ``flash`` extra of pyproject.toml)."""


@functools.cache
def flash_attn_status() -> str | None:
    """Why FlashAttention-4 cannot run in this process (import failed: the exact error), or None when it imports.

    A pure capability probe of the installation; the device and shapes are checked by `flash_serves`.
    """
    if importlib.util.find_spec("flash_attn") is None:
        return f"{FLASH_DISTRIBUTION} is not installed (pip install 'phyai-gym[flash]')"
    try:
        import flash_attn.cute  # noqa: F401 - the import itself is the probe
    except Exception as err:  # noqa: BLE001 - any import failure means "not available", with its reason
        return f"import flash_attn.cute failed: {type(err).__name__}: {err}"
    return None


def flash_attn_available() -> bool:
    """Whether `flash_attn.cute` (FlashAttention-4) is importable (never required)."""
    return flash_attn_status() is None


def flash_kernel_name() -> str:
    """The kernel package and version "flash" calls, e.g. ``flash_attn.cute 4.0.0b36``."""
    try:
        version = importlib.metadata.version(FLASH_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    return f"flash_attn.cute {version}"


@functools.cache
def flash_device_status(device: torch.device) -> str | None:
    """Why `device` cannot run FlashAttention-4 (not CUDA, or not sm90/sm100/sm110), or None (a capability probe)."""
    if device.type != "cuda":
        return f"device is {device.type}, not CUDA"
    if flash_attn_status() is not None:
        return flash_attn_status()
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10, 11):
        return f"compute capability sm{major}{minor} (flash_attn.cute is routed on sm90/sm100/sm110 only)"
    return None


def mask_dtype(backend: str, dtype: torch.dtype, gemm_served: bool = False) -> torch.dtype:
    """The dtype a call site builds its additive mask in for `backend`, so that no per-call cast runs.

    Float32 where it is added to float32 scores (the Triton kernel; "gemm" where `gemm_served`), else the compute
    `dtype` (SDPA's). A half mask ran the Triton kernel 1.3x slower on the H200.
    """
    return torch.float32 if backend in ("triton", "triton_flash") or backend == "gemm" and gemm_served else dtype


def additive_mask(key_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, S) bool key validity -> (B, 1, 1, S) additive mask (0 or MASK_VALUE) in `dtype`; build once per stage."""
    mask = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)
    return mask.masked_fill(~key_mask, MASK_VALUE)[:, None, None, :]


def _eager(q, k, v, key_mask, scale):
    # (B, Nh, T, hd) x (B, Nkv, S, hd): expand the shared KV heads, softmax in fp32.
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if key_mask is not None and key_mask.dtype == torch.bool:
        scores = scores.masked_fill(~key_mask[:, None, None, :], MASK_VALUE)
    elif key_mask is not None:
        scores = scores + key_mask.float()
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


def _sdpa(q, k, v, key_mask, scale):
    mask = None
    if key_mask is not None:
        mask = additive_mask(key_mask, q.dtype) if key_mask.dtype == torch.bool else key_mask.to(q.dtype)
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and q.device.type == "cpu":
        # CPU SDPA kernels do not all support GQA; the expansion is cheap at CPU sizes.
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        groups = 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)


@functools.cache
def _half_scores_supported(device: torch.device) -> bool:
    """Whether `baddbmm` takes half operands with a float32 output (`out_dtype`) on `device` (a capability probe)."""
    if device.type != "cuda":
        return False
    x = torch.zeros(1, 1, 1, dtype=torch.bfloat16, device=device)
    try:
        torch.baddbmm(torch.zeros(1, 1, 1, device=device), x, x, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _scores_fp32(q: torch.Tensor, kt: torch.Tensor, mask: torch.Tensor, scale: float, grad: bool) -> torch.Tensor:
    """Scores `mask + scale * q @ kt` in float32.

    Half operands with float32 output where the device supports it (outside autograd), else operands upcast.
    """
    if not grad and q.dtype in (torch.float16, torch.bfloat16) and _half_scores_supported(q.device):
        return torch.baddbmm(mask, q, kt, alpha=scale, out_dtype=torch.float32)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.baddbmm(mask.to(work), q.to(work), kt.to(work), alpha=scale)


def gemm_serves(
    batch: int,
    heads: int,
    kv_heads: int,
    queries: int,
    keys: int,
    grad: bool = False,
    device: torch.device | None = None,
) -> bool:
    """Whether the "gemm" backend computes a call of this shape itself (else it hands it to flash, else SDPA).

    Callers that prebuild an additive mask use it to build the mask in the dtype the serving path adds it in
    (float32 for "gemm", the compute dtype for SDPA), so no per-call conversion runs. Under autograd (`grad`) it
    serves every size; otherwise up to `device`'s ``gemm_max_scores`` score elements (`tuning.Thresholds`).
    """
    return kv_heads == 1 and (grad or batch * heads * queries * keys <= tuning.thresholds(device).gemm_max_scores)


def gemm_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The "gemm" backend's computation at any size (`attend` hands large calls to SDPA first; see `gemm_serves`).

    One K/V head: q (B, Nh, T, hd), k and v (B, 1, S, hd), `key_mask` as `attend` takes it. Returns (B, Nh, T, hd).
    """
    b, n, t, hd = q.shape
    s = k.shape[2]
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # Rows are (token, head) when q is token-major in memory (the projection's layout), else (head, token); the
    # output keeps that layout, so the o-projection's reshape of a token-major result is free.
    token_major = q.stride(1) < q.stride(2)
    rows = q.transpose(1, 2).reshape(b, t * n, hd) if token_major else q.reshape(b, n * t, hd)
    if key_mask is None:
        mask = torch.zeros(b, 1, s, dtype=torch.float32, device=q.device)
    elif key_mask.dtype == torch.bool:
        mask = additive_mask(key_mask, torch.float32)[:, 0]
    else:
        mask = key_mask.reshape(key_mask.shape[0], 1, s).float()  # (B or 1, 1, S); expanded below
    scores = _scores_fp32(rows, k[:, 0].transpose(1, 2), mask.expand(b, rows.shape[1], s), scale, needs_grad)
    out = torch.bmm(torch.softmax(scores, dim=-1).to(v.dtype), v[:, 0])  # (B, rows, hd)
    if token_major:
        return out.view(b, t, n, hd).transpose(1, 2)
    return out.view(b, n, t, hd)


def triton_device_status(device: torch.device) -> str | None:
    """Why the Triton attention kernel cannot run on `device` (triton missing, not CUDA), or None.

    What "auto" asks of a device before it picks "triton_flash"; a call's own checks are `triton_shape_status`.
    """
    if not kernels.HAS_TRITON:
        return "triton is not installed"
    if device.type != "cuda":
        return f"device is {device.type}, not CUDA"
    return None


def triton_shape_status(
    device: torch.device, dtype: torch.dtype, kv_heads: int, head_dim: int, grad: bool = False
) -> str | None:
    """Why "triton" hands a call of this geometry to "gemm", or None when `attention_kernel` runs it.

    Under Triton's interpreter (tests) a CPU device runs the kernel too.
    """
    reason = triton_device_status(device)
    if reason is not None and not (kernels.INTERPRETED and device.type == "cpu"):
        return reason
    if dtype not in FLASH_DTYPES:
        return f"dtype {dtype} (the kernel runs float16/bfloat16)"
    if grad:
        return "autograd call (the kernel is forward-only)"
    if kv_heads != 1:
        return f"{kv_heads} K/V heads (the kernel folds the query heads of one)"
    if not 8 <= head_dim <= 256:
        return f"head_dim {head_dim} (the kernel runs 8..256)"
    return None


FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_dtype_status(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FlashAttention-4 runs no call in `dtype` on `device` (`flash_device_status`, or the dtype), or None.

    What "auto" and a "flash" request ask of a device and dtype; a call's own checks are `flash_shape_status`.
    """
    reason = flash_device_status(device)
    if reason is None and dtype not in FLASH_DTYPES:
        reason = f"dtype {dtype} (flash runs float16/bfloat16)"
    return reason


def flash_shape_status(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, grad: bool = False
) -> str | None:
    """Why a call of this geometry does not run FlashAttention-4, or None when it does (see `served_by`)."""
    reason = flash_dtype_status(device, dtype)
    if reason is not None:
        return reason
    if grad:
        return "autograd call (flash is routed forward-only)"
    major = torch.cuda.get_device_capability(device)[0]
    widths = "8..256" if major == 9 else "8..128 or 256"  # flash_attn.cute's _validate_head_dims
    fits = 8 <= head_dim <= 256 if major == 9 else 8 <= head_dim <= 128 or head_dim == 256
    if head_dim % 8 or not fits:
        return f"head_dim {head_dim} (sm{major}x runs multiples of 8 in {widths})"
    if heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} K/V heads"
    return None


@functools.cache
def _flash_probe(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, masked: bool
) -> str | None:
    """Run one tiny call of this geometry against the float32 reference: None, or the exact failure (cached)."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(2, heads, 5, head_dim, device=device, generator=gen).to(dtype)
        k = torch.randn(2, kv_heads, 40, head_dim, device=device, generator=gen).to(dtype)
        v = torch.randn(2, kv_heads, 40, head_dim, device=device, generator=gen).to(dtype)
        mask = (torch.arange(40, device=device) % 3 != 1).expand(2, 40) if masked else None
        out = _flash_call(q, k, v, mask, head_dim**-0.5).float()
        ref = _eager(q.float(), k.float(), v.float(), mask, head_dim**-0.5)
        err = ((out - ref).abs().max() / ref.abs().max()).item()
    except Exception as err:  # noqa: BLE001 - a failing kernel means "not available", with its reason
        return f"probe call failed: {type(err).__name__}: {err}"[:500]
    if not err < 2e-2:
        return f"probe call wrong: max relative error {err:.3g} against the float32 reference"
    return None


def flash_serves(q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None) -> str | None:
    """Why "flash" hands this call to SDPA, or None when FlashAttention-4 runs it.

    The first call of a geometry outside CUDA-graph capture also runs a tiny probe call (cached per geometry);
    during capture only the static checks apply (the scheduler's warm-up, which precedes capture, ran the probe).
    """
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    reason = flash_shape_status(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[-1], grad)
    return reason if reason is not None else _flash_call_status(q, k, key_mask)


def _flash_call_status(q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None) -> str | None:
    """What `flash_serves` checks beyond the geometry (`flash_shape_status`): K's dtype, and the probe call."""
    if k.dtype != q.dtype:
        return f"k dtype {k.dtype} != q dtype {q.dtype}"
    if torch.cuda.is_current_stream_capturing():
        return None
    return _flash_probe(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[-1], key_mask is not None)


def valid_first_rows(valid: torch.Tensor) -> torch.Tensor:
    """(B, S) bool validity -> (B, S) int64 destination row of each key in a stable valid-first order.

    Key j goes to its rank among the valid keys, else to the valid count + its rank among the invalid ones.

    Example:
        >>> valid_first_rows(torch.tensor([[True, False, True, False]])).tolist()
        [[0, 2, 1, 3]]
    """
    num_valid = valid.sum(dim=1, keepdim=True)
    return torch.where(valid, valid.cumsum(1) - 1, num_valid + (~valid).cumsum(1) - 1)


def _valid_first(
    k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, S, N, hd) keys and values with each row's valid keys moved to the front, and the (B,) int32 valid counts.

    A stable permutation (`valid_first_rows`), one index for both tensors.
    """
    index = valid_first_rows(valid)[:, :, None, None].expand(k.shape)
    num_valid = valid.sum(dim=1, dtype=torch.int32)
    return k.new_empty(k.shape).scatter_(1, index, k), v.new_empty(v.shape).scatter_(1, index, v), num_valid


def _flash_call(q, k, v, key_mask, scale, key_lengths=None):
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func  # optional, imported lazily

    # FlashAttention takes (B, T, Nh, hd) and (B, S, Nkv, hd); it packs the query heads of a K/V head (GQA/MQA).
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if key_mask is None:
        out, _ = flash_attn_func(qt, kt, vt, softmax_scale=scale)
        return out.transpose(1, 2)
    if key_lengths is None:  # move each row's valid keys to the front (a copy of K and V)
        b, s = q.shape[0], k.shape[2]
        if key_mask.dtype == torch.bool:
            valid = key_mask.expand(b, s)
        else:  # a prebuilt additive mask (B or 1, 1, 1, S): 0 marks a valid key
            valid = (key_mask.reshape(key_mask.shape[0], s) == 0).expand(b, s)
        kt, vt, key_lengths = _valid_first(kt, vt, valid)
    out, _ = flash_attn_varlen_func(qt, kt, vt, seqused_k=key_lengths, softmax_scale=scale)
    return out.transpose(1, 2)


HANDOVER = {"triton_flash": "triton", "triton": "gemm", "gemm": "sdpa", "flash": "sdpa", "flash_large": "sdpa"}
"""Where each backend hands a call it does not serve itself ("eager" and "sdpa" serve every call)."""
KERNEL_OF = {"flash": "flash", "flash_large": "flash", "triton_flash": "flash", "triton": "triton", "gemm": "gemm"}
"""The kernel a backend runs for the calls it serves itself (the rest: the backend's own name)."""


class Geometry(NamedTuple):
    """The shape of one attention call, as the routing rules read it."""

    batch: int
    heads: int
    kv_heads: int
    queries: int
    keys: int
    head_dim: int
    grad: bool = False


def _refusal(backend: str, device: torch.device, dtype: torch.dtype, call: Geometry) -> str | None:
    """Why `backend` does not serve a call of this geometry itself, as "<backend>: <why>", or None when it does.

    The one place the rules live: `_route` (and through it `served_by` and `attend`) and `AttentionConfig.resolve`
    (through `flash_dtype_status` / `triton_device_status`) read them.
    """
    if backend in ("eager", "sdpa"):
        return None
    if backend == "gemm":
        served = gemm_serves(call.batch, call.heads, call.kv_heads, call.queries, call.keys, call.grad, device)
        return None if served else "gemm: above gemm_max_scores or several K/V heads"
    if backend == "triton":
        reason = triton_shape_status(device, dtype, call.kv_heads, call.head_dim, call.grad)
        return None if reason is None else f"triton: {reason}"
    if backend not in ("flash", "flash_large", "triton_flash"):
        raise ValueError(f"attention backend: expected one of {BACKENDS}, got {backend!r}.")
    scores = call.batch * call.heads * call.queries * call.keys
    if backend != "flash" and scores < tuning.thresholds(device).flash_min_scores:
        return f"{backend}: below flash_min_scores"
    reason = flash_shape_status(device, dtype, call.heads, call.kv_heads, call.head_dim, call.grad)
    return None if reason is None else f"flash: {reason}"


def _route(backend: str, device: torch.device, dtype: torch.dtype, call: Geometry) -> tuple[str, str | None, str]:
    """(kernel, note, the backend that served it): `backend`'s hand-over chain walked until a backend serves.

    The kernel is "eager", "sdpa", "flash", "gemm" or "triton". Each backend serves the calls its rule admits
    (`_refusal`) and hands the others on (`HANDOVER`): "triton_flash" to "triton" below ``flash_min_scores`` or
    where flash does not run, "triton" to "gemm", "gemm", "flash" and "flash_large" to SDPA. The note says why a
    call ended on SDPA after a hand-over (the last refusal, e.g. ``flash: autograd call ...``), or that
    "triton_flash" ran flash. `attend` follows the same route, then checks what only a call's tensors tell
    (layout, the flash probe).
    """
    note = None
    while True:
        refusal = _refusal(backend, device, dtype, call)
        if refusal is None:
            kernel = KERNEL_OF.get(backend, backend)
            if backend == "triton_flash":
                note = "triton_flash: at or above flash_min_scores"
            elif kernel != "sdpa":
                note = None
            return kernel, note, backend
        note, backend = refusal, HANDOVER[backend]


def served_by(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    batch: int,
    heads: int,
    kv_heads: int,
    queries: int,
    keys: int,
    head_dim: int,
    grad: bool = False,
) -> str:
    """The kernel a call of this shape runs: "eager", "sdpa", "gemm", "triton" or the flash kernel name (`_route`).

    A hand-over says why, e.g. ``sdpa (flash: autograd call ...)``. The flash probe is not run here: its result is
    reported once it ran (`flash_probe_result`).
    """
    call = Geometry(batch, heads, kv_heads, queries, keys, head_dim, grad)
    kernel, note, _ = _route(backend, device, dtype, call)
    name = flash_kernel_name() if kernel == "flash" else kernel
    return name if note is None else f"{name} ({note})"


def flash_probe_result(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, masked: bool
) -> str | None:
    """Run (or recall) the probe call of this geometry: None when FlashAttention-4 computed it correctly."""
    reason = flash_shape_status(device, dtype, heads, kv_heads, head_dim)
    return reason if reason is not None else _flash_probe(device, dtype, heads, kv_heads, head_dim, masked)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    backend: str,
    key_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multi-query attention; `key_mask` is (B, S) bool validity or a prebuilt `additive_mask`.

    The kernel is `_route`'s for the call's shape; where the call's tensors refuse it (the Triton kernel's layout
    rules, a failed flash probe), the call goes on along the backend's hand-over chain. `key_lengths` (B,) int32
    says that each row's valid keys are its first ``key_lengths[b]`` (as `key_mask` says): FlashAttention then
    reads K and V in place instead of a valid-first copy. Returns (B, Nh, T, hd) in v's dtype.
    """
    b, n, t, hd = q.shape
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    call = Geometry(b, n, k.shape[1], t, k.shape[2], hd, grad)
    while True:
        kernel, _, via = _route(backend, q.device, q.dtype, call)
        if kernel == "sdpa":
            return _sdpa(q, k, v, key_mask, scale)
        if kernel == "gemm":
            return gemm_attention(q, k, v, key_mask, scale)
        if kernel == "triton" and attention_kernel.serves(q, k, v):
            if key_mask is not None and key_mask.dtype == torch.bool:
                key_mask = additive_mask(key_mask, torch.float32)
            return attention_kernel.attend(q, k, v, key_mask, scale)
        if kernel == "flash" and _flash_call_status(q, k, key_mask) is None:
            return _flash_call(q, k, v, key_mask, scale, key_lengths)
        if kernel == "eager":
            return _eager(q, k, v, key_mask, scale)
        backend = HANDOVER[via]  # the call's tensors refused the kernel: on along the chain


@dataclass
class AttentionConfig:
    """Which backend each call site asks for: "auto" or one of `BACKENDS`.

    "auto" follows the H200 measurements (`attention_backend.jsonl`, `attention_variants.jsonl`): for the prefix and the
    expert on CUDA "triton_flash" where triton is installed (the Triton kernel, and FlashAttention-4 for calls of at
    least the device's ``flash_min_scores`` score elements where it runs: CUDA sm90/sm100, a half dtype,
    `flash_attn.cute` importable; the expert's autograd calls go to "gemm"); without triton "flash_large" for the prefix
    (the same hand-over, to SDPA below it) and "gemm" for the expert; SDPA for the vision tower (the Triton kernel ran
    its 16-head calls 2.9x slower: `attention_backend.jsonl` rows with ``tune`` at site "vision") and everywhere else
    (`AUTO` lists each site's candidates in that order). A request that cannot be served falls back (flash -> sdpa,
    triton -> gemm -> sdpa: `HANDOVER`) and the fallback is recorded in `AttentionPlan.reasons`; `AttentionPlan.flash`
    says which flash kernel runs, or why none does.

    Example:
        >>> plan = AttentionConfig(prefix="eager").resolve(torch.device("cpu"), torch.float32)
        >>> plan.vision, plan.prefix, plan.expert
        ('sdpa', 'eager', 'sdpa')
    """

    vision: str = "auto"
    """Backend for the SigLIP tower (unmasked)."""
    prefix: str = "auto"
    """Backend for the LM over the prefix (key-padding mask)."""
    expert: str = "auto"
    """Backend for the action expert over [prefix K/V | suffix] (key-padding mask)."""

    def __post_init__(self) -> None:
        for site in SITES:
            value = getattr(self, site)
            if value not in (*BACKENDS, "auto"):
                raise ValueError(
                    f"AttentionConfig.{site}: expected one of {('auto', *BACKENDS)}, got {value!r}."
                )

    def resolve(self, device: torch.device, dtype: torch.dtype) -> AttentionPlan:
        """Pick a concrete backend per site for `device` and `dtype` ("auto": the first of `AUTO` the device runs)."""
        no_flash = flash_dtype_status(device, dtype)
        plan = AttentionPlan(flash=flash_kernel_name() if no_flash is None else f"not run: {no_flash}")
        for site in SITES:
            want = getattr(self, site)
            if want == "auto":
                refused = []
                for choice in AUTO[site]:
                    if _auto_refusal(choice, device, dtype) is None:
                        break
                    refused.append(choice)
                if choice == "triton_flash" and no_flash is not None:
                    plan.reasons[site] = f"auto: large calls stay on triton, flash not run ({no_flash})"
                elif choice == "sdpa" and "flash_large" in refused:
                    plan.reasons[site] = f"auto: flash not run ({no_flash}); using sdpa"
            elif want in ("flash", "flash_large") and no_flash is not None:
                choice = "sdpa"
                plan.reasons[site] = f"flash requested but {no_flash}; fell back to sdpa"
            else:
                choice = want
            setattr(plan, site, choice)
        return plan


AUTO = {
    "vision": ("sdpa",),
    "prefix": ("triton_flash", "flash_large", "sdpa"),
    "expert": ("triton_flash", "gemm", "sdpa"),
}
"""Each site's "auto" candidates, best first (`AttentionConfig`); a site takes the first its device runs."""


def _auto_refusal(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why "auto" passes over `backend` on `device` in `dtype`: the device-wide parts of `_refusal`'s rules.

    "triton_flash" needs the Triton kernel's device (its hand-overs serve every other call); "flash_large" a device
    and dtype flash runs; "gemm" CUDA (where it was measured; it computes anywhere).
    """
    if backend == "triton_flash":
        return triton_device_status(device)
    if backend == "flash_large":
        return flash_dtype_status(device, dtype)
    if backend == "gemm" and device.type != "cuda":
        return f"device is {device.type}, not CUDA"
    return None


@dataclass
class AttentionPlan:
    """The backend each site uses, and why a request was not honoured (see `AttentionConfig`)."""

    vision: str = "sdpa"
    prefix: str = "sdpa"
    expert: str = "sdpa"
    reasons: dict[str, str] = field(default_factory=dict)
    flash: str = "not run"
    """The FlashAttention kernel "flash" calls (``flash_attn.cute <version>``), or ``not run: <why>``."""

    def report(self) -> dict[str, str]:
        """Site -> backend, ``flash`` -> kernel or why not run, plus `<site>_note` entries for fallbacks."""
        out = {site: getattr(self, site) for site in SITES}
        out["flash"] = self.flash
        out.update({f"{site}_note": note for site, note in self.reasons.items()})
        return out
