"""Candidate schedules of the LM's gate/up + GeGLU GEMM, against the shipped kernel and cuBLAS, alone in CUDA graphs.

    python -m benchmarks.experiments.bench_geglu_variants [--out DIR]    # on an sm90 GPU; -> geglu_variants.jsonl

Why: at case (a) batch 64 the kernel shipped until 69d1d81 (two 128-wide MMAs a K step, one tile a program) ran 234
of the prefix's 478 ms at 605 TFLOP/s in the graph (640 alone), where cuBLAS runs the LM's down projection at ~700;
closing that gap was the one change large enough for the 120 samples/s target (~13 ms short). Three things that
kernel did that cuBLAS's Hopper kernels do not, each a candidate here (the first sweep, 69d1d81, promoted
``halves``, persistent, 3 stages: 6.0 % faster at (a) batch 64; the sweep now explores around it):

- **Two 128-wide MMAs a K step** (gate and up, the same x tile): one wgmma of n = 256 over a weight whose gate and
  up rows are interleaved reads the x operand once instead of twice. ``halves`` interleaves blocks of `block_n`
  rows ([gate block j; up block j]), ``pairs`` single rows (gate row j, up row j: the layout under which the
  model's gate and up weights could stay views of one buffer, ``w[0::2]`` and ``w[1::2]``). The epilogue splits
  the (block_m, 2 block_n) accumulator back into gate and up in registers (`tl.split`).
- **One tile a program**: one CTA fills an SM (4 stages of 48 KB), so the tensor cores idle through every tile's
  prologue and GeGLU epilogue. ``persistent`` launches one program per SM that walks the tiles (grouped along M
  as the shipped kernel, `geglu_gemm.tile_origin`), the loop nest flattened so that the next tile's TMA loads are
  issued during this tile's last K steps and epilogue (Triton's software pipeliner; Triton has no warp
  specialisation on sm90).
- **A long epilogue**: the GELU as 0.5 g (1 + tanh z) assembles tanh from an exp and a division; ``sigmoid`` computes
  the same function as g sigmoid(2 z), one exp2 and one division (`compile_sm90`: 954 instead of 1,466 SASS
  instructions after the last MMA).

SigLIP's fc1 + bias + GELU as one GEMM (the ``gelu`` layout) is swept at its own shape. Beside them, a library
kernel: quack-kernels' `gemm_act` (already installed with FlashAttention-4, the ``flash`` extra), a warp-specialised,
persistent CuTe-DSL GEMM for sm90 with the GeGLU (or fc1's bias + GELU) in its epilogue, at its default
configuration and four pinned ones. Where quack is not importable its row says why.

Each row: ``case``, ``m``, ``k``, ``f``, ``variant``, the launch geometry, ``us_per_call`` (median of graph replays
of 5 calls), ``tflops`` (of the 2 x m x k x 2f FLOPs) and ``max_rel_err`` against the float32 reference on the
first 4,096 rows. cuBLAS rows (gate alone, [gate; up] as one GEMM, the model's unfused gate, up + GeGLU kernel)
give the ceiling at each shape. Under ``TRITON_INTERPRET=1`` `variant_linear` also runs on CPU half tensors (how the
variants were checked before any device time was spent on them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import run_cli, write_rows
from benchmarks.experiments import RESULTS
from policies.pi05 import geglu_gemm, kernels
from policies.pi05.geglu_gemm import DEFAULT_TILES, GemmTiles

BENCH = "geglu_variants"
LAYOUTS = ("two", "halves", "pairs", "gelu")
GELUS = ("tanh", "sigmoid")
SHAPES = {"a": (64 * 968, 2048, 16384), "b": (64 * 560, 2048, 16384), "a batch 1": (968, 2048, 16384),
          "expert a": (64 * 50, 1024, 4096), "expert batch 32": (32 * 50, 1024, 4096),
          "expert batch 1": (50, 1024, 4096)}  # fmt: skip
"""case -> (rows m, width k, GeGLU width f): the LM prefix at (a) / (b) batch 64 and (a) batch 1, the expert's MLP
(50 actions a sample) at batch 64, 32 and 1."""
GELU_SHAPES = {"vision fc1 a": (64 * 3 * 256, 1152, 4304)}
"""case -> (rows m, width k, fc1 width f): SigLIP's fc1 at (a) batch 64 (3 cameras x 256 patches a sample)."""


