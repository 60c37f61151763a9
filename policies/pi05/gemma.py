"""Gemma building blocks shared by the PaliGemma LM (prefix stream) and the action expert (suffix stream).

Parameter names follow transformers' Gemma (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, ...) so that
LeRobot/openpi checkpoints map by prefix only. The expert's norms are adaptive (adaRMS: a Dense of the time
condition gives scale | shift | gate); the LM's are plain (1 + w) RMSNorms. Norm statistics run in float32.

Each block owns its kernel choice: `add_norm` (a residual add and the next norm) and `project` (q/k/v with RoPE)
take `use_kernels`, decided once per call by the stack (`kernels.fused_path`): True runs the fused kernels of
`kernels.py`, False the PyTorch reference ops, which are the unfused model's ops in its order (bit-identical).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import geglu_gemm, kernels
from .config import GemmaConfig
from .kernels import geglu

Modulation = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(1 + scale, shift, gate), each (B or 1, 1, width), broadcast over tokens (precomputed per step at setup)."""


def upcast(x: torch.Tensor) -> torch.Tensor:
    """`x` in at least float32: float64 stays float64 (float64 models for gradcheck/references), else float32."""
    return x if x.dtype == torch.float64 else x.float()


def upcast_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype `upcast` gives for a tensor of `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """X * rsqrt(mean(x^2) + eps), statistics in float32 (one fused kernel where PyTorch has it), x's dtype."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


class RMSNorm(nn.Module):
    """Gemma RMSNorm with the (1 + w) multiplier, w zero-initialised (weight kept float32)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., width) -> (..., width) in x's dtype."""
        if x.dtype in (torch.float32, torch.float64):
            return rms_normalize(x, self.eps) * (1.0 + self.weight.to(x.dtype))
        # Half dtypes: one fused pass (statistics in float32 inside the kernel), weight applied in x's dtype.
        return F.rms_norm(x, (x.shape[-1],), weight=(1.0 + self.weight.float()).to(x.dtype), eps=self.eps)

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, use_kernels: bool, store_residual: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(r, norm(r)) for the residual r = x + delta (delta None: x): `kernels.add_norm` or the plain add and norm.

        `store_residual=False` (the final norm) lets the kernel skip writing r.
        """
        if use_kernels:
            return kernels.add_norm(x, delta, self.weight, self.eps, add_one=True, store_residual=store_residual)
        r = x if delta is None else x + delta
        return r, self(r)


class AdaRMSNorm(nn.Module):
    """Adaptive RMSNorm: `dense(cond)` -> scale | shift | gate; y = r (1 + scale) + shift.

    The checkpoint holds only `dense.{weight,bias}` (zero-initialised kernel: every gated branch starts off).
    """

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(width, 3 * width)
        nn.init.zeros_(self.dense.weight)

    def modulation(self, cond: torch.Tensor) -> Modulation:
        """(B, width) condition -> (1 + scale, shift, gate), each (B, 1, width) in float32 (float64 stays)."""
        m = F.linear(upcast(cond), upcast(self.dense.weight), upcast(self.dense.bias))
        scale, shift, gate = m[:, None, :].chunk(3, dim=-1)
        return 1.0 + scale, shift, gate

    def forward(self, x: torch.Tensor, mod: Modulation) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise x with a modulation; returns (y, gate) in x's dtype.

        In float32/float64 the whole formula runs in that dtype; for half dtypes the statistics are float32
        inside the fused norm and the modulation is applied in x's dtype (the tables are stored so).
        """
        scale1, shift, gate = mod
        if x.dtype in (torch.float32, torch.float64) or scale1.dtype == x.dtype:
            y = torch.addcmul(shift.to(x.dtype), rms_normalize(x, self.eps), scale1.to(x.dtype))
            return y, gate.to(x.dtype)
        y = torch.addcmul(shift, rms_normalize(x.float(), self.eps), scale1)
        return y.to(x.dtype), gate.to(x.dtype)

    def add_norm(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        gate: torch.Tensor | None,
        mod: Modulation,
        use_kernels: bool,
        out_dtype: torch.dtype | None = None,
        store_residual: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(r, y, this norm's gate) for the gated residual r = x + gate * delta (delta None: x) and y = norm(r, mod).

        `gate` is what the previous norm returned; `out_dtype` stores y so (the final norm's float32), and
        `store_residual=False` lets the kernel skip writing r. `kernels.add_norm`, or addcmul and `forward`.
        """
        scale1, shift, next_gate = mod
        if use_kernels:
            r, y = kernels.add_norm(x, delta, scale1, self.eps, gate=gate, shift=shift, out_dtype=out_dtype,
                                    store_residual=store_residual)  # fmt: skip
            return r, y, next_gate
        r = x if delta is None else torch.addcmul(x, delta, gate)
        y, next_gate = self(r, mod)
        return r, y if out_dtype is None else y.to(out_dtype), next_gate


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) int positions -> cos and signed sin, each (B, 1, T, head_dim) in `dtype` (rotate-half layout).

    The angles are computed in float32 (float64 for float64); the signed sin is [-sin | sin] so that
    `apply_rope` needs a half swap, not a concatenation.
    """
    half = head_dim // 2
    work = upcast_dtype(dtype)
    inv_freq = theta ** (-torch.arange(0, half, device=positions.device, dtype=work) * 2.0 / head_dim)
    angles = positions.to(work)[..., None] * inv_freq  # (B, T, half)
    sin = angles.sin()
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None]
    signed_sin = torch.cat([-sin, sin], dim=-1)[:, None]
    return cos.to(dtype), signed_sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on (B, N, T, hd): x cos + [x2 | x1] [-sin | sin], in the dtype of cos/sin."""
    b, n, t, hd = x.shape
    x = x.to(cos.dtype)
    swapped = x.reshape(b, n, t, 2, hd // 2).flip(-2).reshape(b, n, t, hd)
    return torch.addcmul(x * cos, swapped, signed_sin)


class GemmaAttentionProj(nn.Module):
    """Bias-free q/k/v/o projections: q width -> N*hd, k/v width -> Nkv*hd, o N*hd -> width."""

    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.width, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.width, bias=False)

    def fused_parts(self) -> list[torch.Tensor]:
        """The weights `fused_weight` stacks, in its row order."""
        return [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]

    def fused_weight(self) -> torch.Tensor:
        """[q; k; v] rows stacked: one GEMM instead of three (a derived copy, refreshed after weight updates)."""
        return torch.cat(self.fused_parts(), dim=0)

    def qkv(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        need_q: bool = True,
        fused: torch.Tensor | None = None,
    ):
        """(B, T, width) -> q (B, N, T, hd) or None, k and v (B, Nkv, T, hd); RoPE applied to q and k.

        With `fused` (see `fused_weight`) q, k, v come from one GEMM and RoPE runs once over q and k together.
        """
        b, t, _ = h.shape
        if fused is not None:
            n, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
            y = F.linear(h, fused)  # (B, T, (N + 2 Nkv) hd)
            qk = apply_rope(y[..., : (n + nkv) * hd].reshape(b, t, n + nkv, hd).transpose(1, 2), cos, sin)
            v = y[..., (n + nkv) * hd :].reshape(b, t, nkv, hd).transpose(1, 2)
            return qk[:, :n], qk[:, n:], v
        k = self.k_proj(h).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        k = apply_rope(k, cos, sin)
        q = None
        if need_q:
            q = self.q_proj(h).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
            q = apply_rope(q, cos, sin)
        return q, k, v

    def project(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        use_kernels: bool,
        fused: torch.Tensor | None = None,
        need_q: bool = True,
        k_out: torch.Tensor | None = None,
        v_out: torch.Tensor | None = None,
        kv_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(B, T, width) -> q (B, N, T, hd) or None, k and v (B, Nkv, T, hd) for attention, RoPE on q and k.

        `k_out`, `v_out` (B, Nkv, T', hd): where K and V are written too (cache slots). With `use_kernels` one
        `kernels.qkv_rope` writes q token-major and K/V into them (rows `kv_rows` (B, T) where given; fresh slots
        where they are None) after one GEMM (`fused`, see `fused_weight`) or three; cos/sin are then (B, T, hd)
        (`rope_cos_sin(...)[:, 0]`) and the returned k, v are the slots. Else `qkv` (cos/sin (B, 1, T, hd)), with
        K/V copied into the slots: the returned k, v are `qkv`'s own tensors (the slots are not read back).
        """
        if not use_kernels:
            q, k, v = self.qkv(h, cos, sin, need_q, fused)
            if k_out is not None and v_out is not None:
                k_out.copy_(k)
                v_out.copy_(v)
            return q, k, v
        b, t, _ = h.shape
        n, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if k_out is None or v_out is None:
            k_out = torch.empty(b, nkv, t, hd, dtype=h.dtype, device=h.device)
            v_out = torch.empty_like(k_out)
        if fused is not None:  # one GEMM: [q;k;v], or the [k;v] rows when q is not needed
            y = F.linear(h, fused if need_q else fused[n * hd :]).view(b, t, -1, hd)
            q_src, k_src, v_src = y[:, :, :n] if need_q else None, y[:, :, -2 * nkv : -nkv], y[:, :, -nkv:]
        else:
            q_src = self.q_proj(h).view(b, t, n, hd) if need_q else None
            k_src, v_src = self.k_proj(h).view(b, t, nkv, hd), self.v_proj(h).view(b, t, nkv, hd)
        q = torch.empty(b, t, n, hd, dtype=h.dtype, device=h.device) if need_q else None
        kernels.qkv_rope(q_src, k_src, v_src, cos, sin, q, k_out.transpose(1, 2), v_out.transpose(1, 2), kv_rows)
        return (q.transpose(1, 2) if q is not None else None), k_out, v_out

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        """(B, N, T, hd) -> (B, T, width)."""
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)); the activation and product are one fused kernel on CUDA."""

    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.width, cfg.mlp_dim, bias=False)
        self.up_proj = nn.Linear(cfg.width, cfg.mlp_dim, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_dim, cfg.width, bias=False)

    def fused_parts(self) -> list[torch.Tensor]:
        """The weights `fused_weight` stacks, in its row order."""
        return [self.gate_proj.weight, self.up_proj.weight]

    def fused_weight(self) -> torch.Tensor:
        """[gate; up] rows stacked (a derived copy, refreshed after weight updates)."""
        return torch.cat(self.fused_parts(), dim=0)

    def forward(
        self, x: torch.Tensor, fused: torch.Tensor | None = None, stack: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(..., width) -> (..., width).

        `fused` = `fused_weight()` runs gate and up as one GEMM; `stack` (`geglu_gemm.stack_gate_up`'s blocks) gate,
        up and GeGLU as one (`geglu_gemm.geglu_linear`).
        """
        if stack is not None:
            return self.down_proj(geglu_gemm.geglu_linear(x, stack))
        if fused is not None:
            gate, up = F.linear(x, fused).chunk(2, dim=-1)
            return self.down_proj(geglu(gate, up))
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


class GemmaLayer(nn.Module):
    """One decoder layer of either stream; `adaptive` selects adaRMS norms and gated residuals."""

    def __init__(self, cfg: GemmaConfig, adaptive: bool) -> None:
        super().__init__()
        norm = AdaRMSNorm if adaptive else RMSNorm
        self.adaptive = adaptive
        self.input_layernorm = norm(cfg.width, cfg.eps)
        self.self_attn = GemmaAttentionProj(cfg)
        self.post_attention_layernorm = norm(cfg.width, cfg.eps)
        self.mlp = GemmaMLP(cfg)


class GemmaStack(nn.Module):
    """Layers + final norm (+ token embedding for the LM), named as transformers' `GemmaModel`.

    Example:
        >>> from policies.pi05.config import GemmaConfig
        >>> stack = GemmaStack(GemmaConfig(width=16, depth=2, mlp_dim=32, num_heads=2, head_dim=8), adaptive=True)
        >>> len(stack.layers), stack.norm.dense.out_features
        (2, 48)
    """

    def __init__(self, cfg: GemmaConfig, adaptive: bool, vocab_size: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.adaptive = adaptive
        if vocab_size is not None:
            self.embed_tokens = nn.Embedding(vocab_size, cfg.width)
        self.layers = nn.ModuleList(GemmaLayer(cfg, adaptive) for _ in range(cfg.depth))
        self.norm = AdaRMSNorm(cfg.width, cfg.eps) if adaptive else RMSNorm(cfg.width, cfg.eps)

    def adaptive_norms(self) -> list[AdaRMSNorm]:
        """All adaRMS norms in a fixed order: per layer (input, post-attention), then the final norm."""
        norms: list[AdaRMSNorm] = []
        for layer in self.layers:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
        return [*norms, self.norm]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids -> embeddings x sqrt(width), the factor cast to the table dtype (applied exactly once)."""
        table = self.embed_tokens.weight
        scale = float(torch.tensor(self.cfg.width**0.5, dtype=table.dtype))  # host scalar: capture-safe
        return F.embedding(tokens.long(), table) * scale
