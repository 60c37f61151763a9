"""Plot samples/s and p50 latency against batch from the latest `policy.jsonl` rows of one GPU.

    python -m benchmarks.plot_policy --out benchmarks/plots/h200_policy.png [--jsonl FILE] [--gpu "NVIDIA H200"]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

from benchmarks.common import results_path

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TARGETS = {"a": {64: 120}, "b": {8: 120, 40: 200, 64: 220}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl", type=Path, default=results_path("policy"))
    parser.add_argument("--gpu", default="NVIDIA H200", help="the rows' gpu field")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    latest: dict[tuple, dict] = {}  # the file is oldest first: the last row of each (case, method, batch) wins
    for line in args.jsonl.read_text().splitlines():
        row = json.loads(line) if line.strip() else None
        if row and row.get("gpu") == args.gpu and row.get("value_source") == "none":
            latest[(row["case"], row["method"], row["batch"])] = row
    rows = list(latest.values())
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
    ax_lat.set_title(f"act() latency, {args.gpu} bf16")
    ax_lat.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
