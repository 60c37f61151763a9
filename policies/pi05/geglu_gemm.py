"""The LM's gate and up projections and GeGLU as one Triton GEMM: gelu_tanh(x W_gate^T) * (x W_up^T).

The unfused path runs two cuBLAS GEMMs that write the (M, F) gate and up activations in bf16 and a GeGLU kernel that
reads both back and writes their product: at case (a) batch 64 (M = 62k prefix tokens, F = 16384) that is 6 GB of
traffic a layer beyond the GEMMs. Here one program computes an output tile's gate and up accumulators from the same
x tile (two MMAs a K step, float32 accumulation), applies the GeGLU to the float32 accumulators and writes only the
product: the activations never reach memory. Operands are loaded by TMA (host tensor descriptors, zero padding at the
ragged M edge); program ids are grouped along M so that a group's x tiles and weight tiles stay in L2.

Rounding: one rounding, of the product (the unfused path also rounds gate and up to bf16 first), so it is at least
as close to a float32 model as the unfused path and not bitwise equal to it.

Where it runs: CUDA sm90+ half tensors outside autograd, x (M, K) row-major with K a multiple of 16, weights
(F, K) contiguous (`serves`); under ``TRITON_INTERPRET=1`` also CPU half tensors (the CPU tests).

Example:
    >>> import torch
    >>> x, wg, wu = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8, 16)
    >>> tuple(reference(x, wg, wu).shape)
    (4, 8)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kernels


@dataclass(frozen=True)
class GemmTiles:
    """Launch geometry: output rows and columns per program, K per step, programs per M group, warps, stages.

    Example:
        >>> GemmTiles().block_n
        128
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


DEFAULT_TILES = GemmTiles(group_m=16, num_stages=4)


if kernels.HAS_TRITON:  # pragma: no cover - needs a CUDA GPU or the interpreter
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def tile_origin(tile, grid_m, grid_n, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # noqa: N803
        """(first row, first column) of output tile `tile`; tiles are grouped GROUP_M along M (shared L2 tiles)."""
        per_group = GROUP_M * grid_n
        first_m = (tile // per_group) * GROUP_M
        rows = min(grid_m - first_m, GROUP_M)
        return (first_m + (tile % per_group) % rows) * BLOCK_M, ((tile % per_group) // rows) * BLOCK_N

    @triton.jit
    def _geglu_gemm_kernel(
        x_desc, g_desc, u_desc, o_desc, m, n,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # noqa: N803
        GROUP_M: tl.constexpr,  # noqa: N803
        NUM_STAGES: tl.constexpr, INTERPRET: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        grid_m, grid_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
        off_m, off_n = tile_origin(tl.program_id(0), grid_m, grid_n, GROUP_M, BLOCK_M, BLOCK_N)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):  # K: the model width, a constant
            off_k = step * BLOCK_K
            x, g, u = x_desc.load([off_m, off_k]), g_desc.load([off_n, off_k]), u_desc.load([off_n, off_k])
            if INTERPRET:  # the interpreter's tl.dot misreads bfloat16; half products are exact in float32
                x, g, u = x.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
            acc_g = tl.dot(x, g.T, acc_g)
            acc_u = tl.dot(x, u.T, acc_u)
        o_desc.store([off_m, off_n], (kernels._gelu_tanh(acc_g) * acc_u).to(o_desc.dtype))


def serves(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor) -> bool:
    """Whether `geglu_linear` runs this call: CUDA sm90+ (or the interpreter) half operands, no autograd, row-major."""
    if not kernels.triton_serves(x) or x.dim() < 2:
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or gate_w.requires_grad or up_w.requires_grad)
    k = x.shape[-1]
    return (
        not needs_grad
        and gate_w.shape == up_w.shape
        and gate_w.shape[1] == k
        and k % 16 == 0
        and gate_w.shape[0] % 8 == 0
        and x.dtype == gate_w.dtype == up_w.dtype
        and x.is_contiguous()
        and gate_w.is_contiguous()
        and up_w.is_contiguous()
    )


def geglu_linear(
    x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, tiles: GemmTiles = DEFAULT_TILES
) -> torch.Tensor:
    """gelu_tanh(x gate_w^T) * (x up_w^T): (..., K) -> (..., F) in x's dtype.

    One kernel where `serves`, else the two GEMMs and `kernels.geglu`. `tiles`: the benchmarks' override of the
    launch geometry.
    """
    if not serves(x, gate_w, up_w):
        return kernels.geglu(F.linear(x, gate_w), F.linear(x, up_w))
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    m, n = rows.shape[0], gate_w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    x_desc = TensorDescriptor.from_tensor(rows, [bm, bk])
    g_desc = TensorDescriptor.from_tensor(gate_w, [bn, bk])
    u_desc = TensorDescriptor.from_tensor(up_w, [bn, bk])
    o_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _geglu_gemm_kernel[grid](x_desc, g_desc, u_desc, o_desc, m, n, K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             GROUP_M=tiles.group_m, NUM_STAGES=tiles.num_stages, INTERPRET=kernels.INTERPRETED,
                             num_warps=tiles.num_warps)  # fmt: skip
    return out.view(*x.shape[:-1], n)


def reference(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor) -> torch.Tensor:
    """What `geglu_linear` computes, in float32: gelu_tanh(x gate_w^T) * (x up_w^T)."""
    x, gate_w, up_w = x.float(), gate_w.float(), up_w.float()
    return F.gelu(x @ gate_w.T, approximate="tanh") * (x @ up_w.T)
