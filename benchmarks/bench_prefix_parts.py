"""Parts of the full-size prefix and denoise stages at batch 64, alone in CUDA graphs: what a change could move.

    python -m benchmarks.bench_prefix_parts [--out DIR]    # on a GPU; rows -> prefix_parts.jsonl

- ``lm_gate_up``: the LM's gate and up projections (2048 -> 2 x 16384) as two GEMMs (the model's layout today) and
  as one GEMM over the stacked [gate; up] weight, at the prefix token counts of cases (a) and (b) at batch 64.
- ``geglu_gemm``: the LM's gate/up projections + GeGLU as the model runs them (two cuBLAS GEMMs, then
  `kernels.geglu`) against `geglu_gemm.geglu_linear` (one Triton GEMM with the GeGLU in its epilogue) at several
  launch geometries, with its max relative error against the float32 reference on the first 4,096 rows, at the
  prefix token counts of batch 64 and batch 1.
- ``add_norm`` / ``add_layer_norm``: the fused residual add + norm on the LM's (rows, 2048) and SigLIP's (rows, 1152)
  residual streams at several warp counts (the kernel's default: one warp per 256 columns of the power-of-two
  block, at most 8), with the bytes it moves per second.
- ``expert_attention``: the Triton attention kernel at case (b)'s real expert shape (10 action tokens x 8 heads over
  570 keys) under both launch geometries and forced key splits.

Each row: ``part``, ``case``, ``variant``, ``us_per_call`` (median of graph replays of 20 calls) and a throughput.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import graph_time_us, run_cli, write_rows

BENCH = "prefix_parts"
TOKENS = {"a": 64 * 968, "b": 64 * 560}
"""Prefix tokens at batch 64: (a) 3 cameras x 256 + 200 prompt, (b) 2 x 256 + 48."""
IMAGE_TOKENS = {"a": 64 * 3 * 256, "b": 64 * 2 * 256}


def _gate_up(rows: list, dev: torch.device) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    gate, up = ((torch.randn(16384, 2048, device=dev, generator=g) * 0.02).bfloat16() for _ in range(2))
    fused = torch.cat([gate, up])
    for case, m in TOKENS.items():
        x = torch.randn(m, 2048, device=dev, generator=g).bfloat16()
        flops = 2 * m * 2048 * 32768
        for variant, fn in (("two GEMMs", lambda x=x: (F.linear(x, gate), F.linear(x, up))),
                            ("one GEMM [gate; up]", lambda x=x: F.linear(x, fused))):  # fmt: skip
            us = graph_time_us(fn, calls=5)
            rows.append({"part": "lm_gate_up", "case": case, "m": m, "variant": variant, "us_per_call": us,
                         "tflops": flops / us / 1e6})  # fmt: skip
        del x
        torch.cuda.empty_cache()


GEGLU_TILES = ((128, 128, 64, 16, 8, 3), (128, 128, 64, 16, 8, 4), (128, 128, 64, 8, 8, 3), (128, 128, 64, 32, 8, 3),
               (128, 64, 64, 16, 8, 4), (64, 128, 64, 16, 4, 3))  # fmt: skip
GEGLU_ROWS = {**TOKENS, "a batch 1": 968, "b batch 1": 560}
"""(block_m, block_n, block_k, group_m, num_warps, num_stages) of the GeGLU GEMM's sweep."""


