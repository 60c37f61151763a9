"""The LM's gate and up projections and GeGLU as one Triton GEMM: gelu_tanh(x W_gate^T) * (x W_up^T).

The unfused path runs two cuBLAS GEMMs that write the (M, F) gate and up activations in bf16 and a GeGLU kernel that
reads both back and writes their product: at case (a) batch 64 (M = 62k prefix tokens, F = 16384) that is 6 GB of
traffic a layer beyond the GEMMs. Here the activations never reach memory:

- The weight is one (2F, K) stack, gate and up rows in alternating blocks of `block_n` (`stack_gate_up`), so that an
  output tile's gate and up columns are one 2 `block_n`-wide MMA a K step over the same x tile (float32
  accumulation), split in registers after the last step.
- The GeGLU runs on the float32 accumulators (the GELU as g sigmoid(2 z), the same function as 0.5 g (1 + tanh z) in
  fewer instructions) and only the product is written.
- One program per SM walks the output tiles (grouped along M so that a group's x and weight tiles stay in L2), its
  loop nest flattened so that the next tile's TMA loads are issued while this tile finishes and runs its epilogue.
- Operands are loaded by TMA (host tensor descriptors, zero padding at the ragged M edge).

Rounding: one rounding, of the product (the unfused path also rounds gate and up to bf16 first), so it is at least
as close to a float32 model as the unfused path and not bitwise equal to it.

Where it runs: CUDA sm90+ half tensors outside autograd, x (..., K) contiguous with K a multiple of 16, the stack
contiguous, at least `GemmTiles.min_waves` output tiles an SM (`serves`; by default a tuned value per GPU); under
``TRITON_INTERPRET=1`` also CPU half tensors (the CPU tests). Elsewhere one GEMM over the stack and `kernels.geglu`
compute the same formula.

Example:
    >>> import torch
    >>> x, wg, wu = torch.randn(4, 16), torch.randn(256, 16), torch.randn(256, 16)
    >>> out = geglu_linear(x, stack_gate_up(wg, wu))
    >>> torch.allclose(out, reference(x, wg, wu), atol=1e-4)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kernels, tuning


@dataclass(frozen=True)
class GemmTiles:
    """Launch geometry: output rows and columns per tile, K per step, tiles per M group, warps, pipeline stages.

    `block_n` is also the block of the weight stack (`stack_gate_up`): read a stack with tiles of its block.

    Example:
        >>> GemmTiles().block_n
        128
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 16
    num_warps: int = 8
    num_stages: int = 3
    min_waves: int | None = None
    """The kernel serves calls of at least this many tiles a program (one program per SM); below, one cuBLAS GEMM
    over the stack and `kernels.geglu` are faster. None: the device's tuned ``geglu_min_waves``
    (`tuning.Thresholds`, from ``data/tuned_thresholds.json``)."""


