"""Wrapper + processor overhead over the bare model call at N = 8 and 64 (DESIGN performance target <= 10 %).

A non-rendering scripted env (canonical observation: 1-3 cameras of 224x224 uint8 synthetic images, an 8-dim
state, a task string; no episode ends inside the timed window) runs under `PolicyVectorEnv` with ``step(None)``.
Per call p50 of: env-only stepping (C sub-steps of the bare inner vector env), the wrapper step,
``policy.act(obs)`` (processor included) and ``policy.act_inputs(inputs)`` (already processed inputs on the
policy device = the bare model call). The overhead fraction is ``(wrapper_step - env - act_inputs) / act_inputs``
(env time excluded). The measurements are interleaved round-robin so that load changes hit all of them alike.
This script never imports mujoco. `bench_overlap.py` measures env/policy overlap with env groups.

    python -m benchmarks.bench_wrapper --device cpu --config tiny --out DIR     # rows -> wrapper_overhead.jsonl
    python -m benchmarks.bench_wrapper --device cuda --config base --cameras 2 3

`run(out, device)` is the `wrapper` section of `gpu_suite.py` (N = 8 and 64, base config on CUDA).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

from benchmarks.common import build_pi05, percentiles, synchronize, write_rows
from policies.pi05.policy import Pi05Policy
from wrappers.adapters.scripted import canonical_observation_space
from wrappers.freeze import make_freezable_vector_env
from wrappers.policy_vector_env import PolicyVectorEnv

BENCH = "wrapper_overhead"
CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
STATE_DIM, ACTION_DIM = 8, 7
TASK = "pick up the black bowl next to the plate and place it on the plate"


def device_name(device: torch.device) -> str:
    """The GPU's name, or ``cpu xN`` with the host's core count."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{os.cpu_count()}"


class SyntheticEnv(gym.Env):
    """Non-rendering canonical env: fixed random 224x224 uint8 images per camera, an 8-dim state, a task.

    Episodes are truncated after `episode_length` steps (default: never inside a benchmark).
    """

    metadata = {"render_modes": []}

    def __init__(self, cameras: Sequence[str], image_size: int = 224, episode_length: int = 10**9) -> None:
        self.observation_space = canonical_observation_space({c: (image_size, image_size) for c in cameras}, STATE_DIM)
        self.action_space = spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32)
        rng = np.random.default_rng(0)
        self._images = {c: rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8) for c in cameras}
        self._state = np.zeros(STATE_DIM, np.float32)
        self._t = 0
        self.episode_length = episode_length

    def _obs(self) -> dict[str, Any]:
        return {"images": self._images, "state": self._state.copy(), "task": TASK}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self._state = self.np_random.uniform(-0.5, 0.5, STATE_DIM).astype(np.float32)
        self._t = 0
        return self._obs(), {}

    def step(self, action: np.ndarray) -> tuple[Any, float, bool, bool, dict]:
        self._t += 1
        self._state[:ACTION_DIM] = np.clip(self._state[:ACTION_DIM] + 0.01 * action, -1.0, 1.0)
        return self._obs(), 0.0, False, self._t >= self.episode_length, {}


def make_synthetic_env(n: int, cameras: Sequence[str]) -> gym.vector.VectorEnv:
    return make_freezable_vector_env([functools.partial(SyntheticEnv, tuple(cameras))] * n, vectorization="sync")


