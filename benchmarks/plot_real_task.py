"""Plot the GPU push-cube recipes of docs/rl.md section 5 from `ppo_curves.jsonl` and `real_task_rl.jsonl`.

One panel per PPO recipe (the small PI0.5, group-relative G=8, lr 5e-5): lines are rollout success (10-iteration
means, from the curve rows), squares each seed's SFT evaluation, dots its `phyai-gym eval` after PPO (from the
real_task_rl rows), colour by seed.

    python -m benchmarks.plot_real_task --out benchmarks/plots/real_task_rl_gpu_group_seeds.png
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

from benchmarks.common import results_path

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@dataclass(frozen=True)
class Panel:
    title: str
    cases: tuple[str, ...]  # ppo_curves "case" values
    trainable_all: bool  # real_task_rl rows: "trainable=all" in the config
    kl_stop: str | None  # real_task_rl rows: "kl<=..." in the config, or no stop


CASE = "push-cube small GPU, group-relative G=8"
PANELS = (
    Panel("expert trains (prefix frozen)", (f"{CASE} shared per episode, lr 5e-5, evaluated",
                                           f"{CASE} shared per episode, lr 5e-5, evaluated, seeds 4-6"), False, None),
    Panel("PPO trains all (vf 0)", (f"{CASE}, lr 5e-5, PPO trains all (vf 0), seed 6 from e6 clone",
                                    f"{CASE}, lr 5e-5, PPO trains all (vf 0), seeds 4-5 fresh SFT"), True, None),
    Panel("PPO trains all (vf 0), --target-kl 2e-4",
          (f"{CASE}, lr 5e-5, PPO trains all (vf 0), target-kl 2e-4, seeds 7-9",), True, "kl<=0.0002"),
)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    curves, evals = read(results_path("ppo_curves")), read(results_path("real_task_rl"))
    evals = [r for r in evals if r["gpu"] != "cpu" and len(r["seeds"]) == 1 and "lr=5e-05" in r["config"]
             and "G=8" in r["config"]]  # fmt: skip
    fig, axes = plt.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 4.2), sharey=True)
    for ax, panel in zip(axes, PANELS, strict=True):
        rows = [r for r in curves if r["case"] in panel.cases]
        for seed in sorted({r["seed"] for r in rows}):
            colour = f"C{(seed - 1) % 10}"
            mine = sorted((r for r in rows if r["seed"] == seed), key=lambda r: r["iteration"])
            succ = [r["success_rate"] for r in mine]
            ends = range(10, len(succ) + 10, 10)
            means = [sum(succ[e - 10 : e]) / len(succ[e - 10 : e]) for e in ends]
            ax.plot([min(e, len(succ)) for e in ends], means, color=colour, label=f"seed {seed}")
            mine = [r for r in evals if r["seed"] == seed and ("trainable=all" in r["config"]) == panel.trainable_all
                    and (panel.kl_stop in r["config"] if panel.kl_stop else "kl<=" not in r["config"])]  # fmt: skip
            for r in mine:
                ax.plot(0, r["sft_success"], "s", color=colour)
                ax.plot(r["iterations"], r["ppo_success"], "o", color=colour)
        ax.set_title(f"{panel.title}\n(lines: rollout success, 10-it. means; squares: SFT eval; dots: PPO eval)",
                     fontsize=9)
        ax.set_xlabel("PPO iteration (12,800 env steps each)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("success")
    axes[0].set_ylim(0, 0.55)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