DEFAULT_TILES = GemmTiles()


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
    def gelu_sigmoid(g):
        """gelu_tanh(g) in the kernel's epilogue form (see the comment)."""
        # gelu_tanh(g) = 0.5 g (1 + tanh z) = g sigmoid(2 z), z = sqrt(2/pi) (g + 0.044715 g^3): one exp2 and one
        # division (a third of the epilogue's instructions fewer than `kernels._gelu_tanh`). exp2 overflows to inf
        # below g of about -11, where the quotient is -0, as gelu's.
        return g / (1.0 + tl.exp2(g * (-2.302208198 - 0.1029432394 * g * g)))

    @triton.jit
    def _geglu_tile(
        x_desc, w_desc, o_desc, tile, tile_c, grid_m, grid_n,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # noqa: N803
        GROUP_M: tl.constexpr, INTERPRET: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        # Loads for tile `tile`, the store for `tile_c` (the same tile: the flattened loop's copy of the index, as in
        # Triton's persistent matmul, since its loads run a tile ahead of its epilogue).
        off_m, off_n = tile_origin(tile, grid_m, grid_n, GROUP_M, BLOCK_M, BLOCK_N)
        off_cm, off_cn = tile_origin(tile_c, grid_m, grid_n, GROUP_M, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)  # columns [gate block | up block]
        for step in range(tl.cdiv(K, BLOCK_K)):
            x, w = x_desc.load([off_m, step * BLOCK_K]), w_desc.load([2 * off_n, step * BLOCK_K])
            if INTERPRET:  # the interpreter's tl.dot misreads bfloat16; half products are exact in float32
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, w.T, acc)
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        o_desc.store([off_cm, off_cn], (gelu_sigmoid(gate) * up).to(o_desc.dtype))

    @triton.jit
    def _geglu_gemm_kernel(
        x_desc, w_desc, o_desc, m, n, programs,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # noqa: N803
        GROUP_M: tl.constexpr, INTERPRET: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        # Tiles program_id, + programs, ...: one program per SM, one flattened loop over its tiles and their K steps.
        grid_m, grid_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
        if INTERPRET:  # the interpreter runs no `for` over a runtime bound
            tile = tl.program_id(0)
            while tile < grid_m * grid_n:
                _geglu_tile(x_desc, w_desc, o_desc, tile, tile, grid_m, grid_n, K, BLOCK_M, BLOCK_N, BLOCK_K,
                            GROUP_M, INTERPRET)  # fmt: skip
                tile += programs
        else:
            tile_c = tl.program_id(0) - programs
            for tile in tl.range(tl.program_id(0), grid_m * grid_n, programs, flatten=True):
                tile_c += programs
                _geglu_tile(x_desc, w_desc, o_desc, tile, tile_c, grid_m, grid_n, K, BLOCK_M, BLOCK_N, BLOCK_K,
                            GROUP_M, INTERPRET)  # fmt: skip


def stack_block(features: int, block_n: int = DEFAULT_TILES.block_n) -> int:
    """Rows per gate (and up) block of a stack of `features` rows.

    `block_n` where it divides them, else all of them: the plain [gate; up] stack, which one GEMM and `kernels.geglu`
    compute.
    """
    return block_n if features % block_n == 0 else features


def stack_gate_up(gate_w: torch.Tensor, up_w: torch.Tensor, block_n: int = DEFAULT_TILES.block_n) -> torch.Tensor:
    """The (2F, K) weight `geglu_linear` reads: gate and up rows in alternating blocks.

    Gate rows [j, j + b), then the same up rows, for each block j of b = `stack_block(F, block_n)` rows.
    Differentiable; without autograd a derived copy, like the fused q/k/v buffers (refresh it in place through
    `stack_parts`).

    Example:
        >>> g, u = torch.zeros(4, 2), torch.ones(4, 2)
        >>> stack_gate_up(g, u, block_n=2)[:, 0].tolist(), stack_gate_up(g, u, block_n=3)[:, 0].tolist()
        ([0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    """
    if gate_w.shape != up_w.shape or gate_w.dim() != 2:
        raise ValueError(
            f"stack_gate_up(gate_w, up_w): expected two (F, K) weights of one shape, got {tuple(gate_w.shape)} and "
            f"{tuple(up_w.shape)}; pass a layer's gate_proj.weight and up_proj.weight."
        )
    f, k = gate_w.shape
    b = stack_block(f, block_n)
    return torch.stack([gate_w.view(f // b, b, k), up_w.view(f // b, b, k)], dim=1).view(2 * f, k)


def stack_parts(stack: torch.Tensor, block_n: int = DEFAULT_TILES.block_n) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up rows of a `stack_gate_up` stack as (F / b, b, K) views, b its block (copy weights into them).

    Example:
        >>> gate, up = stack_parts(torch.arange(8.0).view(8, 1), block_n=2)
        >>> gate.flatten().tolist(), up.flatten().tolist()
        ([0.0, 1.0, 4.0, 5.0], [2.0, 3.0, 6.0, 7.0])
    """
    f = stack.shape[0] // 2
    blocks = stack.view(-1, 2, stack_block(f, block_n), stack.shape[1])
    return blocks[:, 0], blocks[:, 1]


def _programs(x: torch.Tensor) -> int:
    """The persistent grid: one program per SM (4 under the interpreter)."""
    return torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4


def serves(x: torch.Tensor, stack: torch.Tensor, tiles: GemmTiles = DEFAULT_TILES) -> bool:
    """Whether `geglu_linear` runs the kernel.

    CUDA sm90+ (or the interpreter) half operands, no autograd, row-major, at least `tiles.min_waves` tiles a program.
    """
    if not kernels.triton_serves(x) or x.dim() < 2:
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    k = x.shape[-1]
    if not (
        not (torch.is_grad_enabled() and (x.requires_grad or stack.requires_grad))
        and stack.shape[1] == k
        and k % 16 == 0
        and stack.shape[0] % (2 * tiles.block_n) == 0
        and x.dtype == stack.dtype
        and x.is_contiguous()
        and stack.is_contiguous()
    ):
        return False
    rows = x.numel() // k
    tile_count = -(-rows // tiles.block_m) * (stack.shape[0] // (2 * tiles.block_n))
    min_waves = tuning.thresholds(x.device).geglu_min_waves if tiles.min_waves is None else tiles.min_waves
    return tile_count >= min_waves * _programs(x)


def geglu_linear(x: torch.Tensor, stack: torch.Tensor, tiles: GemmTiles = DEFAULT_TILES) -> torch.Tensor:
    """gelu_tanh(x gate_w^T) * (x up_w^T): (..., K) -> (..., F) in x's dtype, from `stack_gate_up(gate_w, up_w)`.

    One kernel where `serves`, else one GEMM over the stack and `kernels.geglu`. `tiles`: the launch geometry, whose
    `block_n` must be the stack's, and the smallest call the kernel takes (`GemmTiles.min_waves`).
    """
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    k, n = x.shape[-1], stack.shape[0] // 2
    if not serves(x, stack, tiles):
        y = F.linear(x, stack).unflatten(-1, (-1, 2, stack_block(n, bn)))
        return kernels.geglu(y[..., 0, :], y[..., 1, :]).flatten(-2)
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    x_desc = TensorDescriptor.from_tensor(rows, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(stack, [2 * bn, bk])
    o_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    tiles_total = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = min(_programs(x), tiles_total)
    _geglu_gemm_kernel[(programs,)](x_desc, w_desc, o_desc, m, n, programs, K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                    GROUP_M=tiles.group_m, INTERPRET=kernels.INTERPRETED, num_warps=tiles.num_warps,
                                    num_stages=tiles.num_stages)  # fmt: skip
    return out.view(*x.shape[:-1], n)


def reference(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor) -> torch.Tensor:
    """What `geglu_linear` computes, in float32: gelu_tanh(x gate_w^T) * (x up_w^T)."""
    x, gate_w, up_w = x.float(), gate_w.float(), up_w.float()
    return F.gelu(x @ gate_w.T, approximate="tanh") * (x @ up_w.T)
