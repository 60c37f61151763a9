"""Attention backends (eager reference, PyTorch SDPA, flash-attn, folded-MQA GEMMs) chosen per call site.

Every PI0.5 attention is either unmasked (SigLIP) or masked by *key validity* only (prefix: bidirectional over
valid tokens; suffix: valid prefix keys plus all action tokens). So one signature serves all sites:
``attend(q (B, Nh, T, hd), k (B, Nkv, S, hd), v, key_mask (B, S) bool | None, scale)``.

The "gemm" backend serves the denoise loop: a few action tokens against a long prefix cache, with one K/V head.
There the fused attention kernels launch one tile of queries per (batch, head) and walk the whole cache
sequentially, few tiles for a small batch: at batch 1 that is most of the denoise time. Folding the query heads
that share the K/V head into rows makes attention two batched GEMMs and a softmax over (B, Nh*T, S) scores:
float32 scores (bf16 operands, float32 accumulation and output on CUDA), float32 softmax, probabilities cast
to the value dtype for the second GEMM. Where it does not apply (several K/V heads, very large score tensors outside
autograd) it falls back to SDPA. Under autograd (the PPO trainer's `evaluate()`) it always serves, with operands
upcast to float32 (exact for bf16 values), so the trainer computes its scores as the rollout's graphs do.

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
import importlib.util
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

MASK_VALUE = -2.3819763e38
"""Additive mask value for disallowed keys (finite, as openpi and LeRobot)."""

BACKENDS = ("eager", "sdpa", "flash", "gemm")
SITES = ("vision", "prefix", "expert")


def flash_attn_available() -> bool:
    """Whether the optional flash-attn package is importable (never required)."""
    return importlib.util.find_spec("flash_attn") is not None


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


GEMM_MAX_SCORES = 1 << 22
"""Above this many score elements (B * Nh * T * S) the "gemm" backend hands over to SDPA: the float32 score
tensor's memory traffic then outweighs the fused kernel's poor occupancy (the crossover is measured by
`benchmarks/bench_expert_attention.py`)."""


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


def gemm_serves(batch: int, heads: int, kv_heads: int, queries: int, keys: int, grad: bool = False) -> bool:
    """Whether the "gemm" backend computes a call of this shape itself (else it hands it to SDPA).

    Callers that prebuild an additive mask use it to build the mask in the dtype the serving path adds it in
    (float32 for "gemm", the compute dtype for SDPA), so no per-call conversion runs. Under autograd (`grad`) it
    serves every size.
    """
    return kv_heads == 1 and (grad or batch * heads * queries * keys <= GEMM_MAX_SCORES)


def _gemm(q, k, v, key_mask, scale):
    b, n, t, hd = q.shape
    s = k.shape[2]
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not gemm_serves(b, n, k.shape[1], t, s, needs_grad):
        return _sdpa(q, k, v, key_mask, scale)
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


def _flash(q, k, v, key_mask, scale):
    from flash_attn import flash_attn_func  # optional dependency, imported lazily

    # flash-attn wants (B, T, Nh, hd); it handles MQA natively. Only unmasked sites are routed here.
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)
    return out.transpose(1, 2)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    backend: str,
) -> torch.Tensor:
    """Multi-query attention; `key_mask` is (B, S) bool validity or a prebuilt `additive_mask`.

    Returns (B, Nh, T, hd) in v's dtype.
    """
    if backend == "sdpa":
        return _sdpa(q, k, v, key_mask, scale)
    if backend == "flash":
        return _flash(q, k, v, key_mask, scale)
    if backend == "gemm":
        return _gemm(q, k, v, key_mask, scale)
    return _eager(q, k, v, key_mask, scale)


@dataclass
class AttentionConfig:
    """Which backend each call site asks for: "auto", "eager", "sdpa", "flash" or "gemm".

    "auto" takes flash-attn where it is importable, on CUDA, in a half dtype and for an unmasked site
    (vision), "gemm" for the expert on CUDA (short query blocks against the prefix cache), and SDPA everywhere
    else. A request that cannot be served falls back (flash -> sdpa) and
    the fallback is recorded in `AttentionPlan.reasons`.

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
        """Pick a concrete backend per site for `device` and `dtype`."""
        plan = AttentionPlan()
        has_flash = flash_attn_available()
        for site in SITES:
            want = getattr(self, site)
            flash_ok = has_flash and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            if want == "auto":
                choice = "flash" if (flash_ok and site == "vision") else "sdpa"
                if site == "expert" and device.type == "cuda":
                    choice = "gemm"
                elif not has_flash:
                    plan.reasons[site] = "auto: flash-attn not installed (not run); using sdpa"
            elif want == "flash" and not (flash_ok and site == "vision"):
                choice = "sdpa"
                plan.reasons[site] = (
                    "flash requested but "
                    + ("flash-attn is not installed" if not has_flash else "")
                    + ("the device is not CUDA or dtype not half" if has_flash and not flash_ok else "")
                    + ("this site is masked (flash path serves unmasked sites only)" if flash_ok else "")
                    + "; fell back to sdpa"
                )
            else:
                choice = want
            setattr(plan, site, choice)
        return plan


@dataclass
class AttentionPlan:
    """The backend each site uses, and why a request was not honoured (see `AttentionConfig`)."""

    vision: str = "sdpa"
    prefix: str = "sdpa"
    expert: str = "sdpa"
    reasons: dict[str, str] = field(default_factory=dict)

    def report(self) -> dict[str, str]:
        """Site -> backend, plus `<site>_note` entries for fallbacks."""
        out = {site: getattr(self, site) for site in SITES}
        out.update({f"{site}_note": note for site, note in self.reasons.items()})
        return out
