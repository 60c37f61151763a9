"""Compile the GeGLU GEMM kernels for sm90 without a GPU: shared memory, registers, spills, MMA shapes, pipelining.

    python -m benchmarks.experiments.compile_sm90 [--out DIR]    # CPU, triton installed; -> compile_sm90.jsonl

Device time is scarce, so a kernel variant is compiled here first (Triton's ahead-of-time path: `triton.compile` for
``GPUTarget("cuda", 90, 32)``, ptxas from the Triton wheel, the SASS by `triton.tools.disasm`) and only what fits
goes to the GPU. Per kernel one row with compiler facts, no timing:

- ``shared_bytes`` (the H200 allows 232,448 a block); ``registers_named`` (the highest register the SASS names, plus
  one: ptxas's allocation, ``cuobjdump -res-usage``, is 2 more); ``spill_instructions`` (local-memory loads and
  stores, LDL/STL: any spill is a red flag);
- ``wgmma``: the MMA instruction shapes (m64n256k16 is one n = 256 MMA, what the interleaved layouts are for);
- ``wgmma_waits``: the ``wgmma.wait_group`` depths (a nonzero depth in the K loop keeps MMAs in flight across
  iterations);
- ``loops``: ``scf.for`` in the TTGIR (1 when a persistent variant's loop nest was flattened);
- ``epilogue_instructions``: SASS instructions after the last ``HGMMA``, the tile's GeGLU/GELU and store, which the
  tensor cores wait for unless a persistent loop hides them.

Kernels: the shipped `geglu_gemm._geglu_gemm_kernel` at `DEFAULT_TILES` and every variant of `bench_geglu_variants`.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.common import run_cli, write_rows
from benchmarks.experiments import RESULTS
from benchmarks.experiments import bench_geglu_variants as variants
from policies.pi05 import geglu_gemm

BENCH = "compile_sm90"


def _desc(block: list[int]) -> str:
    return f"tensordesc<bf16[{block[0]},{block[1]}]>"


def _compile(fn, signature: dict[str, str], constexprs: dict[str, Any], tiles: geglu_gemm.GemmTiles):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})  # fmt: skip


def _facts(kernel) -> dict[str, Any]:
    """What the compiler made of one kernel, read from its PTX, TTGIR and SASS (Triton's `get_sass`)."""
    from triton.tools.disasm import get_sass

    ptx = kernel.asm["ptx"]
    code = [line.split("\t", 1)[1] for line in get_sass(kernel.asm["cubin"]).splitlines() if "\t" in line]
    last_mma = max((i for i, line in enumerate(code) if "HGMMA" in line), default=len(code))
    return {
        "shared_bytes": kernel.metadata.shared,
        "registers_named": 1 + max(int(r) for line in code for r in re.findall(r"\bR(\d+)\b", line)),
        "spill_instructions": sum(bool(re.search(r"\b(LDL|STL)\b", line)) for line in code),
        "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
        "wgmma_waits": [int(w) for w in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)],
        "loops": kernel.asm["ttgir"].count("scf.for"),
        "epilogue_instructions": len(code) - last_mma - 1,
    }


def shipped(k: int, tiles: geglu_gemm.GemmTiles = geglu_gemm.DEFAULT_TILES) -> dict[str, Any]:
    """The facts of `geglu_gemm._geglu_gemm_kernel` at width `k` and `tiles`."""
    t = tiles
    signature = {"x_desc": _desc([t.block_m, t.block_k]), "w_desc": _desc([2 * t.block_n, t.block_k]),
                 "o_desc": _desc([t.block_m, t.block_n]), "m": "i32", "n": "i32", "programs": "i32"}  # fmt: skip
    constexprs = {"K": k, "BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k, "GROUP_M": t.group_m,
                  "INTERPRET": False}  # fmt: skip
    return _facts(_compile(geglu_gemm._geglu_gemm_kernel, signature, constexprs, t))


def variant(v: variants.Variant, k: int) -> dict[str, Any]:
    """The facts of `bench_geglu_variants._variant_kernel` for variant `v` at width `k`."""
    t = v.tiles
    weight = _desc([2 * t.block_n if v.layout in ("halves", "pairs") else t.block_n, t.block_k])
    signature = {"x_desc": _desc([t.block_m, t.block_k]), "g_desc": weight, "u_desc": weight,
                 "o_desc": _desc([t.block_m, t.block_n]), "b_ptr": "*bf16", "m": "i32", "n": "i32",
                 "programs": "i32"}  # fmt: skip
    constexprs = {"K": k, "BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k, "GROUP_M": t.group_m,
                  "LAYOUT": variants.LAYOUTS.index(v.layout), "GELU": variants.GELUS.index(v.gelu),
                  "FLATTEN": v.persistent, "INTERPRET": False}  # fmt: skip
    return _facts(_compile(variants._variant_kernel, signature, constexprs, t))


def run(out: Path | None = None) -> list[dict[str, Any]]:
    """One row per kernel: the shipped kernel and the GeGLU variants at the LM's width, the fc1 ones at SigLIP's."""
    import triton

    # Per width only the K loop's trip count differs (checked: identical facts at 1024 and 2048), so the LM's width.
    jobs = [("shipped geglu_linear", asdict(geglu_gemm.DEFAULT_TILES), 2048, lambda: shipped(2048))]
    jobs += [(v.name, v.fields(), 2048, lambda v=v: variant(v, 2048)) for v in variants.VARIANTS]
    jobs += [(v.name, v.fields(), 1152, lambda v=v: variant(v, 1152)) for v in variants.GELU_VARIANTS]
    rows = []
    for name, fields, k, compile_facts in jobs:
        row = {"target": "sm90", "triton": triton.__version__, "kernel": name, **fields, "k": k}
        try:
            row.update(compile_facts(), status="compiled")
        except Exception as err:  # noqa: BLE001 - e.g. out of shared memory: the fact to record
            row["status"] = f"failed: {type(err).__name__}: {err}"[:500]
        rows.append(row)
        print(row, flush=True)
    return write_rows(BENCH, rows, out or RESULTS)


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
