"""SigLIP vision tower (So400m/14 in the published model): conv stem, learned positions, pre-LN blocks.

Parameter names follow transformers' `SiglipVisionModel.vision_model` so checkpoints map by prefix only.
The stem (patch conv + position embedding) and every LayerNorm run in float32; the blocks in the model dtype.
One block stack: each block adds its pending residual inside its LayerNorm (`add_layer_norm`), with
`use_kernels` (where `kernels.fused_path` holds: CUDA half precision, no autograd) as the fused kernel
(`kernels.add_layer_norm`), else as the plain add and LayerNorm of the reference (the unfused ops, bit-identical).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .attention import attend
from .config import SiglipConfig


def layer_norm_fp32(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """LayerNorm with float32 statistics, returned in the input dtype.

    float32/float64 inputs run in their own dtype; half inputs go through one kernel that accumulates in
    float32 (the float32 affine parameters are cast to the input dtype, a few KiB).
    """
    return F.layer_norm(x, norm.normalized_shape, norm.weight.to(x.dtype), norm.bias.to(x.dtype), norm.eps)


def add_layer_norm(
    x: torch.Tensor, delta: torch.Tensor | None, norm: nn.LayerNorm, use_kernels: bool, store_residual: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, layer_norm_fp32(r)) for r = x + delta (delta None: x itself).

    `use_kernels`: one kernel (`kernels.add_layer_norm`; `store_residual=False` skips writing r), else the add and
    `layer_norm_fp32`.
    """
    if use_kernels:
        return kernels.add_layer_norm(x, delta, norm.weight, norm.bias, norm.eps, store_residual)
    r = x if delta is None else x + delta
    return r, layer_norm_fp32(r, norm)


class SiglipEmbeddings(nn.Module):
    """Patch convolution + learned position embedding (float32)."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, cfg.width, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.width)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) float in [-1, 1] -> (B, P, width) float32."""
        w = self.patch_embedding.weight
        x = F.conv2d(pixels.to(w.dtype), w, self.patch_embedding.bias, stride=self.patch_embedding.stride)
        x = x.flatten(2).transpose(1, 2)  # (B, P, width), row-major over the patch grid
        return x.float() + self.position_embedding.weight.float()[None]


class SiglipAttention(nn.Module):
    """Full (unmasked) multi-head attention with biases."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.width, cfg.width)
        self.k_proj = nn.Linear(cfg.width, cfg.width)
        self.v_proj = nn.Linear(cfg.width, cfg.width)
        self.out_proj = nn.Linear(cfg.width, cfg.width)

    def fused_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The weights and the biases `fused_weight` stacks, in its row order."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        return [p.weight for p in projs], [p.bias for p in projs]

    def fused_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[q; k; v] weight and bias rows stacked: one GEMM instead of three (a copy, refreshed with the weights)."""
        weights, biases = self.fused_parts()
        return torch.cat(weights), torch.cat(biases)

    def forward(
        self, x: torch.Tensor, backend: str, fused: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """(B, P, width) -> (B, P, width); `fused` (see `fused_weight`) runs q, k and v as one GEMM."""
        b, p, _ = x.shape
        shape = (b, p, self.num_heads, self.head_dim)
        if fused is not None:
            q, k, v = F.linear(x, *fused).view(b, p, 3, *shape[2:]).unbind(2)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            q = self.q_proj(x).view(shape).transpose(1, 2)
            k = self.k_proj(x).view(shape).transpose(1, 2)
            v = self.v_proj(x).view(shape).transpose(1, 2)
        out = attend(q, k, v, None, self.head_dim**-0.5, backend)
        return self.out_proj(out.transpose(1, 2).reshape(b, p, -1))


class SiglipMLP(nn.Module):
    """fc1 -> GELU (tanh approximation) -> fc2."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.width, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.width)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """(..., width) -> (..., width); `fused`: the GELU as `kernels.gelu_tanh_` where it serves."""
        h = self.fc1(x)
        return self.fc2(kernels.gelu_tanh_(h) if fused else F.gelu(h, approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    """Pre-LN block: x += attn(LN1 x); x += mlp(LN2 x)."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.width, eps=cfg.eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.width, eps=cfg.eps)
        self.mlp = SiglipMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        backend: str,
        use_kernels: bool = False,
        qkv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block with the pending residual `delta` (the previous block's MLP output) added inside LN1.

        (B, P, width) x and delta (None for the first block) -> (x + delta + attn, this block's MLP output, not
        yet added: the next block's LN1 or the post-layernorm adds it). `use_kernels`: the adds and norms as one
        kernel each, and the GELU in place (see `add_layer_norm`); `qkv`: the fused [q;k;v] weight and bias.
        """
        x, h = add_layer_norm(x, delta, self.layer_norm1, use_kernels)
        x, h = add_layer_norm(x, self.self_attn(h, backend, qkv), self.layer_norm2, use_kernels)
        return x, self.mlp(h, fused=use_kernels)


class SiglipEncoder(nn.Module):
    """Stack of encoder layers (container named as in transformers)."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.depth))


class SiglipVisionTower(nn.Module):
    """SigLIP vision tower without pooling: all patch tokens are kept.

    Example:
        >>> from policies.pi05.config import SiglipConfig
        >>> tower = SiglipVisionTower(SiglipConfig(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=56))
        >>> tower(torch.zeros(2, 3, 224, 224), backend="eager").shape
        torch.Size([2, 16, 32])
    """

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.width, eps=cfg.eps)

    def forward(
        self,
        pixels: torch.Tensor,
        backend: str = "sdpa",
        dtype: torch.dtype | None = None,
        use_kernels: bool = False,
        fused_qkv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """(B, 3, S, S) float pixels in [-1, 1] -> (B, P, width) in `dtype` (default: the block weights' dtype).

        The pending MLP output of block i is added in block i + 1's LN1, the last in the post-layernorm.
        `use_kernels`: each add and LayerNorm as one kernel where `kernels.fused_path` holds (decided once per
        call); there `fused_qkv` (per block the [q;k;v] weight and bias, `SiglipAttention.fused_weight`) runs each
        block's q, k and v as one GEMM.
        """
        dtype = dtype or self.encoder.layers[0].mlp.fc1.weight.dtype
        x = self.embeddings(pixels)  # float32, laid out (B, width, P) as the patch conv wrote it
        # the kernels read rows of unit stride: the cast writes them so (values unchanged, the same one kernel)
        x = x.to(dtype, memory_format=torch.contiguous_format) if use_kernels else x.to(dtype)
        use_kernels = kernels.fused_path(use_kernels, x)
        qkv = fused_qkv if use_kernels and fused_qkv is not None else [None] * len(self.encoder.layers)
        delta = None  # the MLP output not yet added to the residual stream x
        for layer, weights in zip(self.encoder.layers, qkv):
            x, delta = layer(x, delta, backend, use_kernels, weights)
        return add_layer_norm(x, delta, self.post_layernorm, use_kernels, store_residual=False)[1]
