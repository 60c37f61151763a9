"""CPU-simulator throughput under `PolicyVectorEnv`: rendering every step vs on demand (issue 39).

`PolicyVectorEnv` reads only the observation that ends each C-step chunk (and resets and episode ends), so the
CPU adapters render only those frames once told ``set_read_every(C)``. The env is Pusher-v5 unless ``--env``
names another `phyai_gym.make_env` env (a LIBERO suite, a ManiSkill task on its CPU simulator).

Every measurement runs one `PolicyVectorEnv` and switches the reading schedule between rounds, so both variants
see the same load: ``render="every_step"`` calls ``wrappers.freeze.set_read_every(env, 1)`` (what an env that
cannot skip renders does), ``render="on_demand"`` gives back C. Pusher's episodes end every 100 env steps inside
the timed window, as in a real rollout.

Two modes, one row per (W, render):

* ``env_only`` (-> ``cpu_sim_env_only.jsonl``): a `ConstantPolicy` (no compute) drives W envs, one
  async worker each (``--vectorization sync`` steps them in-process); env-steps/s = N * C * chunks / wall.
* ``cpu_sim_loop`` (-> ``cpu_sim_loop.jsonl``; a LIBERO suite -> ``libero_gpu_rollout.jsonl``, with ``suite``
  and ``protocol``): the full loop with PI0.5 (`phyai_gym.make_policy`; tiny on CPU, ``--config base --device
  cuda`` on the GPU machine), env-steps/s of ``step()``, and the policy/env split from rounds that time
  ``policy.act(obs)`` and ``step(actions)`` apart.

MuJoCo and LIBERO render through ``MUJOCO_GL`` (egl by default; osmesa for software rendering)::

    MUJOCO_GL=egl python -m benchmarks.bench_cpu_sim --workers 1 4 16
    MUJOCO_GL=egl python -m benchmarks.bench_cpu_sim --env libero_spatial --workers 1 4 16
    MUJOCO_GL=osmesa python -m benchmarks.bench_cpu_sim --workers 1 4 16 --out DIR
    MUJOCO_GL=osmesa python -m benchmarks.bench_cpu_sim --mode cpu_sim_loop --config base --device cuda \
        --workers 64 --groups 2 --shadow-size 1024
    MUJOCO_GL=egl python -m benchmarks.bench_cpu_sim --mode cpu_sim_loop --config base --device cuda --workers 16 64
    MUJOCO_GL=egl python -m benchmarks.bench_cpu_sim --mode cpu_sim_loop --env libero_spatial --config base \
        --device cuda --workers 16 40 --groups 2
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import synchronize, write_rows
from policies.base import RolloutConfig
from policies.baseline import ConstantPolicy
from wrappers.freeze import set_read_every
from wrappers.policy_vector_env import PolicyVectorEnv

RENDERS = ("every_step", "on_demand")
SLOTS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")


def cpu_name() -> str:
    """The host CPU's model name (``/proc/cpuinfo``), else `platform.processor()`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _set_render(envs: PolicyVectorEnv, groups: list[Any], render: str) -> None:
    for env in groups:
        set_read_every(env, 1 if render == "every_step" else envs.action_chunk)


def _timed_chunks(envs: PolicyVectorEnv, chunks: int) -> tuple[float, int]:
    """(wall seconds, executed env steps) of `chunks` policy steps."""
    t0, steps = time.perf_counter(), 0
    for _ in range(chunks):
        info = envs.step()[4]
        steps += int(np.asarray(info["substep_mask"]).sum())
    return time.perf_counter() - t0, steps


def _split_chunks(envs: PolicyVectorEnv, obs: Any, chunks: int) -> tuple[float, float, Any]:
    """(policy seconds, env seconds, last obs) of `chunks` policy steps with ``act`` and ``step`` timed apart."""
    policy, device = envs.policy, torch.device(envs.policy.device)
    policy_s = env_s = 0.0
    for _ in range(chunks):
        t0 = time.perf_counter()
        actions = policy.act(obs).actions[:, : envs.action_chunk]
        synchronize(device)
        t1 = time.perf_counter()
        obs = envs.step(actions.cpu().numpy())[0]
        env_s += time.perf_counter() - t1
        policy_s += t1 - t0
    return policy_s, env_s, obs