def _geglu_gemm(rows: list, dev: torch.device) -> None:
    from policies.pi05 import geglu_gemm, kernels

    g = torch.Generator(device=dev).manual_seed(3)
    gate, up = ((torch.randn(16384, 2048, device=dev, generator=g) * 0.02).bfloat16() for _ in range(2))
    for case, m in GEGLU_ROWS.items():
        x = torch.randn(m, 2048, device=dev, generator=g).bfloat16()
        ref = geglu_gemm.reference(x[:4096], gate, up)
        flops = 2 * m * 2048 * 32768
        us = graph_time_us(lambda x=x: kernels.geglu(F.linear(x, gate), F.linear(x, up)), calls=5)
        rows.append({"part": "geglu_gemm", "case": case, "m": m, "variant": "cuBLAS gate, up + geglu kernel",
                     "us_per_call": us, "tflops": flops / us / 1e6,
                     "max_rel_err": float((kernels.geglu(F.linear(x[:4096], gate), F.linear(x[:4096], up)).float()
                                           - ref).abs().max() / ref.abs().max())})  # fmt: skip
        for spec in GEGLU_TILES:
            tiles = geglu_gemm.GemmTiles(*spec, min_waves=0)  # the kernel at every row count
            row = {"part": "geglu_gemm", "case": case, "m": m, "variant": "triton geglu_linear", **vars(tiles)}
            try:
                w = geglu_gemm.stack_gate_up(gate, up, tiles.block_n)
                err = (geglu_gemm.geglu_linear(x[:4096], w, tiles).float() - ref).abs().max() / ref.abs().max()
                us = graph_time_us(lambda x=x, w=w, tiles=tiles: geglu_gemm.geglu_linear(x, w, tiles), calls=5)
                row.update(us_per_call=us, tflops=flops / us / 1e6, max_rel_err=float(err), status="ran")
            except Exception as err:  # noqa: BLE001 - e.g. out of shared memory: record and go on
                row["status"] = f"failed: {type(err).__name__}: {err}"[:500]
            rows.append(row)
            print(row, flush=True)
        del x, ref
        torch.cuda.empty_cache()


def _norms(rows: list, dev: torch.device) -> None:
    from policies.pi05 import kernels

    g = torch.Generator(device=dev).manual_seed(1)
    for part, width, tokens, layer_norm in (("add_norm", 2048, TOKENS, False),
                                            ("add_layer_norm", 1152, IMAGE_TOKENS, True)):  # fmt: skip
        w, bias = torch.randn(width, device=dev, generator=g) * 0.1, torch.randn(width, device=dev, generator=g)
        for case, m in tokens.items():
            x, d = (torch.randn(1, m, width, device=dev, generator=g).bfloat16() for _ in range(2))
            for warps in (2, 4, 8, 16, None):

                def fn(x=x, d=d, w=w, shift=bias if layer_norm else None, ln=layer_norm, warps=warps):
                    return kernels._launch_add_norm(x, d, w, 1e-6, None, shift, not ln, None, True, ln,
                                                    num_warps=warps)  # fmt: skip

                us = graph_time_us(fn)
                rows.append({"part": part, "case": case, "rows": m, "width": width,
                             "variant": f"num_warps {warps or 'default'}", "us_per_call": us,
                             "tb_per_s": 4 * x.numel() * 2 / us / 1e6})  # fmt: skip


def _expert_attention(rows: list, dev: torch.device) -> None:
    from policies.pi05 import attention_kernel
    from policies.pi05.attention import additive_mask

    g = torch.Generator(device=dev).manual_seed(2)
    b, n, t, s, hd = 64, 8, 10, 570, 256
    q = torch.randn(b, t, n, hd, device=dev, generator=g).bfloat16().transpose(1, 2)
    k, v = (torch.randn(b, 1, s, hd, device=dev, generator=g).bfloat16() for _ in range(2))
    mask = additive_mask(torch.rand(b, s, device=dev, generator=g) > 0.1, torch.float32)
    for name, tiles in (("small", attention_kernel.SMALL_TILES), ("large", attention_kernel.LARGE_TILES)):
        for splits in (None, 1, 2, 4):
            us = graph_time_us(lambda tiles=tiles, splits=splits: attention_kernel.attend(q, k, v, mask, hd**-0.5,
                                                                                          splits, tiles))  # fmt: skip
            rows.append({"part": "expert_attention", "case": "b", "variant": f"{name} tiles, splits {splits}",
                         **vars(tiles), "splits": splits, "us_per_call": us})  # fmt: skip


def run(out: Path | None = None) -> list[dict[str, Any]]:
    """Every part's rows; appends to ``prefix_parts.jsonl``."""
    dev = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for part in (_geglu_gemm, _gate_up, _norms, _expert_attention):
            part(rows, dev)
            for r in rows[-12:]:
                print(r, flush=True)
    return write_rows(BENCH, rows, out)


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