def bench_overhead(
    device: torch.device,
    config_name: str,
    batches: Sequence[int],
    num_cameras: Sequence[int],
    chunk: int,
    iters: int,
    warmup: int,
    num_steps: int = 5,
    horizon: int = 10,
) -> list[dict[str, Any]]:
    """Overhead rows for every (cameras, N)."""
    rows = []
    for k in num_cameras:
        cameras = CAMERAS[:k]
        t0 = time.perf_counter()
        policy = build_pi05(config_name, device, {c: c for c in cameras}, batches, num_steps, horizon, chunk)
        synchronize(device)
        setup_s = time.perf_counter() - t0
        for n in batches:
            rows.append(_overhead_one(policy, device, config_name, cameras, n, chunk, iters, warmup, setup_s))
        policy.close()
        del policy
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _overhead_one(
    policy: Pi05Policy,
    device: torch.device,
    config_name: str,
    cameras: Sequence[str],
    n: int,
    chunk: int,
    iters: int,
    warmup: int,
    setup_s: float,
) -> dict[str, Any]:
    wrapped = PolicyVectorEnv(make_synthetic_env(n, cameras), policy, action_chunk=chunk)
    bare = make_synthetic_env(n, cameras)  # a second copy for env-only stepping
    obs, _ = wrapped.reset(seed=0)
    bare.reset(seed=0)
    inputs = policy.processor(obs)  # already on the policy device
    actions = np.random.default_rng(0).uniform(-1, 1, (n, chunk, ACTION_DIM)).astype(np.float32)

    def env_only() -> None:
        for k in range(chunk):
            bare.step(actions[:, k])

    latest = {"obs": obs}

    def wrapper_step() -> None:
        latest["obs"] = wrapped.step()[0]
        synchronize(device)

    def act_obs() -> None:  # on the observation the wrapper just returned (host numpy, as the wrapper sees it)
        policy.act(latest["obs"], action_chunk=chunk).actions.cpu()

    def act_inputs() -> None:
        policy.act_inputs(inputs, action_chunk=chunk).actions.cpu()

    def wrapper_explicit() -> None:  # chunk execution with given actions: the wrapper without the policy
        wrapped.step(actions)
        synchronize(device)

    fns: dict[str, Callable[[], None]] = {
        "env": env_only,
        "wrapper_step": wrapper_step,
        "act_obs": act_obs,
        "act_inputs": act_inputs,
        "wrapper_explicit_actions": wrapper_explicit,
    }
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + iters):
        for name, fn in fns.items():
            synchronize(device)
            t = time.perf_counter()
            fn()
            dt = (time.perf_counter() - t) * 1e3
            if i >= warmup:
                times[name].append(dt)
    wrapped.close()
    bare.close()
    ms = {f"{name}_ms_p50": round(percentiles(v)[0], 3) for name, v in times.items()}
    ms.update({f"{name}_ms_p90": round(percentiles(v)[1], 3) for name, v in times.items()})
    ms.update({f"{name}_ms_min": round(min(v), 3) for name, v in times.items()})
    # least-disturbed estimate on a shared machine: the same fraction from each measurement's minimum
    lo = {name: min(v) for name, v in times.items()}
    overhead_min = (lo["wrapper_step"] - lo["env"] - lo["act_inputs"]) / lo["act_inputs"]
    env, step, a_obs, a_in = (percentiles(times[k])[0] for k in ("env", "wrapper_step", "act_obs", "act_inputs"))
    return {
        "device": device_name(device),
        "config": {
            "model": config_name,
            "dtype": str(policy.model.compute_dtype).removeprefix("torch."),
            "num_steps": policy.rollout.num_steps,
            "method": policy.rollout.method,
            "action_horizon": policy.action_horizon,
            "action_chunk": chunk,
            "cameras": len(cameras),
            "image_hw": [224, 224],
            "state_dim": STATE_DIM,
            "prompt_len": int(inputs.tokens.shape[1]),
            "env": "SyntheticEnv (sync, non-rendering)",
            "gymnasium": gym.__version__,
            "iters": iters,
            "warmup": warmup,
        },
        "batch": n,
        "setup_s": round(setup_s, 2),
        **ms,
        "processor_ms": round(a_obs - a_in, 3),
        "wrapper_minus_env_minus_act_obs_ms": round(step - env - a_obs, 3),
        "overhead_ms": round(step - env - a_in, 3),
        "overhead_frac": round((step - env - a_in) / a_in, 4),
        "overhead_frac_from_min": round(overhead_min, 4),
        "target_overhead_frac": 0.10,
        "met": bool((step - env - a_in) / a_in <= 0.10),
    }


def run(
    out_path: str | Path | None = None,
    device: str | torch.device = "cuda",
    config_name: str | None = None,
    cameras: Sequence[int] = (2, 3),
    iters: int | None = None,
) -> list[dict[str, Any]]:
    """Overhead rows at N = 8 and 64 (base bf16 on CUDA, tiny on CPU); appends to ``wrapper_overhead.jsonl``."""
    device = torch.device(device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    config_name = config_name or ("base" if device.type == "cuda" else "tiny")
    iters = iters or (20 if device.type == "cuda" else 7)
    rows = bench_overhead(device, config_name, [8, 64], cameras, chunk=5, iters=iters, warmup=3)
    return write_rows(BENCH, rows, out_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for wrapper_overhead.jsonl (default: results/)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", choices=["tiny", "base"], default=None, help="default: tiny on CPU, base on CUDA")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--cameras", type=int, nargs="+", default=[1, 3], help="numbers of cameras (1-3)")
    parser.add_argument("--chunk", type=int, default=5, help="C for the overhead measurement (H=10, K=5)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (1: no OpenMP contention)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    config_name = args.config or ("base" if device.type == "cuda" else "tiny")
    iters = args.iters or (20 if device.type == "cuda" else 9)
    rows = bench_overhead(device, config_name, args.batches, args.cameras, args.chunk, iters, args.warmup)
    write_rows(BENCH, rows, args.out)


if __name__ == "__main__":
    main()