@dataclass(frozen=True)
class Variant:
    """One candidate: weight layout (`LAYOUTS`), persistent or one tile a program, and the launch geometry.

    Example:
        >>> Variant("pairs", True).name
        'pairs, persistent, 128x128x64, group 16, 8 warps, 4 stages'
    """

    layout: str = "two"
    persistent: bool = False
    tiles: GemmTiles = DEFAULT_TILES
    gelu: str = "tanh"
    """The epilogue's GELU: "tanh", the shipped 0.5 g (1 + tanh z) (`kernels._gelu_tanh`), or "sigmoid", the same
    function as g sigmoid(2 z): one exp2, one division and no tanh assembly (`geglu_gemm.gelu_sigmoid`)."""

    @property
    def name(self) -> str:
        """A row's ``variant``: every field in words."""
        t = self.tiles
        sched = "persistent" if self.persistent else "one tile a program"
        gelu = "" if self.gelu == "tanh" else f", {self.gelu} gelu"
        return (f"{self.layout}, {sched}, {t.block_m}x{t.block_n}x{t.block_k}, group {t.group_m}, "
                f"{t.num_warps} warps, {t.num_stages} stages{gelu}")  # fmt: skip

    def fields(self) -> dict[str, Any]:
        """The row's columns: layout, persistent and every launch-geometry field."""
        return {"layout": self.layout, "persistent": self.persistent, "gelu": self.gelu, **asdict(self.tiles)}


def _tiles(**changes: int) -> GemmTiles:
    return replace(DEFAULT_TILES, **changes)


VARIANTS = (
    Variant("two", tiles=_tiles(num_stages=4)), Variant("halves", True, _tiles(group_m=8)),
    Variant("halves", True, _tiles(group_m=32)), Variant("halves", True, gelu="sigmoid"),
    Variant("halves", True, _tiles(num_stages=2)), Variant("halves", True, _tiles(num_stages=4)),
    Variant("halves", True, _tiles(block_k=32, num_stages=6)),
    Variant("halves", True, _tiles(block_k=128, num_stages=2)), Variant("pairs", True),
)  # fmt: skip
"""The sweep around the shipped schedule (``halves``, persistent, 128 x 128 x 64, group 16, 3 stages: the shipped row):
group size, stages, K step, the sigmoid GELU and the ``pairs`` layout, and the previous shipped schedule (``two``, one
tile a program, 4 stages) for reference."""
GELU_VARIANTS = (
    Variant("gelu"), Variant("gelu", gelu="sigmoid"), Variant("gelu", tiles=_tiles(num_stages=3)),
    Variant("gelu", True), Variant("gelu", True, gelu="sigmoid"),
    Variant("gelu", tiles=_tiles(block_n=256, num_stages=3)), Variant("gelu", True, _tiles(block_n=256, num_stages=3)),
)  # fmt: skip
"""SigLIP's fc1 + GELU as one GEMM: 128- and 256-wide tiles (one n = 256 MMA), one tile a program or persistent."""


