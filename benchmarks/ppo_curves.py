"""PPO learning curves, tiny PI0.5 on the target task, 3 seeds -> benchmarks/results/ppo_curves_tiny_target.*"""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"


def main() -> None:
    spec = importlib.util.spec_from_file_location("ppo_pi05", ROOT / "examples" / "ppo_pi05.py")
    ppo = importlib.util.module_from_spec(spec)
    sys.modules["ppo_pi05"] = ppo
    spec.loader.exec_module(ppo)
    rows = []
    for seed in (1, 2, 3):
        args = ppo.Args(seed=seed, total_iterations=20, eval_episodes=256, csv=None, threads=1, noise_level=1.0,
                        learning_rate=3e-3, quiet=True)  # fmt: skip
        result = ppo.train(args)
        for row in result["curve"]:
            rows.append({"seed": seed, **row, "final_stochastic": result["final"]["stochastic"],
                         "final_deterministic": result["final"]["deterministic"]})  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "ppo_curves_tiny_target.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for seed in (1, 2, 3):
        mine = [r for r in rows if r["seed"] == seed]
        ax.plot([r["global_step"] for r in mine], [r["success_rate"] for r in mine], label=f"seed {seed}")
    ax.axhline(0.5, color="grey", linestyle="--", label="best constant action (~0.5)")
    ax.set_xlabel("env steps")
    ax.set_ylabel("success rate (rollout episodes)")
    ax.set_title("PPO, tiny PI0.5 (random init), target task, CPU")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "ppo_curves_tiny_target.png", dpi=120)


if __name__ == "__main__":
    main()
