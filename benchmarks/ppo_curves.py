"""PPO learning curves, tiny PI0.5 on the target task, 3 seeds, CPU: rows -> ppo_curves.jsonl, plot ->
benchmarks/results/ppo_curves_tiny_target.png.

    python -m benchmarks.ppo_curves [--seeds 1 2 3] [--iterations 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, write_rows

CONFIG = "tiny PI0.5, target task, CPU, lr 3e-3, noise 1.0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="folder for the rows and the plot (default: results/)")
    cli = parser.parse_args()
    spec = importlib.util.spec_from_file_location("ppo_pi05", ROOT / "examples" / "ppo_pi05.py")
    ppo = importlib.util.module_from_spec(spec)
    sys.modules["ppo_pi05"] = ppo
    spec.loader.exec_module(ppo)
    rows = []
    for seed in cli.seeds:
        args = ppo.Args(seed=seed, total_iterations=cli.iterations, eval_episodes=256, csv=None, threads=1,
                        noise_level=1.0, learning_rate=3e-3, quiet=True)  # fmt: skip
        result = ppo.train(args)
        for row in result["curve"]:
            rows.append({"config": CONFIG, "iterations": cli.iterations, "case": "tiny target", "seed": seed, **row,
                         "final_stochastic": result["final"]["stochastic"],
                         "final_deterministic": result["final"]["deterministic"]})  # fmt: skip
    write_rows("ppo_curves", rows, cli.out, echo=False)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for seed in cli.seeds:
        mine = [r for r in rows if r["seed"] == seed]
        ax.plot([r["global_step"] for r in mine], [r["success_rate"] for r in mine], label=f"seed {seed}")
    ax.axhline(0.5, color="grey", linestyle="--", label="best constant action (~0.5)")
    ax.set_xlabel("env steps")
    ax.set_ylabel("success rate (rollout episodes)")
    ax.set_title("PPO, tiny PI0.5 (random init), target task, CPU")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig((cli.out or RESULTS) / "ppo_curves_tiny_target.png", dpi=120)


if __name__ == "__main__":
    main()
