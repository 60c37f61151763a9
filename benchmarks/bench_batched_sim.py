"""GPU-batched simulation (MuJoCo Warp Panda tasks) with and without PI0.5: env-steps/s and where a step goes.

Rows go to results/batched_sim.jsonl (or --out), told apart by ``kind``:
  env_only  N worlds stepped with random actions, 2 cameras at 224: physics (+ controller and rules),
                        render, env-steps/s rendering every step and on demand (one render per chunk of C).
  rollout   `PolicyVectorEnv` over the env with the full-size PI0.5 (LIBERO RL setting: 2 cameras,
                        K = 5, H = 10, C = 5): env-steps/s of the loop, policy_ms_p50 (one act() on the chunk's
                        observation), sim_ms_p50 and render_ms_p50 per chunk, the simulator's share of a step, and
                        the policy-alone rate at the same N (N > --policy-batch: in equal groups).
  startup   seconds from the constructor to the first observation, cold (empty kernel cache) and
                        warm (the cache the cold run filled); --startup runs one start and prints its row.
  ppo       examples/ppo_pi05.py on the task (--ppo-iterations, default 5): per-iteration rollout /
                        update / sync seconds, approx-KL, clip fraction, and whether every figure is finite.

    python -m benchmarks.bench_batched_sim --sizes 64 256 1024 --config base      # on a GPU
    python -m benchmarks.bench_batched_sim --sizes 4 --config tiny --image-size 64 --device cpu   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ROOT, build_pi05, percentiles, synchronize, write_rows

BENCH = "batched_sim"
CAMERA_MAP = {"image": "base_0_rgb", "wrist_image": "left_wrist_0_rgb"}
MANISKILL_PUBLISHED = "ManiSkill3 PickCube-v1, 1 camera 128x128, 4096 envs, RTX 4090: 18,549 FPS (its docs)"


def _timed(fn: Any, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def env_only(task: str, n: int, image_size: int, chunk: int, device: torch.device, iters: int) -> list[dict]:
    """Physics, render and on-demand rates of the env alone."""
    from wrappers.adapters.mujoco_warp import make_mujoco_warp_env

    env = make_mujoco_warp_env(task, n, image_size=image_size, device=device)
    env.reset(seed=0)
    actions = torch.rand(iters + 2, n, 7, device=device) * 2 - 1
    rows = []
    for read_every in (1, chunk):
        env.set_read_every(read_every)
        env.reset(seed=0)
        steps = [_timed(lambda a=a: env.step(a), device) for a in actions]
        renders = [_timed(env._render, device) for _ in range(iters)]
        step_p50 = percentiles(steps[2:])[0]
        rows.append(dict(
            sim="mujoco_warp", task=task, num_envs=n, cameras=len(env.cameras), image_size=image_size,
            render="every_step" if read_every == 1 else f"every_{chunk}", step_ms_p50=step_p50,
            render_ms_p50=percentiles(renders)[0], env_steps_per_s=n / step_p50 * 1e3,
            images_per_s=n * len(env.cameras) / percentiles(renders)[0] * 1e3, startup_s=env.startup_s,
            published_anchor=MANISKILL_PUBLISHED,
        ))  # fmt: skip
    env.close()
    return rows


def rollout(
    task: str, n: int, image_size: int, chunk: int, config: str, device: torch.device, iters: int, policy_batch: int
) -> dict:
    """The PolicyVectorEnv loop with PI0.5, and its parts at the same N.

    N above `policy_batch` is split into G = ceil(N / policy_batch) groups of N / G worlds: one Warp batch and one
    policy call each, which PolicyVectorEnv runs one after another (the full-size policy at 1024 samples in one
    call does not fit in 80 GB).
    """
    from wrappers.adapters.mujoco_warp import make_mujoco_warp_env
    from wrappers.policy_vector_env import PolicyVectorEnv

    groups = -(-n // policy_batch)
    if n % groups:
        raise ValueError(f"--sizes: N = {n} does not split into {groups} equal groups; pick N divisible by {groups}.")
    envs = [make_mujoco_warp_env(task, n // groups, image_size=image_size, device=device) for _ in range(groups)]
    policy = build_pi05(config, device, CAMERA_MAP, [n // groups], 5, 10, chunk, state_dim=envs[0].task.state_dim)
    loop = PolicyVectorEnv(envs, policy, action_chunk=chunk, groups=groups)
    obs, _ = loop.reset(seed=0)
    for _ in range(2):
        loop.step()
    totals = [_timed(loop.step, device) for _ in range(iters)]
    group_obs = envs[0].reset(seed=0)[0]
    policy_ms = [groups * _timed(lambda: policy.act(group_obs, action_chunk=chunk), device) for _ in range(iters)]
    actions = torch.rand(chunk, n // groups, 7, device=device) * 2 - 1
    renders_before = envs[0].render_count
    sim_ms = [groups * _timed(lambda: [envs[0].step(a) for a in actions], device) for _ in range(iters)]
    chunks_rendered = (envs[0].render_count - renders_before) / iters
    render_ms = [groups * _timed(envs[0]._render, device) for _ in range(iters)]
    total, pol, sim, ren = (percentiles(x)[0] for x in (totals, policy_ms, sim_ms, render_ms))
    sim_only = sim - ren * chunks_rendered  # physics, controller and rules of C sub-steps
    return dict(
        sim="mujoco_warp", task=task, config=config, num_envs=n, groups=groups, chunk=chunk,
        cameras=len(envs[0].cameras), image_size=image_size, env_steps_per_s=n * chunk / total * 1e3,
        step_ms_p50=total, policy_ms_p50=pol,
        sim_ms_p50=sim_only, render_ms_p50=ren * chunks_rendered, simulator_share=(sim_only + ren) / total,
        policy_alone_samples_per_s=n / pol * 1e3, policy_alone_env_steps_per_s=n * chunk / pol * 1e3,
    )  # fmt: skip


def startup(task: str, image_size: int, device: torch.device) -> dict:
    """Seconds to the first observation of a new process (the kernel cache as the environment leaves it)."""
    started = time.perf_counter()
    from wrappers.adapters.mujoco_warp import make_mujoco_warp_env

    env = make_mujoco_warp_env(task, 16, image_size=image_size, device=device)
    env.reset(seed=0)
    env.step(torch.zeros(16, 7, device=device))
    synchronize(device)
    return dict(sim="mujoco_warp", task=task, image_size=image_size, first_step_s=time.perf_counter() - started,
                constructor_s=env.startup_s)  # fmt: skip


def startup_rows(task: str, image_size: int, device: torch.device, out: Path | None, cache: Path | None) -> None:
    """A cold start in an empty kernel cache (`cache`, else a temporary one), then a warm one reusing it.

    Each start is a new process (``--startup``), told the task, image size and device through ``BATCHED_SIM_*``.
    """
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        cache = cache or Path(scratch)
        if cache.exists() and any(cache.iterdir()):
            raise ValueError(f"--warp-cache: expected an empty or missing folder for the cold start, got {cache}.")
        for cache_state in ("cold", "warm"):
            env = {**os.environ, "WARP_CACHE_PATH": str(cache), "BATCHED_SIM_TASK": task,
                   "BATCHED_SIM_IMAGE_SIZE": str(image_size), "BATCHED_SIM_DEVICE": str(device)}  # fmt: skip
            done = subprocess.run([sys.executable, "-m", "benchmarks.bench_batched_sim", "--startup"], cwd=ROOT,
                                  env=env, capture_output=True, text=True, timeout=900, check=True)  # fmt: skip
            rows.append({**json.loads(done.stdout.strip().splitlines()[-1]), "kernel_cache": cache_state})
    write_rows(BENCH, [{"kind": "startup", **row} for row in rows], out)


def ppo(task: str, n: int, config: str, chunk: int, iterations: int, device: torch.device, out: Path | None) -> None:
    """Runs the PPO example on the task and writes one row from its CSV (the default 2 minibatches of 128 samples,
    each as micro-batches of 32: the whole minibatch's activations with two 224 px cameras do not fit 80 GB)."""
    import csv
    import math

    with tempfile.TemporaryDirectory() as folder:
        curve = Path(folder) / "curve.csv"
        argv = ["ppo_pi05.py", "--env", f"mjwarp_{task}", "--config", config, "--device", str(device),
                "--num-envs", str(n), "--num-steps", "4", "--action-chunk", str(chunk), "--total-iterations",
                str(iterations), "--micro-batch-size", "32", "--eval-episodes", "0", "--csv", str(curve)]  # fmt: skip
        started, saved = time.perf_counter(), sys.argv
        try:  # the example as a user runs it, in this process
            sys.argv = argv
            runpy.run_path(str(ROOT / "examples" / "ppo_pi05.py"), run_name="__main__")
        finally:
            sys.argv = saved
        wall = time.perf_counter() - started
        rows = list(csv.DictReader(curve.open()))
    nan_by_design = ("success_rate", "episodic_return", "group_signal")  # no episode ended; no --group-size
    numbers = [float(v) for row in rows for k, v in row.items() if k not in nan_by_design and v]
    mean = lambda key: sum(float(r[key]) for r in rows) / len(rows)  # noqa: E731
    write_rows(BENCH, [dict(
        kind="ppo",
        sim="mujoco_warp", task=task, config=config, num_envs=n, chunk=chunk, num_steps=4, num_minibatches=2,
        micro_batch_size=32, iterations=len(rows),
        finite=all(math.isfinite(x) for x in numbers), wall_s=wall, rollout_s_mean=mean("time_rollout"),
        update_s_mean=mean("time_train"), sync_s_mean=mean("time_sync"), approx_kl_mean=mean("approx_kl"),
        clipfrac_mean=mean("clipfrac"), explained_variance_last=float(rows[-1]["explained_variance"]),
        per_iteration=[{k: r[k] for k in ("time_rollout", "time_train", "time_sync", "approx_kl", "clipfrac")}
                       for r in rows],
    )], out)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="pick_cube", help="pick_cube or push_cube (default pick_cube)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="N worlds (default 64 256 1024)")
    parser.add_argument("--env-only-sizes", type=int, nargs="*", default=None,
                        help="N for the env-only rows (default: --sizes)")  # fmt: skip
    parser.add_argument("--config", default="base", help="policy size: base (bf16) or tiny (default base)")
    parser.add_argument("--image-size", type=int, default=224, help="camera side (default 224)")
    parser.add_argument("--chunk", type=int, default=5, help="C, env steps per policy call (default 5)")
    parser.add_argument("--iters", type=int, default=10, help="timed repetitions (default 10)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument("--sections", nargs="+", default=["env_only", "rollout", "startup", "ppo"],
                        help="env_only rollout startup ppo (default all)")  # fmt: skip
    parser.add_argument("--policy-batch", type=int, default=512,
                        help="rollout: largest policy call; larger N runs as equal groups (default 512)")  # fmt: skip
    parser.add_argument("--ppo-envs", type=int, default=64, help="N for the PPO section (default 64)")
    parser.add_argument("--ppo-iterations", type=int, default=5, help="PPO iterations (default 5)")
    parser.add_argument("--startup", action="store_true", help="(internal) one start-up measurement, printed")
    parser.add_argument("--warp-cache", type=Path, default=None,
                        help="empty folder the start-up rows compile into, then reuse (default: temp)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSONL rows (default results/)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.startup:  # a child of startup_rows
        env = os.environ
        print(json.dumps(startup(env["BATCHED_SIM_TASK"], int(env["BATCHED_SIM_IMAGE_SIZE"]),
                                 torch.device(env["BATCHED_SIM_DEVICE"]))))  # fmt: skip
        return
    if "env_only" in args.sections:
        for n in args.env_only_sizes if args.env_only_sizes is not None else args.sizes:
            rows = env_only(args.task, n, args.image_size, args.chunk, device, args.iters)
            write_rows(BENCH, [{"kind": "env_only", **row} for row in rows], args.out)
    if "rollout" in args.sections:
        for n in args.sizes:
            row = rollout(args.task, n, args.image_size, args.chunk, args.config, device, args.iters, args.policy_batch)
            write_rows(BENCH, [{"kind": "rollout", **row}], args.out)
    if "startup" in args.sections:
        startup_rows(args.task, args.image_size, device, args.out, args.warp_cache)
    if "ppo" in args.sections:
        ppo(args.task, args.ppo_envs, args.config, args.chunk, args.ppo_iterations, device, args.out)


if __name__ == "__main__":
    main()
