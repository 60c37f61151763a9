"""Plot samples/s and p50 latency against batch from a bench_policy JSONL (benchmarks/results/h200_policy.jsonl)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TARGETS = {"a": {64: 120}, "b": {8: 120, 40: 200, 64: 220}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("jsonl", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.jsonl.read_text().splitlines() if line.strip()]
    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(11, 4))
    for case in ("a", "b"):
        sel = sorted((r for r in rows if r["case"] == case and r["method"] == "ode"), key=lambda r: r["batch"])
        if not sel:
            continue
        batches = [r["batch"] for r in sel]
        ax_tp.plot(batches, [r["samples_per_s"] for r in sel], "o-", label=f"case {case}: act()")
        ax_tp.plot(batches, [r["model_samples_per_s"] for r in sel], "x--", label=f"case {case}: model only")
        for b, target in TARGETS[case].items():
            ax_tp.plot([b], [target], "k*", markersize=9)
        ax_lat.plot(batches, [r["p50_ms"] for r in sel], "o-", label=f"case {case}")
    ax_tp.set_xscale("log", base=2)
    ax_tp.set_xlabel("batch")
    ax_tp.set_ylabel("samples/s")
    ax_tp.set_title("throughput (stars: DESIGN targets)")
    ax_tp.legend(fontsize=8)
    ax_lat.set_xscale("log", base=2)
    ax_lat.set_yscale("log")
    ax_lat.set_xlabel("batch")
    ax_lat.set_ylabel("p50 ms")
    ax_lat.set_title("act() latency, H200 bf16")
    ax_lat.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