if kernels.HAS_TRITON:  # pragma: no cover - needs a CUDA GPU or the interpreter
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def _act(g, GELU: tl.constexpr):  # noqa: N803
        if GELU == 1:
            return geglu_gemm.gelu_sigmoid(g)
        return kernels._gelu_tanh(g)

    @triton.jit
    def _one_weight(
        x_desc, w_desc, off_m, row,
        K: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr,  # noqa: N803
        INTERPRET: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        # x tile (BLOCK_M, K) against WIDTH weight rows from `row`: one MMA a K step, float32 accumulation.
        acc = tl.zeros((BLOCK_M, WIDTH), dtype=tl.float32)
        for step in range(K // BLOCK_K):
            x, w = x_desc.load([off_m, step * BLOCK_K]), w_desc.load([row, step * BLOCK_K])
            if INTERPRET:  # the interpreter's tl.dot misreads bfloat16; half products are exact in float32
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, w.T, acc)
        return acc

    @triton.jit
    def _variant_tile(
        x_desc, g_desc, u_desc, o_desc, b_ptr, n, tile, tile_c, grid_m, grid_n,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # noqa: N803
        GROUP_M: tl.constexpr, LAYOUT: tl.constexpr, GELU: tl.constexpr, INTERPRET: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        # LAYOUT 0: gate and up descriptors, two MMAs a K step; 1 / 2: one interleaved weight (g_desc, blocks of
        # 2 BLOCK_N rows), one MMA of width 2 BLOCK_N, split into gate and up columns after the loop; 3: one weight
        # (g_desc) and a bias, gelu_tanh(x w^T + b) (SigLIP's fc1 and its GELU).
        off_m, off_n = geglu_gemm.tile_origin(tile, grid_m, grid_n, GROUP_M, BLOCK_M, BLOCK_N)
        off_cm, off_cn = geglu_gemm.tile_origin(tile_c, grid_m, grid_n, GROUP_M, BLOCK_M, BLOCK_N)
        if LAYOUT == 0:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for step in range(K // BLOCK_K):
                x, g = x_desc.load([off_m, step * BLOCK_K]), g_desc.load([off_n, step * BLOCK_K])
                u = u_desc.load([off_n, step * BLOCK_K])
                if INTERPRET:  # the interpreter's tl.dot misreads bfloat16; half products are exact in float32
                    x, g, u = x.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
                acc_g = tl.dot(x, g.T, acc_g)
                acc_u = tl.dot(x, u.T, acc_u)
            out = _act(acc_g, GELU) * acc_u
        elif LAYOUT == 3:
            acc = _one_weight(x_desc, g_desc, off_m, off_n, K, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
            cols = off_cn + tl.arange(0, BLOCK_N)
            bias = tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
            out = _act(acc + bias[None, :], GELU)
        else:
            acc = _one_weight(x_desc, g_desc, off_m, 2 * off_n, K, BLOCK_M, 2 * BLOCK_N, BLOCK_K, INTERPRET)
            if LAYOUT == 1:  # columns [gate block | up block]
                acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
            else:  # columns gate 0, up 0, gate 1, up 1, ...
                acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
            out = _act(acc_g, GELU) * acc_u
        o_desc.store([off_cm, off_cn], out.to(o_desc.dtype))

    @triton.jit
    def _variant_kernel(
        x_desc, g_desc, u_desc, o_desc, b_ptr, m, n, programs,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # noqa: N803
        GROUP_M: tl.constexpr, LAYOUT: tl.constexpr, GELU: tl.constexpr, FLATTEN: tl.constexpr,  # noqa: N803
        INTERPRET: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        # Tiles program_id, + programs, ... (one when every tile has its program). The epilogue gets its own copy
        # of the tile index (`tile_c`), as in Triton's persistent matmul: the flattened loop's loads run a tile ahead.
        grid_m, grid_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
        if INTERPRET:  # the interpreter runs no `for` over a runtime bound
            tile = tl.program_id(0)
            while tile < grid_m * grid_n:
                _variant_tile(x_desc, g_desc, u_desc, o_desc, b_ptr, n, tile, tile, grid_m, grid_n, K, BLOCK_M,
                              BLOCK_N, BLOCK_K, GROUP_M, LAYOUT, GELU, INTERPRET)  # fmt: skip
                tile += programs
        else:
            tile_c = tl.program_id(0) - programs
            for tile in tl.range(tl.program_id(0), grid_m * grid_n, programs, flatten=FLATTEN):
                tile_c += programs
                _variant_tile(x_desc, g_desc, u_desc, o_desc, b_ptr, n, tile, tile_c, grid_m, grid_n, K, BLOCK_M,
                              BLOCK_N, BLOCK_K, GROUP_M, LAYOUT, GELU, INTERPRET)  # fmt: skip


def interleave(gate: torch.Tensor, up: torch.Tensor, layout: str, block_n: int) -> torch.Tensor:
    """The (2F, K) weight a layout reads: ``halves`` [gate block; up block] per `block_n` rows, ``pairs`` row by row.

    Example:
        >>> g, u = torch.zeros(4, 2), torch.ones(4, 2)
        >>> interleave(g, u, "pairs", 2)[:, 0].tolist(), interleave(g, u, "halves", 2)[:, 0].tolist()
        ([0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    """
    if layout == "pairs":
        return torch.stack([gate, up], dim=1).flatten(0, 1)
    return geglu_gemm.stack_gate_up(gate, up, block_n)


def variant_linear(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor | None, v: Variant,
                   programs: int) -> torch.Tensor:  # fmt: skip
    """gelu_tanh(x gate^T) * (x up^T) by one variant; `w` is `interleave(gate, up, ...)` for the interleaved layouts.

    `programs`: the persistent grid (the SM count); a one-tile-a-program variant launches one program per tile.
    """
    bn, bk = v.tiles.block_n, v.tiles.block_k
    if v.layout == "two":
        descs = TensorDescriptor.from_tensor(gate, [bn, bk]), TensorDescriptor.from_tensor(up, [bn, bk])
    else:
        descs = (TensorDescriptor.from_tensor(w, [2 * bn, bk]),) * 2
    return _launch(x, gate.shape[0], descs, x, v, programs)  # x: a bias pointer the GeGLU layouts never read


def gelu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, v: Variant, programs: int) -> torch.Tensor:
    """gelu_tanh(x weight^T + bias) by a ``gelu`` variant (SigLIP's fc1 and GELU as one GEMM)."""
    desc = TensorDescriptor.from_tensor(weight, [v.tiles.block_n, v.tiles.block_k])
    return _launch(x, weight.shape[0], (desc, desc), bias, v, programs)


def _launch(x: torch.Tensor, n: int, descs: tuple, bias: torch.Tensor, v: Variant, programs: int) -> torch.Tensor:
    m, k = x.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    t = v.tiles
    bm, bn, bk = t.block_m, t.block_n, t.block_k
    x_desc, o_desc = TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(out, [bm, bn])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    grid = min(programs, tiles) if v.persistent else tiles
    _variant_kernel[(grid,)](x_desc, *descs, o_desc, bias, m, n, grid, K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             GROUP_M=t.group_m, LAYOUT=LAYOUTS.index(v.layout), GELU=GELUS.index(v.gelu),
                             FLATTEN=v.persistent,
                             INTERPRET=kernels.INTERPRETED, num_warps=t.num_warps,
                             num_stages=t.num_stages)  # fmt: skip
    return out


QUACK_CONFIGS = ((256, 128, False, 2, 1), (128, 256, False, 2, 1), (128, 192, True, 1, 2), (128, 128, True, 2, 1))
"""(tile_m, tile_n, pingpong, cluster_m, cluster_n) of quack's sm90 GEMM pinned beside its default (`tuned=False`);
tile_n counts pre-activation columns (gate and up interleaved), so the output tile is half as wide."""


def _quack_calls(gated: bool) -> list[tuple[str, dict[str, Any], Callable[..., torch.Tensor]]] | str:
    """quack-kernels' warp-specialised CuTe-DSL GEMM with its activation epilogue (FlashAttention-4's dependency,
    `pip install 'phyai-gym[flash]'`): (variant, row fields, fn(x, weight, bias)) per configuration, or why not.

    GeGLU reads the (2F, K) [gate; up] stack as B = stack^T with ``concat_layout=("B",)`` (quack's kernel relabels
    the concatenation as its interleaved layout: no copy); fc1 + GELU is ``gelu_tanh_approx`` with the bias.
    """
    try:
        from quack.gemm_config import GemmConfig
        from quack.gemm_interface import gemm_act
    except Exception as err:  # noqa: BLE001 - any import failure means "not run", with its reason
        return f"not run: quack not importable ({type(err).__name__}: {err})"[:300]
    act = "geglu" if gated else "gelu_tanh_approx"
    extra = {"concat_layout": ("B",)} if gated else {}
    pinned = [GemmConfig(tile_m=m, tile_n=n, pingpong=p, cluster_m=cm, cluster_n=cn, is_dynamic_persistent=False,
                         device_capacity=9) for m, n, p, cm, cn in QUACK_CONFIGS]  # fmt: skip
    calls = []
    for config in (None, *pinned):

        def fn(x, weight, bias, config=config):
            return gemm_act(x, weight.T, bias=bias, activation=act, store_preact=False, tuned=False, config=config,
                            **extra)[1]  # fmt: skip

        shape = "default config" if config is None else (
            f"{config.tile_m}x{config.tile_n} {'pingpong' if config.pingpong else 'cooperative'} "
            f"cluster {config.cluster_m}x{config.cluster_n}")  # fmt: skip
        calls.append((f"quack gemm_act {act}, {shape}", {"quack_config": shape}, fn))
    return calls


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


class _Sweep:
    """One shape's rows: each candidate checked against the float32 reference on the first rows, then timed."""

    def __init__(self, base: dict[str, Any], flops: float, ref: torch.Tensor, timer: Callable[..., float]) -> None:
        self.base, self.flops, self.ref, self.timer = base, flops, ref, timer
        self.rows: list[dict[str, Any]] = []

    def add(self, variant: str, fn: Callable, check: Callable | None, extra: dict | None = None,
            share: float = 1.0) -> None:  # fmt: skip
        """Time `fn` (the full call); `check()` computes the first rows, whose error is recorded. A failure of
        either (a compile error, shared memory, a configuration a library rejects) is recorded and the sweep goes on.
        """
        row = {**self.base, "variant": variant, **(extra or {})}
        try:
            err = None if check is None else _rel_err(check(), self.ref)
            us = self.timer(fn, calls=5)
            row.update(us_per_call=us, tflops=share * self.flops / us / 1e6, max_rel_err=err, status="ran")
        except Exception as e:  # noqa: BLE001 - record and go on
            row["status"] = f"failed: {type(e).__name__}: {e}"[:500]
        self.rows.append(row)
        print(row, flush=True)

    def library(self, calls, x: torch.Tensor, head: torch.Tensor, weight: torch.Tensor, bias) -> None:
        """A library's kernels (`_quack_calls`), or one row saying why none ran."""
        if isinstance(calls, str):
            self.rows.append({**self.base, "variant": "quack gemm_act", "status": calls})
            return
        for name, fields, fn in calls:
            self.add(name, lambda fn=fn: fn(x, weight, bias), lambda fn=fn: fn(head, weight, bias), fields)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a dry run under Triton's interpreter


def _shape_rows(
    case: str, m: int, k: int, f: int, variants: tuple[Variant, ...], programs: int, timer: Callable[..., float]
) -> list[dict]:
    """One GeGLU shape: cuBLAS, the shipped kernel, each variant, quack's gated GEMM.

    `timer(fn, calls)`: microseconds a call (`graph_time_us` on the GPU).
    """
    g = torch.Generator(device=_device()).manual_seed(3)
    gate, up = ((torch.randn(f, k, device=_device(), generator=g) * 0.02).bfloat16() for _ in range(2))
    x = torch.randn(m, k, device=_device(), generator=g).bfloat16()
    head = x[:4096]
    stacked = torch.cat([gate, up])
    sweep = _Sweep({"case": case, "m": m, "k": k, "f": f}, 2 * m * k * 2 * f, geglu_gemm.reference(head, gate, up),
                   timer)  # fmt: skip
    sweep.add("cuBLAS gate alone", lambda: F.linear(x, gate), None, share=0.5)
    sweep.add("cuBLAS [gate; up] one GEMM", lambda: F.linear(x, stacked), None)
    sweep.add("cuBLAS gate, up + geglu kernel", lambda: kernels.geglu(F.linear(x, gate), F.linear(x, up)),
              lambda: kernels.geglu(F.linear(head, gate), F.linear(head, up)))  # fmt: skip
    sweep.add("cuBLAS [gate; up] + geglu kernel", lambda: kernels.geglu(*F.linear(x, stacked).chunk(2, dim=-1)),
              lambda: kernels.geglu(*F.linear(head, stacked).chunk(2, dim=-1)))  # fmt: skip
    shipped = geglu_gemm.stack_gate_up(gate, up)
    sweep.add("shipped geglu_linear", lambda: geglu_gemm.geglu_linear(x, shipped),
              lambda: geglu_gemm.geglu_linear(head, shipped), asdict(geglu_gemm.DEFAULT_TILES))  # fmt: skip
    for v in variants:
        w = None if v.layout == "two" else interleave(gate, up, v.layout, v.tiles.block_n)
        sweep.add(v.name, lambda v=v, w=w: variant_linear(x, gate, up, w, v, programs),
                  lambda v=v, w=w: variant_linear(head, gate, up, w, v, programs), v.fields())  # fmt: skip
    sweep.library(_quack_calls(gated=True), x, head, stacked, None)
    return sweep.rows


def _gelu_rows(
    case: str, m: int, k: int, f: int, variants: tuple[Variant, ...], programs: int, timer: Callable[..., float]
) -> list[dict]:
    """SigLIP's fc1 + GELU: cuBLAS alone, cuBLAS + `kernels.gelu_tanh_` (the model's path), each variant, quack's."""
    g = torch.Generator(device=_device()).manual_seed(4)
    weight = (torch.randn(f, k, device=_device(), generator=g) * 0.03).bfloat16()
    bias = torch.randn(f, device=_device(), generator=g).bfloat16()
    x = torch.randn(m, k, device=_device(), generator=g).bfloat16()
    head = x[:4096]
    ref = F.gelu(head.float() @ weight.float().T + bias.float(), approximate="tanh")
    sweep = _Sweep({"case": case, "m": m, "k": k, "f": f}, 2 * m * k * f, ref, timer)
    sweep.add("cuBLAS fc1 alone", lambda: F.linear(x, weight, bias), None)
    sweep.add("cuBLAS fc1 + gelu_tanh_ kernel", lambda: kernels.gelu_tanh_(F.linear(x, weight, bias)),
              lambda: kernels.gelu_tanh_(F.linear(head, weight, bias)))  # fmt: skip
    for v in variants:
        sweep.add(v.name, lambda v=v: gelu_linear(x, weight, bias, v, programs),
                  lambda v=v: gelu_linear(head, weight, bias, v, programs), v.fields())  # fmt: skip
    sweep.library(_quack_calls(gated=False), x, head, weight, bias)
    return sweep.rows


def run(out: Path | None = None) -> list[dict[str, Any]]:
    """Every shape's cuBLAS rows, the shipped kernel and each variant; appends to ``geglu_variants.jsonl``."""
    from benchmarks.common import graph_time_us

    programs = torch.cuda.get_device_properties(0).multi_processor_count
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for case, (m, k, f) in SHAPES.items():
            rows += _shape_rows(case, m, k, f, VARIANTS, programs, graph_time_us)
            torch.cuda.empty_cache()
        for case, (m, k, f) in GELU_SHAPES.items():
            rows += _gelu_rows(case, m, k, f, GELU_VARIANTS, programs, graph_time_us)
    return write_rows(BENCH, rows, out or RESULTS)


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
