"""Are PPO's updates healthy? approx-KL and clip fraction of examples/ppo_pi05.py over learning rates x log-ratio
granularities (issue 40; docs/rl.md explains the numbers).

    python -m benchmarks.bench_ppo_health                                   # tiny config, target task + Pusher, CPU
    python -m benchmarks.bench_ppo_health --config base --device cuda       # the base geometry on a GPU
    python -m benchmarks.bench_ppo_health --config base --device cuda --env Pusher-v5 --num-envs 32 \\
        --action-chunk 5 --num-steps 4 --lrs 2e-5 5e-6 --reductions sum element
    python -m benchmarks.bench_ppo_health --env Pusher-v5 --flags "--norm-reward --update-epochs 2"   # any example flag

Every (env, lr, reduction, seed) runs the example's `train()` in this process for `--iterations` iterations from
the same initial weights and writes one ``ppo_health`` row: the means over every minibatch of every iteration of
approx-KL at the chosen granularity (``approx_kl_mean``), of the whole chunk's approx-KL (``approx_kl_chunk_mean``,
comparable across granularities), of the clip fraction, and the explained variance of the last iteration.
``healthy`` marks approx-KL <= 0.05 and clip fraction <= 0.3 (cleanrl's healthy runs: ~0.01-0.03 and ~0.1-0.2).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import write_rows

ROOT = Path(__file__).resolve().parents[1]
KL_LIMIT, CLIPFRAC_LIMIT = 0.05, 0.3


def _example():
    """examples/ppo_pi05.py as a module (it is a script, not a package member)."""
    spec = importlib.util.spec_from_file_location("ppo_pi05", ROOT / "examples" / "ppo_pi05.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ppo_pi05"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    values = [float(r[key]) for r in rows if math.isfinite(float(r[key]))]
    return float(np.mean(values)) if values else float("nan")


def health_row(curve: list[dict[str, Any]], args: Any, final: dict[str, float] | None = None) -> dict[str, Any]:
    """The ``ppo_health`` row of one run's curve (the `Args` it ran with give the settings).

    `final` is the example's end-of-run success rates (``{"stochastic": ..., "deterministic": ...}``) when it
    measured them (``eval_episodes > 0``).
    """
    kl, clipfrac = _mean(curve, "approx_kl_mean"), _mean(curve, "clipfrac")
    final = final or {}
    return {
        "env": args.env,
        "config": args.config if args.checkpoint is None else args.checkpoint,
        "device": args.device,
        "lr": args.learning_rate,
        "value_lr": args.value_lr,
        "target_kl": args.target_kl if args.target_kl is not None and math.isfinite(args.target_kl) else None,
        "logprob_reduction": args.logprob_reduction,
        "seed": args.seed,
        "iterations": len(curve),
        "num_envs": args.num_envs,
        "num_steps": args.num_steps,
        "action_chunk": args.action_chunk,
        "update_epochs": args.update_epochs,
        "num_minibatches": args.num_minibatches,
        "noise_level": args.noise_level,
        "norm_reward": args.norm_reward,
        "approx_kl_mean": kl,
        "approx_kl_max": max(float(r["approx_kl_max"]) for r in curve),
        "approx_kl_first": float(curve[0]["approx_kl_first"]),
        "approx_kl_chunk_mean": _mean(curve, "approx_kl_chunk"),
        "clipfrac_mean": clipfrac,
        "explained_variance": float(curve[-1]["explained_variance"]),
        "success_rate_last": float(curve[-1]["success_rate"]),
        "eval_episodes": args.eval_episodes,
        "success_deterministic": final.get("deterministic"),
        "success_stochastic": final.get("stochastic"),
        "healthy": bool(kl <= KL_LIMIT and clipfrac <= CLIPFRAC_LIMIT),
    }


def _flags(ppo: Any, flags: str) -> dict[str, Any]:
    """The example's fields that `flags` (its command-line syntax) sets explicitly."""
    argv = shlex.split(flags)
    parsed = ppo.parse_args(argv)
    given = {tok[2:].split("=")[0].removeprefix("no-").replace("-", "_") for tok in argv if tok.startswith("--")}
    return {name: getattr(parsed, name) for name in given}


def run(options: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (env, lr, reduction, seed)."""
    ppo = _example()
    extra = _flags(ppo, options.flags)
    rows = []
    for env in options.env:
        for lr in options.lrs or [None]:
            for reduction in options.reductions:
                for seed in options.seeds:
                    args = ppo.Args(
                        **extra,
                        env=env, config=options.config, device=options.device, seed=seed, learning_rate=lr,
                        logprob_reduction=reduction, total_iterations=options.iterations, num_envs=options.num_envs,
                        num_steps=options.num_steps, action_chunk=options.action_chunk,
                        eval_episodes=options.eval_episodes, csv=None,
                        quiet=True,
                    )  # fmt: skip
                    result = ppo.train(args)
                    final = result["final"] if options.eval_episodes > 0 else None
                    row = {**health_row(result["curve"], args, final), "flags": options.flags}
                    rows += write_rows("ppo_health", [row], options.out)
                    del result  # two base-config policies: free them before the next run builds its own
                    gc.collect()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    """Command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", help='"tiny" or "base" (random weights)')
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--env", nargs="+", default=["target", "Pusher-v5"], help="env names (phyai_gym.make_env)")
    parser.add_argument("--lrs", nargs="+", type=float, default=None,
                        help="learning rates (default: the example's default only)")  # fmt: skip
    parser.add_argument("--reductions", nargs="+", default=["sum", "element"], help="--logprob-reduction values")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--num-envs", type=int, default=32)
    parser.add_argument("--num-steps", type=int, default=4, help="T, policy calls per env per rollout")
    parser.add_argument("--action-chunk", type=int, default=1, help="C (Pusher in issue 40: 5)")
    parser.add_argument("--eval-episodes", type=int, default=0,
                        help="episodes of the example's final success measurement (stochastic and deterministic)")
    parser.add_argument("--flags", default="", help='more ppo_pi05.py flags for every run, e.g. "--norm-reward"')
    parser.add_argument("--out", type=Path, default=None, help="folder for ppo_health.jsonl (default: results/)")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
