"""The expert's GEMMs at batch 1 (M = 50 action tokens): cuBLAS, cuBLASLt and a Triton weight-streaming kernel.

    python -m benchmarks.experiments.bench_skinny_gemm [--out DIR]    # on a GPU; rows -> skinny_gemm.jsonl

At batch 1 each expert layer-step multiplies 50 rows by four weight matrices ([q;k;v] 1024 -> 2560, o 2048 -> 1024,
[gate;up] 1024 -> 8192, down 4096 -> 1024; 34.6 MB of bf16 weights, 7.2 us at 4.8 TB/s). Such GEMMs are bound by
how fast the weights stream from memory, which needs many CTAs each streaming a slice of the output columns.
The Triton kernel here does exactly that (one program per BLOCK_N output columns, all K, the 50 rows in one
M tile; no split-K, so deterministic), timed at several tile sizes against `F.linear` under each BLAS library,
20 calls in one CUDA graph. Each row: shape, backend, tile, us_per_call, GB/s of weights, max error against
float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import graph_time_us, run_cli, write_rows
from benchmarks.experiments import RESULTS

BENCH = "skinny_gemm"
SHAPES = {"qkv": (1024, 2560), "o": (2048, 1024), "gate_up": (1024, 8192), "down": (4096, 1024)}
"""(K, N) of the expert's four GEMMs (pi05_base's Gemma 300M expert)."""
TILES = ((16, 128), (16, 256), (32, 128), (32, 256), (64, 128), (16, 512))
"""(BLOCK_N, BLOCK_K) tried."""

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without triton
    triton = None

if triton is not None:

    @triton.jit(do_not_specialize=["m"])
    def _stream_kernel(x_ptr, w_ptr, y_ptr, m, n, x_s, w_s, y_s, K: tl.constexpr,  # noqa: N803
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # noqa: N803  # fmt: skip
        # y[:, cols] = x @ w[cols]^T over all of K: one program per BLOCK_N output columns.
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xt = tl.load(x_ptr + rows[:, None] * x_s + (k0 + kk)[None, :], mask=rows[:, None] < m, other=0.0)
            wt = tl.load(w_ptr + cols[None, :] * w_s + (k0 + kk)[:, None], mask=cols[None, :] < n, other=0.0)
            acc += tl.dot(xt, wt)
        tl.store(y_ptr + rows[:, None] * y_s + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < m) & (cols[None, :] < n))  # fmt: skip


def stream_linear(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, warps: int = 4) -> torch.Tensor:
    """x (M <= 64, K) @ w (N, K)^T with the weight-streaming kernel (K a multiple of block_k)."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _stream_kernel[(triton.cdiv(n, block_n),)](x, w, y, m, n, x.stride(0), w.stride(0), y.stride(0), K=k,
                                               BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                               num_stages=4)  # fmt: skip
    return y


def _record(rows: list, base: dict, ref: torch.Tensor, backend: str, fn, **tile: Any) -> None:
    row = {**base, "backend": backend, **tile}
    try:
        with torch.no_grad():
            row["max_rel_err"] = float((fn().float() - ref).abs().max() / ref.abs().max())
            us = graph_time_us(fn)
        row.update(us_per_call=us, weight_gb_per_s=base["n"] * base["k"] * 2 / 1e3 / us, status="ran")
    except Exception as err:  # noqa: BLE001 - record and go on
        row["status"] = f"failed: {type(err).__name__}: {err}"[:500]
    rows.append(row)


def run(out: Path | None = None, rows_m: tuple[int, ...] = (50, 10)) -> list[dict[str, Any]]:
    """Every (shape, M, backend, tile) row."""
    rows: list[dict[str, Any]] = []
    dev = torch.device("cuda")
    for name, (k, n) in SHAPES.items():
        for m in rows_m:
            g = torch.Generator(device=dev).manual_seed(k + n + m)
            x = torch.randn(m, k, device=dev, generator=g).bfloat16()
            w = (torch.randn(n, k, device=dev, generator=g) * k**-0.5).bfloat16()
            ref = x.float() @ w.float().t()
            base = {"gemm": name, "m": m, "k": k, "n": n}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                _record(rows, base, ref, f"F.linear/{lib}", lambda x=x, w=w: F.linear(x, w))
            torch.backends.cuda.preferred_blas_library("default")
            for block_n, block_k in TILES if triton is not None else ():
                for warps in (4, 8):
                    fn = lambda x=x, w=w, bn=block_n, bk=block_k, wp=warps: stream_linear(x, w, bn, bk, wp)  # noqa: E731
                    _record(rows, base, ref, "triton_stream", fn, block_n=block_n, block_k=block_k, num_warps=warps)
    return write_rows(BENCH, rows, out or RESULTS)


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
