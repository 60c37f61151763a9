"""The ``phyai-gym`` command line.

``phyai-gym run`` drives a policy (for now the Gaussian baseline; PI0.5 once wired) through
`wrappers.PolicyVectorEnv` for a few chunks and prints a per-step table and a summary. Further subcommands
(``eval``, ``bench``) get their own ``_add_<name>_parser`` / ``_<name>`` pair.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def _add_run_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("run", help="run a policy in a vector env and print what it does")
    parser.add_argument("--env", default="Pusher-v5", help="'scripted' or a Gymnasium MuJoCo id (Pusher-v5)")
    parser.add_argument("--num-envs", type=int, default=4, help="N, sub-envs")
    parser.add_argument("--chunks", type=int, default=3, help="policy calls (each runs C env steps)")
    parser.add_argument("--seed", type=int, default=0, help="env i and its policy stream get seed + i")
    parser.add_argument("--action-chunk", type=int, default=5, help="C, env steps per policy call")
    parser.add_argument("--std", type=float, default=0.5, help="Gaussian baseline standard deviation")
    parser.add_argument("--image-size", type=int, default=224, help="rendered image side (MuJoCo)")
    parser.add_argument("--vectorization", choices=["sync", "async"], default="sync")
    parser.set_defaults(handler=_run)


def _build_env(args: argparse.Namespace) -> Any:
    from wrappers import make_mujoco_env, make_scripted_env

    if args.env == "scripted":
        return make_scripted_env(args.num_envs, episode_lengths=(7, 12), vectorization=args.vectorization)
    return make_mujoco_env(
        args.env, num_envs=args.num_envs, vectorization=args.vectorization, image_size=args.image_size
    )


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from policies.baseline import GaussianPolicy
    from wrappers import PolicyVectorEnv

    env = _build_env(args)
    action_dim = int(env.single_action_space.shape[0])
    policy = GaussianPolicy(action_dim, action_horizon=max(args.action_chunk, 1), std=args.std)
    wrapper = PolicyVectorEnv(env, policy, action_chunk=args.action_chunk)
    obs, _ = wrapper.reset(seed=args.seed)
    print(f"env={args.env} num_envs={wrapper.num_envs} action_chunk={args.action_chunk} "
          f"action_dim={action_dim} state_dim={obs['state'].shape[1]} task={obs['task'][0]!r}")  # fmt: skip
    rows, returns, episodes = [], np.zeros(wrapper.num_envs), []
    start = time.perf_counter()
    for chunk in tqdm(range(args.chunks), desc="chunks", unit="chunk", file=sys.stderr):
        obs, rewards, terminated, truncated, info = wrapper.step()
        rows.extend(_table_rows(chunk, rewards, terminated | truncated, info["policy"]))
        returns += rewards
        if "episode" in info:
            episodes.extend(np.asarray(info["episode"]["r"])[info["_episode"]].tolist())
    elapsed = time.perf_counter() - start
    wrapper.close()
    _print_table(rows)
    env_steps = args.chunks * args.action_chunk * wrapper.num_envs
    print(f"summary: {args.chunks} chunks, {env_steps} env steps in {elapsed:.2f} s "
          f"({env_steps / max(elapsed, 1e-9):.1f} env steps/s); mean return so far {returns.mean():.3f}; "
          f"finished episodes {len(episodes)}")  # fmt: skip
    return 0


def _table_rows(chunk: int, rewards: np.ndarray, done: np.ndarray, policy: dict[str, torch.Tensor]) -> list:
    norms = policy["actions"].flatten(1).norm(dim=1).tolist()
    return [
        (chunk, i, float(rewards[i]), float(policy["log_prob"][i]), float(policy["values"][i]), norms[i],
         bool(done[i]))
        for i in range(len(rewards))
    ]  # fmt: skip


def _print_table(rows: list) -> None:
    header = f"{'chunk':>5} {'env':>3} {'reward':>10} {'log-prob':>10} {'value':>8} {'|action|':>9} {'done':>5}"
    print(header)
    print("-" * len(header))
    for chunk, env, reward, log_prob, value, norm, done in rows:
        print(f"{chunk:>5} {env:>3} {reward:>10.4f} {log_prob:>10.3f} {value:>8.3f} {norm:>9.3f} {done!s:>5}")


def build_parser() -> argparse.ArgumentParser:
    """The ``phyai-gym`` argument parser (one subparser per command)."""
    parser = argparse.ArgumentParser(prog="phyai-gym", description="Run PI0.5 (or a baseline) in Gymnasium.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``phyai-gym`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