def measure(
    envs: PolicyVectorEnv, groups: list[Any], chunks: int, rounds: int, split: bool
) -> dict[str, dict[str, float]]:
    """Per render mode: env-steps/s over `rounds` interleaved rounds of `chunks` steps (and the split).

    `groups` are the vector envs under `envs` (one per group).
    """
    obs, _ = envs.reset(seed=0)
    for render in RENDERS:  # warm-up: GL contexts, first-call allocations, the policy's first call
        _set_render(envs, groups, render)
        obs = envs.step()[0]
    totals = {render: {"wall_s": 0.0, "env_steps": 0, "policy_s": 0.0, "env_s": 0.0} for render in RENDERS}
    for _ in range(rounds):
        for render in RENDERS:
            _set_render(envs, groups, render)
            wall, steps = _timed_chunks(envs, chunks)
            totals[render]["wall_s"] += wall
            totals[render]["env_steps"] += steps
            if split:
                policy_s, env_s, obs = _split_chunks(envs, obs, chunks)
                totals[render]["policy_s"] += policy_s
                totals[render]["env_s"] += env_s
    results = {}
    for render, t in totals.items():
        row = {"env_steps_per_s": t["env_steps"] / t["wall_s"], "wall_s": t["wall_s"], "env_steps": t["env_steps"]}
        if split:
            row.update(
                policy_ms_per_chunk=1e3 * t["policy_s"] / (rounds * chunks),
                env_ms_per_chunk=1e3 * t["env_s"] / (rounds * chunks),
                policy_share=t["policy_s"] / (t["policy_s"] + t["env_s"]),
            )
        results[render] = row
    return results


def make_policy_for(args: argparse.Namespace, env: Any, workers: int) -> Any:
    """`ConstantPolicy` for env_only; PI0.5 with random weights (`phyai_gym.make_policy`) for the loop."""
    action_dim = int(env.single_action_space.shape[0])
    if args.mode == "env_only":
        return ConstantPolicy([0.1] * action_dim, action_horizon=args.chunk)
    from phyai_gym import make_policy

    cameras = dict(zip(env.single_observation_space["images"].spaces, SLOTS))
    rollout = RolloutConfig(num_steps=5, action_chunk=args.chunk)
    return make_policy(config=args.config, action_dim=action_dim, camera_map=cameras, device=args.device,
                       rollout=rollout, max_batch_size=workers)  # fmt: skip


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One `PolicyVectorEnv` per W; rows for both render modes."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    from phyai_gym import make_env
    from phyai_gym.make import resolve_env

    libero = resolve_env(args.env).kind == "libero"
    bench = "cpu_sim_env_only" if args.mode == "env_only" else "libero_gpu_rollout" if libero else "cpu_sim_loop"
    rows = []
    for workers in args.workers:
        g = args.groups
        sizes = [workers // g + (i < workers % g) for i in range(g)]
        extra = {} if args.shadow_size is None else {"shadow_size": args.shadow_size}
        groups = [
            make_env(args.env, n, vectorization=args.vectorization, image_size=args.image_size, **extra) for n in sizes
        ]
        try:
            policy = make_policy_for(args, groups[0], workers)
            envs = PolicyVectorEnv(groups, policy, action_chunk=args.chunk, groups=g, prefetch=g > 1)
        except BaseException:
            for env in groups:
                env.close()
            raise
        try:
            results = measure(envs, groups, args.chunks, args.rounds, split=args.mode == "cpu_sim_loop")
        finally:
            envs.close()
        speedup = results["on_demand"]["env_steps_per_s"] / results["every_step"]["env_steps_per_s"]
        for render, result in results.items():
            row = {
                "env": args.env, "workers": workers, "vectorization": args.vectorization, "groups": args.groups,
                "render": render,
                "image_size": args.image_size, "chunk": args.chunk, **result,
                "on_demand_speedup": speedup, "mujoco_gl": os.environ["MUJOCO_GL"], "cpu": cpu_name(),
                "shadow_size": args.shadow_size, "lp_num_threads": os.environ.get("LP_NUM_THREADS"),
                "chunks": args.chunks, "rounds": args.rounds,
            }  # fmt: skip
            if args.mode == "cpu_sim_loop":
                row.update(policy=f"pi05-{args.config}", device=args.device, num_envs=workers)
            if libero:  # make_env's LIBERO default: openpi's episode limits and settle steps
                row.update(suite=args.env, protocol="openpi_libero")
            rows += write_rows(bench, [row], args.out)
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["env_only", "cpu_sim_loop"], default="env_only")
    parser.add_argument("--env", default="Pusher-v5", help="a phyai_gym.make_env name (Pusher-v5, libero_spatial, ...)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1], help="W envs (one async worker each)")
    parser.add_argument("--vectorization", choices=["async", "sync"], default="async")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--groups", type=int, default=1,
                        help="env groups the policy alternates between (prefetch when > 1)")  # fmt: skip
    parser.add_argument("--shadow-size", type=int, default=None,
                        help="MuJoCo: shadow map side (default: the model's; 1024: cheap software GL)")  # fmt: skip
    parser.add_argument("--chunk", type=int, default=5, help="C, env steps per policy call")
    parser.add_argument("--chunks", type=int, default=8, help="policy steps per render mode per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (every_step, on_demand)")
    parser.add_argument("--config", choices=["tiny", "base"], default="tiny", help="cpu_sim_loop: PI0.5 size")
    parser.add_argument("--device", default="cpu", help="cpu_sim_loop: policy device")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSONL (default: results/)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    run(args)


if __name__ == "__main__":
    main()
