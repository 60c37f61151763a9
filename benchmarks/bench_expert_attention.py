"""Expert attention alone at the C8 shapes, SDPA (cuDNN) against the folded-MQA "gemm" path: the basis of the
``gemm_max_scores`` hand-over (`policies/pi05/data/tuned_thresholds.json`, read by `policies/pi05/tuning.py`).

    python -m benchmarks.bench_expert_attention [--out DIR]   # on a GPU; rows -> expert_attention.jsonl

Each call is captured 20 times in one CUDA graph (no launch overhead); the row gives the median per-call time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.common import graph_time_us, run_cli, write_rows

BENCH = "expert_attention"


def run(out: Path | None = None, batches: tuple[int, ...] = (1, 4, 8, 16, 32, 64)) -> list[dict[str, Any]]:
    """One row per (case, batch) with both backends' time; appends to ``expert_attention.jsonl``."""
    from policies.pi05 import attention
    from policies.pi05.config import Pi05Config

    rows = []
    cfg = Pi05Config.pi05_base().expert
    scale = cfg.head_dim**-0.5
    for name, (cams, prompt, horizon) in {"a": (3, 200, 50), "b": (2, 48, 10)}.items():
        s = cams * 256 + prompt + horizon
        for b in batches:
            q = torch.randn(b, horizon, cfg.num_heads, cfg.head_dim, device="cuda").transpose(1, 2).bfloat16()
            k = torch.randn(b, 1, s, cfg.head_dim, device="cuda").bfloat16()
            v = torch.randn(b, 1, s, cfg.head_dim, device="cuda").bfloat16()
            mask = attention.additive_mask(torch.ones(b, s, dtype=torch.bool, device="cuda"), torch.float32)
            row: dict[str, Any] = {"case": name, "batch": b, "keys": s, "scores": b * cfg.num_heads * horizon * s}
            half = mask.to(torch.bfloat16)
            row["sdpa_us"] = graph_time_us(lambda q=q, k=k, v=v, m=half: attention.attend(q, k, v, m, scale, "sdpa"))
            # the gemm path at every size (attend would hand the large calls to SDPA)
            row["gemm_us"] = graph_time_us(lambda q=q, k=k, v=v, m=mask: attention.gemm_attention(q, k, v, m, scale))
            rows += write_rows(BENCH, [row], out)
    return rows


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
