"""PPO learning curves of the tiny PI0.5 on the target task over several seeds, and one plot comparing them.

Runs ``examples/ppo_pi05.py`` once per seed (the settings of tests/examples/test_ppo.py), printing its
``iter k/N`` + ETA lines. Each seed's curve is written as it goes to ``OUT/seed_<s>.csv`` with its panel plot
``OUT/seed_<s>.png`` (phyai_gym.train.curves); at the end ``OUT/success.png`` overlays the seeds' success rates
against the best constant action (~0.5). Nothing under benchmarks/results is touched unless ``--out`` points
there.

    python benchmarks/ppo_curves.py                          # 3 seeds x 20 iterations -> runs/ppo_curves/
    python benchmarks/ppo_curves.py --seeds 1 --iterations 5 --out /tmp/curves
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_example():
    spec = importlib.util.spec_from_file_location("ppo_pi05", ROOT / "examples" / "ppo_pi05.py")
    ppo = importlib.util.module_from_spec(spec)
    sys.modules["ppo_pi05"] = ppo  # dataclasses look their module up there
    spec.loader.exec_module(ppo)
    return ppo


def plot_seeds(curves: dict[int, list[dict]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for seed, rows in curves.items():
        ax.plot([r["global_step"] for r in rows], [r["success_rate"] for r in rows], label=f"seed {seed}")
    ax.axhline(0.5, color="grey", linestyle="--", label="best constant action (~0.5)")
    ax.set_xlabel("env steps")
    ax.set_ylabel("success rate (rollout episodes)")
    ax.set_title("PPO, tiny PI0.5 (random init), target task, CPU")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="one PPO run per seed")
    parser.add_argument("--iterations", type=int, default=20, help="PPO iterations per run")
    parser.add_argument("--eval-episodes", type=int, default=256, help="final success-rate episodes per run")
    parser.add_argument("--out", default="runs/ppo_curves", help="folder of the CSVs and plots")
    args = parser.parse_args()
    ppo, out = load_example(), Path(args.out)
    curves = {}
    for seed in args.seeds:
        print(f"seed {seed}: {args.iterations} iterations -> {out / f'seed_{seed}.csv'}")
        run = ppo.Args(seed=seed, total_iterations=args.iterations, eval_episodes=args.eval_episodes,
                       csv=str(out / f"seed_{seed}.csv"), noise_level=1.0, learning_rate=3e-3)  # fmt: skip
        curves[seed] = ppo.train(run)["curve"]
    path = plot_seeds(curves, out / "success.png")
    if path is not None:
        print(f"plot: {path}")


if __name__ == "__main__":
    main()
