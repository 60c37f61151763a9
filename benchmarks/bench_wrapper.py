"""Wrapper benchmarks (DESIGN performance targets):

1. ``overhead`` -- wrapper + processor overhead over the bare model call at N = 8 and 64. A non-rendering scripted
   env (canonical observation: 1-3 cameras of 224x224 uint8 synthetic images, an 8-dim state, a task string; no
   episode ends inside the timed window) runs under `PolicyVectorEnv` with ``step(None)``. Per call p50 of:
   env-only stepping (C sub-steps of the bare inner vector env), the wrapper step, ``policy.act(obs)`` (processor
   included) and ``policy.act_inputs(inputs)`` (already processed inputs on the policy device = the bare model
   call). The overhead fraction is ``(wrapper_step - env - act_inputs) / act_inputs`` (env time excluded; target
   <= 10 %). The four measurements are interleaved round-robin so that load changes hit all of them alike. This
   part never imports mujoco (the GPU machine carries gymnasium but not mujoco).
2. ``overlap`` -- env stepping overlapped with inference (env groups): Pusher-v5 rendered at 224x224 in
   AsyncVectorEnv subprocesses, ``groups=1`` vs ``groups=2`` (within-step overlap), ``groups=2, prefetch=True``
   (cross-step prefetch: a group's policy call for the next step starts as soon as its chunk is done) and
   ``groups=2`` with the thread pool disabled (the same groups run one after the other), with the same total N,
   interleaved in rounds. Reports env-steps/s,
   the policy-busy fraction (time inside ``policy.act`` / wall time), the env and policy time per chunk measured
   alone, and the speedup (target >= 1.6x when both take similar time). Two policies: the tiny PI0.5 (CPU
   compute in the main process) and an "accelerator-emulating" policy that waits ``ms_per_sample * n`` without
   using the CPU (as the host does while a GPU computes), then returns Gaussian actions.
   It also checks that ``groups=2`` (with and without prefetch) returns the same rewards, states, images and
   actions as ``groups=1`` for the same seeds.

    python benchmarks/bench_wrapper.py --which overhead --device cpu --config tiny --out results.jsonl
    python benchmarks/bench_wrapper.py --which overhead --device cuda --config base --cameras 2 3 --out results.jsonl
    python benchmarks/bench_wrapper.py --which overlap --out results.jsonl      # CPU, needs mujoco + EGL/OSMesa

`run(out_path, device)` is the entry point of the GPU suite (overhead at N = 8 and 64, base config on CUDA).
Rows are JSONL with device name, torch version, git commit (``PHYAI_GYM_COMMIT`` or ``git rev-parse HEAD``),
thread count, load average and the configuration.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policies.base import PolicyOutput  # noqa: E402
from policies.baseline import GaussianPolicy  # noqa: E402
from policies.pi05.config import Pi05Config  # noqa: E402
from policies.pi05.normalize import NormStats  # noqa: E402
from policies.pi05.policy import Pi05Policy, RolloutConfig  # noqa: E402
from policies.pi05.processor import Pi05Processor  # noqa: E402
from policies.pi05.scheduler import SchedulerConfig  # noqa: E402
from wrappers.adapters.scripted import canonical_observation_space  # noqa: E402
from wrappers.freeze import make_freezable_vector_env  # noqa: E402
from wrappers.policy_vector_env import PolicyVectorEnv  # noqa: E402

CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
STATE_DIM, ACTION_DIM = 8, 7
TASK = "pick up the black bowl next to the plate and place it on the plate"


# --------------------------------------------------------------------------------------------------- common
def git_commit() -> str:
    if os.environ.get("PHYAI_GYM_COMMIT"):
        return os.environ["PHYAI_GYM_COMMIT"]
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], text=True, cwd=Path(__file__).resolve().parent, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def meta_row(device: torch.device) -> dict[str, Any]:
    """Device and software identification for every row."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{os.cpu_count()}"
    return {
        "device": name,
        "torch": torch.__version__,
        "gymnasium": gym.__version__,
        "commit": git_commit(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def p50(samples: Sequence[float]) -> float:
    return float(statistics.median(samples))


def p90(samples: Sequence[float]) -> float:
    s = sorted(samples)
    return float(s[min(len(s) - 1, int(0.9 * len(s)))])


def emit(rows: list[dict[str, Any]], out: Path | None) -> None:
    for row in rows:
        print(json.dumps(row), flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")


def build_pi05(
    config_name: str,
    device: torch.device,
    camera_map: Mapping[str, str],
    batches: Sequence[int],
    num_steps: int,
    horizon: int,
    chunk: int,
    state_dim: int = STATE_DIM,
) -> Pi05Policy:
    """Random-weight PI0.5 (tiny fp32 or full-size bf16) with the stand-in tokenizer and quantile state stats."""
    overrides = dict(action_horizon=horizon, num_steps=num_steps, max_token_len=48)
    if config_name == "tiny":
        config, dtype = Pi05Config.tiny(**overrides), "float32"
    elif config_name == "base":
        config, dtype = Pi05Config.pi05_base(**overrides), "bfloat16"
    else:
        raise ValueError(f"--config: expected 'tiny' or 'base', got {config_name!r}.")
    stats = NormStats(mean=np.zeros(state_dim), std=np.ones(state_dim), q01=-np.ones(state_dim), q99=np.ones(state_dim))
    processor = Pi05Processor.for_config(
        config,
        action_dim=ACTION_DIM,
        device=device,
        tokenizer="phyai-standin",
        camera_map=dict(camera_map),
        state_stats=stats,
    )
    max_batch = max(batches)
    scheduler = SchedulerConfig(
        max_batch_size=max_batch,
        batch_buckets=tuple(sorted(set(batches))),
        prompt_buckets=tuple(processor.prompt_buckets),
        num_steps=(num_steps,),
        camera_sets=(tuple(processor.slots),),
        cuda_graphs=device.type == "cuda",
    )
    rollout = RolloutConfig(method="sde", num_steps=num_steps, action_chunk=chunk)
    return Pi05Policy.from_config(
        config,
        processor,
        action_dim=ACTION_DIM,
        device=device,
        dtype=dtype,
        seed=0,
        rollout=rollout,
        scheduler=scheduler,
    )


# ------------------------------------------------------------------------------------- 1. overhead
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
        sync(device)
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
        sync(device)

    def act_obs() -> None:  # on the observation the wrapper just returned (host numpy, as the wrapper sees it)
        policy.act(latest["obs"], action_chunk=chunk).actions.cpu()

    def act_inputs() -> None:
        policy.act_inputs(inputs, action_chunk=chunk).actions.cpu()

    def wrapper_explicit() -> None:  # chunk execution with given actions: the wrapper without the policy
        wrapped.step(actions)
        sync(device)

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
            sync(device)
            t = time.perf_counter()
            fn()
            dt = (time.perf_counter() - t) * 1e3
            if i >= warmup:
                times[name].append(dt)
    wrapped.close()
    bare.close()
    ms = {f"{name}_ms_p50": round(p50(v), 3) for name, v in times.items()}
    ms.update({f"{name}_ms_p90": round(p90(v), 3) for name, v in times.items()})
    ms.update({f"{name}_ms_min": round(min(v), 3) for name, v in times.items()})
    # least-disturbed estimate on a shared machine: the same fraction from each measurement's minimum
    lo = {name: min(v) for name, v in times.items()}
    overhead_min = (lo["wrapper_step"] - lo["env"] - lo["act_inputs"]) / lo["act_inputs"]
    env, step, a_obs, a_in = (p50(times[k]) for k in ("env", "wrapper_step", "act_obs", "act_inputs"))
    return {
        "bench": "wrapper_overhead",
        **meta_row(device),
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


# -------------------------------------------------------------------------------------- 2. overlap
class TimedPolicy:
    """Forwards to a policy and accumulates the time it is busy in ``act``/``value``.

    On CPU: the host time inside the call. On CUDA, without synchronizing (a device-wide sync here would hold
    the caller until every queued call finished, and so change the schedule it measures): per call the larger
    of the host time inside ``act`` and the GPU span between events recorded at its entry and exit, summed
    once they completed (`settle`).
    """

    def __init__(self, policy: Any) -> None:
        self.inner = policy
        self.device = policy.device
        self.action_horizon = policy.action_horizon
        self.action_dim = getattr(policy, "action_dim", None)
        self.busy_s = 0.0
        self.calls = 0
        self._pending: list[tuple[float, float, int, Any, Any]] = []
        self._pending_lock = threading.Lock()
        self.timeline: list[tuple[str, int, float, float]] | None = None  # ("policy", first env id, start, end)

    @property
    def streams(self) -> Any:
        """The inner policy's random-stream table (``prefetch=True`` restores rows of it on a discard)."""
        return self.inner.streams

    @property
    def weight_version(self) -> int:
        """The inner policy's weight version (a prefetched output must match it)."""
        return self.inner.weight_version

    def act(self, obs: Mapping[str, Any], **kwargs: Any) -> PolicyOutput:
        cuda = torch.device(self.device).type == "cuda"
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if start is not None:
            start.record()
        t = time.perf_counter()
        first = int(next(iter(kwargs.get("env_ids") or [-1])))
        try:
            return self.inner.act(obs, **kwargs)
        finally:
            host = time.perf_counter() - t
            with self._pending_lock:
                self.calls += 1
                if start is None:
                    self.busy_s += host
                    if self.timeline is not None:
                        self.timeline.append(("policy", first, t, t + host))
                else:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    self._pending.append((t, host, first, start, end))

    def settle(self) -> None:
        """Adds the completed GPU spans to ``busy_s`` (waits for the calls still running)."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for t, host, first, start, end in pending:
            end.synchronize()
            busy = max(host, start.elapsed_time(end) / 1e3)
            self.busy_s += busy
            if self.timeline is not None:  # the end is approximate on CUDA: start + max(host, GPU span)
                self.timeline.append(("policy", first, t, t + busy))

    def value(self, obs: Mapping[str, Any], **kwargs: Any) -> torch.Tensor:
        t = time.perf_counter()
        try:
            return self.inner.value(obs, **kwargs)
        finally:
            with self._pending_lock:
                self.busy_s += time.perf_counter() - t


class EmulatedAcceleratorPolicy(GaussianPolicy):
    """Gaussian actions after waiting ``ms_per_call + ms_per_sample * n`` without using the CPU.

    Emulates a policy whose model runs on an accelerator while the host waits (the main process is idle, as it is
    while a CUDA graph replays), so the env subprocesses get the CPU cores during inference. `ms_host_per_call`
    of that time is spent first in a Python loop holding the GIL, as a real policy's launch path does
    (preprocessing, copies into static buffers, graph launches).
    """

    def __init__(
        self,
        action_dim: int,
        action_horizon: int,
        ms_per_sample: float,
        ms_per_call: float = 0.0,
        ms_host_per_call: float = 0.0,
    ) -> None:
        super().__init__(action_dim, action_horizon, std=0.3)
        self.ms_per_sample, self.ms_per_call, self.ms_host_per_call = ms_per_sample, ms_per_call, ms_host_per_call

    def act(self, obs: Mapping[str, Any], **kwargs: Any) -> PolicyOutput:
        n = int(np.shape(obs["state"])[0])
        total = (self.ms_per_call + self.ms_per_sample * n) / 1e3
        start = time.perf_counter()
        host_end = start + min(self.ms_host_per_call / 1e3, total)
        while time.perf_counter() < host_end:  # pure Python: holds the GIL
            pass
        time.sleep(max(0.0, start + total - time.perf_counter()))
        return super().act(obs, **kwargs)


def make_pusher_group(n: int, context: str | None, image_size: int = 224) -> gym.vector.VectorEnv:
    """`n` Pusher-v5 envs (canonical obs, 224x224 render), one subprocess each (AsyncVectorEnv)."""
    from wrappers.adapters import mujoco as mj  # imports gymnasium only; mujoco is loaded by gym.make

    os.environ.setdefault("MUJOCO_GL", "egl")
    fn = functools.partial(mj._make_single, "Pusher-v5", image_size, "push the puck to the goal", {})
    kwargs = {} if context is None else {"context": context}
    return make_freezable_vector_env([fn] * n, vectorization="async", **kwargs)


def _run_steps(env: PolicyVectorEnv, policy: TimedPolicy, steps: int) -> dict[str, float]:
    policy.settle()
    busy0, calls0, t0, executed = policy.busy_s, policy.calls, time.perf_counter(), 0
    for _ in range(steps):
        _, _, _, _, info = env.step()
        executed += int(np.asarray(info["substep_mask"]).sum())
    wall = time.perf_counter() - t0
    policy.settle()
    return {"wall_s": wall, "busy_s": policy.busy_s - busy0, "env_steps": executed, "calls": policy.calls - calls0}


def _alone_times(groups: list[gym.vector.VectorEnv], policy: Any, chunk: int, iters: int) -> dict[str, float]:
    """Env time per chunk (C steps of one group's async vector env) and policy time per call, each alone."""
    venv = groups[0]
    n = venv.num_envs
    obs, _ = venv.reset(seed=123)
    rng = np.random.default_rng(0)
    env_ms, pol_ms, pol_all_ms = [], [], []
    all_obs = {
        "images": {k: np.concatenate([v] * len(groups)) for k, v in obs["images"].items()},
        "state": np.concatenate([obs["state"]] * len(groups)),
        "task": tuple(obs["task"]) * len(groups),
    }
    for _ in range(iters + 1):
        actions = rng.uniform(-1, 1, (n, chunk, ACTION_DIM)).astype(np.float32)
        t = time.perf_counter()
        for k in range(chunk):
            obs, *_ = venv.step(actions[:, k])
        env_ms.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        policy.act(obs, action_chunk=chunk).actions.cpu()
        pol_ms.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        policy.act(all_obs, action_chunk=chunk).actions.cpu()
        pol_all_ms.append((time.perf_counter() - t) * 1e3)
    return {
        "env_chunk_ms_per_group_p50": round(p50(env_ms[1:]), 2),
        "policy_ms_per_group_call_p50": round(p50(pol_ms[1:]), 2),
        "policy_ms_all_envs_p50": round(p50(pol_all_ms[1:]), 2),
    }


def check_group_equivalence(policy: Any, n: int, chunk: int, context: str | None, steps: int = 3) -> dict:
    """groups=2 (with and without prefetch) vs groups=1 on Pusher with the same seeds: max |diff| of rewards,
    states, images and policy actions over `steps` steps."""
    variants = {"G1": (1, False), "G2": (2, False), "G2_prefetch": (2, True)}
    records = {}
    for name, (g, prefetch) in variants.items():
        envs = [make_pusher_group(n // g, context) for _ in range(g)]
        env = PolicyVectorEnv(envs if g > 1 else envs[0], policy, action_chunk=chunk, groups=g, prefetch=prefetch)
        obs, _ = env.reset(seed=7)
        rec = []
        for _ in range(steps):
            obs, rew, _, _, info = env.step()
            arrays = (rew, obs["state"], info["policy"]["actions"].cpu().numpy(), obs["images"]["image"])
            rec.append([np.asarray(a, dtype=np.float64) for a in arrays])
        env.close()
        records[name] = rec
    out = {}
    for name in ("G2", "G2_prefetch"):
        diff = dict.fromkeys(("rewards", "state", "actions", "images"), 0.0)
        for a, b in zip(records["G1"], records[name]):
            for key, x, y in zip(diff, a, b):
                diff[key] = max(diff[key], float(np.abs(x - y).max()))
        out[name] = {"max_abs_diff_vs_G1": diff, "exact": all(v == 0.0 for v in diff.values())}
    return {"equivalence_steps": steps, "equivalence": out}


def _timed_run(run: Any, first: int, events: list[tuple[str, int, float, float]]) -> Any:
    """`ChunkRunner.run` that appends ("env", first env id, start, end) to `events`."""

    def timed(actions: Any, started: Any = None) -> Any:
        t = time.perf_counter()
        try:
            return run(actions, started)
        finally:
            events.append(("env", first, t, time.perf_counter()))

    return timed


def bench_overlap(
    policy_kind: str,
    num_envs: int,
    chunk: int,
    steps: int,
    rounds: int,
    context: str | None,
    num_steps: int = 5,
    ms_per_sample: float | None = None,
    group_counts: Sequence[int] = (1, 2),
    serial: bool = True,
    prefetch: bool = True,
    check_equal: bool = True,
    device: str | torch.device = "cpu",
    config_name: str = "tiny",
    switch_interval: float | None = None,
    env_concurrency_variant: bool = True,
    ms_host_per_call: float = 0.0,
) -> dict[str, Any]:
    """One overlap row: G=1 vs G in `group_counts`, G=2 with ``prefetch=True`` (and G=2 run serially) on the same
    total N, interleaved. ``policy_kind="pi05"`` runs PI0.5 of `config_name` on `device` (CUDA graphs on a GPU).

    `switch_interval` (seconds) adds a variant: the G2_prefetch wrapper stepped with `sys.setswitchinterval`
    at that value (the default is 5 ms), to see whether GIL hand-offs between the prefetch, env and main threads
    cost time. `env_concurrency_variant` adds G2_prefetch_env1: G=2 with prefetch and ``env_concurrency=1`` (the
    groups' chunks run one at a time). The row's `timeline_<variant>` lists the env chunks and policy calls of the
    last round of each prefetch variant."""
    device = torch.device(device)
    probe_groups = [make_pusher_group(num_envs // 2, context) for _ in range(2)]
    if policy_kind == "pi05":
        inner: Any = build_pi05(
            config_name, device, {"image": "base_0_rgb"}, [num_envs // 2, num_envs], num_steps, 10, chunk, state_dim=23
        )
        alone = _alone_times(probe_groups, inner, chunk, iters=4)
    elif policy_kind == "emulated":
        calib = _alone_times(probe_groups, GaussianPolicy(ACTION_DIM, 10), chunk, iters=4)
        if ms_per_sample is None:  # policy time of all N envs = env time of one chunk of G=1 (both groups' envs)
            ms_per_sample = 2 * calib["env_chunk_ms_per_group_p50"] / num_envs
        inner = EmulatedAcceleratorPolicy(ACTION_DIM, 10, ms_per_sample, ms_host_per_call=ms_host_per_call)
        alone = {
            **calib,
            "policy_ms_per_group_call_p50": round(ms_per_sample * num_envs / 2, 2),
            "policy_ms_all_envs_p50": round(ms_per_sample * num_envs, 2),
        }
    else:
        raise ValueError(f"policy_kind: expected 'pi05' or 'emulated', got {policy_kind!r}.")
    for g in probe_groups:
        g.close()
    # G=1 env time of one chunk over all N envs (N subprocesses on the machine's cores)
    one = make_pusher_group(num_envs, context)
    one.reset(seed=1)
    acts = np.zeros((num_envs, ACTION_DIM), np.float32)
    env_all = []
    for _i in range(4):
        t = time.perf_counter()
        for _ in range(chunk):
            one.step(acts)
        env_all.append((time.perf_counter() - t) * 1e3)
    one.close()
    alone["env_chunk_ms_all_envs_p50"] = round(p50(env_all[1:]), 2)

    timed = TimedPolicy(inner)
    variants: dict[str, PolicyVectorEnv] = {}
    for g in group_counts:
        envs = [make_pusher_group(num_envs // g, context) for _ in range(g)]
        variants[f"G{g}"] = PolicyVectorEnv(envs if g > 1 else envs[0], timed, action_chunk=chunk, groups=g)
    if prefetch:
        for name, limit in [("G2_prefetch", None), ("G2_prefetch_env1", 1)][: 1 + env_concurrency_variant]:
            envs = [make_pusher_group(num_envs // 2, context) for _ in range(2)]
            variants[name] = PolicyVectorEnv(
                envs, timed, action_chunk=chunk, groups=2, prefetch=True, env_concurrency=limit
            )
    if serial:
        envs = [make_pusher_group(num_envs // 2, context) for _ in range(2)]
        env = PolicyVectorEnv(envs, timed, action_chunk=chunk, groups=2)
        env._pool.shutdown()
        env._pool = None  # same two groups, stepped one after the other (no overlap)
        variants["G2_serial"] = env
    for i, env in enumerate(variants.values()):
        env.reset(seed=100 * i)
        _run_steps(env, timed, 1)  # warm-up
    intervals = {}
    if switch_interval is not None and "G2_prefetch" in variants:
        # the same wrapper again, with a shorter GIL switch interval (tests GIL contention between threads)
        name = f"G2_prefetch_switch_{switch_interval * 1e3:g}ms"
        variants[name], intervals[name] = variants["G2_prefetch"], switch_interval
    events: list[tuple[str, int, float, float]] = []
    traced = [name for name in ("G2_prefetch", "G2_prefetch_env1") if name in variants]
    for name in traced:  # env chunks of the prefetch variants, for their timelines
        for runner in variants[name]._runners:
            runner.run = _timed_run(runner.run, runner.offset, events)
    agg = {name: {"wall_s": 0.0, "busy_s": 0.0, "env_steps": 0, "calls": 0} for name in variants}
    per_round: dict[str, list[float]] = {name: [] for name in variants}
    timelines: dict[str, list[list[Any]]] = {}
    for round_index in range(rounds):
        for name, env in variants.items():
            record = name in traced and round_index == rounds - 1
            events.clear()
            timed.timeline = events if record else None
            default_interval = sys.getswitchinterval()
            sys.setswitchinterval(intervals.get(name, default_interval))
            t0 = time.perf_counter()
            try:
                r = _run_steps(env, timed, steps)
            finally:
                sys.setswitchinterval(default_interval)
                timed.timeline = None
            if record:
                timelines[f"timeline_{name}"] = [
                    [kind, first, round((a - t0) * 1e3, 1), round((b - t0) * 1e3, 1)]
                    for kind, first, a, b in sorted(events, key=lambda e: e[2])
                ]
            for key in agg[name]:
                agg[name][key] += r[key]
            per_round[name].append(r["env_steps"] / r["wall_s"])
    for env in {id(env): env for env in variants.values()}.values():
        env.close()
    results = {}
    for name, a in agg.items():
        results[name] = {
            "env_steps_per_s": round(a["env_steps"] / a["wall_s"], 3),
            "env_steps_per_s_rounds": [round(x, 3) for x in per_round[name]],
            "policy_busy_frac": round(a["busy_s"] / a["wall_s"], 3),
            # beside "alone": a call slower here than alone means the envs compete with the policy (CPU or GPU)
            "policy_ms_per_call": round(1e3 * a["busy_s"] / max(a["calls"], 1), 2),
            "ms_per_wrapper_step": round(1e3 * a["wall_s"] / (rounds * steps), 1),
        }
    base = results["G1"]["env_steps_per_s"]
    speedups = {f"{name}_over_G1": round(r["env_steps_per_s"] / base, 3) for name, r in results.items() if name != "G1"}
    for ref in ("G2", "G2_serial"):  # cross-step prefetch vs the same groups without it
        if "G2_prefetch" in results and ref in results:
            ratio = results["G2_prefetch"]["env_steps_per_s"] / results[ref]["env_steps_per_s"]
            speedups[f"G2_prefetch_over_{ref}"] = round(ratio, 3)
    row = {
        "bench": "wrapper_overlap",
        **meta_row(device),
        "config": {
            "env": "Pusher-v5 224x224 rgb_array, AsyncVectorEnv (1 subprocess per env)",
            "mujoco_gl": os.environ.get("MUJOCO_GL"),
            "egl_device": os.environ.get("MUJOCO_EGL_DEVICE_ID"),
            "policy_device": str(device),
            "mp_context": context or "default (fork)",
            "policy": policy_kind
            if policy_kind == "emulated"
            else f"pi05 {config_name} {inner.model.compute_dtype}, K={num_steps}, method=sde, {device.type}",
            "ms_per_sample": ms_per_sample,
            "ms_host_per_call": ms_host_per_call if policy_kind == "emulated" else None,
            "num_envs": num_envs,
            "action_chunk": chunk,
            "steps_per_round": steps,
            "rounds": rounds,
            "cpu_cores": os.cpu_count(),
        },
        "alone": alone,
        "results": results,
        "speedup": speedups,
        "target_speedup": 1.6,
        # last round of each prefetch variant: [kind ("env" / "policy"), first env id of the group, start, end ms]
        **timelines,
    }
    if check_equal:
        row.update(check_group_equivalence(inner, num_envs, chunk, context))
    return row


# ---------------------------------------------------------------------------------------------- entry
def run(
    out_path: str | Path,
    device: str | torch.device = "cuda",
    config_name: str | None = None,
    cameras: Sequence[int] = (2, 3),
    iters: int | None = None,
) -> list[dict[str, Any]]:
    """GPU-suite entry point: overhead rows at N = 8 and 64 (base bf16 on CUDA, tiny on CPU); appends to `out_path`."""
    device = torch.device(device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    config_name = config_name or ("base" if device.type == "cuda" else "tiny")
    iters = iters or (20 if device.type == "cuda" else 7)
    rows = bench_overhead(device, config_name, [8, 64], cameras, chunk=5, iters=iters, warmup=3)
    emit(rows, Path(out_path))
    return rows


def plot(jsonl: Path, png: Path) -> None:
    """Bar charts: overhead fraction per (cameras, N) and env-steps/s per overlap variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    over = [r for r in rows if r["bench"] == "wrapper_overhead"]
    lap = [r for r in rows if r["bench"] == "wrapper_overlap"]
    fig, axes = plt.subplots(1, 1 + len(lap), figsize=(4.5 * (1 + len(lap)), 3.8))
    axes = np.atleast_1d(axes)
    labels = [f"{r['config']['cameras']}cam N={r['batch']}" for r in over]
    x = np.arange(len(over))
    axes[0].bar(x - 0.2, [100 * r["overhead_frac"] for r in over], 0.4, label="from p50")
    axes[0].bar(x + 0.2, [100 * r.get("overhead_frac_from_min", np.nan) for r in over], 0.4, label="from min")
    axes[0].axhline(10, color="k", ls="--", lw=1, label="target 10 %")
    axes[0].set_xticks(x, labels, fontsize=8)
    axes[0].set_ylabel("(step - env - act_inputs) / act_inputs, %")
    axes[0].set_title(f"wrapper+processor overhead ({over[0]['device'] if over else ''})", fontsize=9)
    axes[0].legend(fontsize=7)
    for ax, r in zip(axes[1:], lap):
        names = list(r["results"])
        vals = [r["results"][n]["env_steps_per_s"] for n in names]
        ax.bar(range(len(names)), vals, color=["C0", "C1", "C2", "C7"][: len(names)])
        for i in range(len(names)):
            ax.text(i, vals[i], f"{vals[i] / vals[0]:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(
            range(len(names)),
            [
                n.replace("_prefetch_prototype", "\nprefetch\n(prototype)").replace("_prefetch", "\nprefetch")
                for n in names
            ],
            fontsize=7,
        )
        cfg, alone = r["config"], r["alone"]
        ax.set_title(
            f"{cfg['policy']} ({cfg['mp_context']})\nN={cfg['num_envs']} C={cfg['action_chunk']}: policy "
            f"{alone['policy_ms_all_envs_p50']:.0f} ms, env {alone['env_chunk_ms_all_envs_p50']:.0f} ms / chunk",
            fontsize=8,
        )
        ax.set_ylabel("env-steps/s")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--which", choices=["overhead", "overlap", "all", "plot"], default="all")
    parser.add_argument("--png", type=Path, default=None, help="--which plot: write the chart of --out here")
    parser.add_argument("--out", type=Path, default=None, help="append JSONL rows here (default: print only)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", choices=["tiny", "base"], default=None, help="default: tiny on CPU, base on CUDA")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--cameras", type=int, nargs="+", default=[1, 3], help="numbers of cameras (1-3)")
    parser.add_argument("--chunk", type=int, default=5, help="C for the overhead measurement (H=10, K=5)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (1: no OpenMP contention)")
    # overlap
    parser.add_argument("--policy", choices=["pi05", "emulated"], nargs="+", default=["pi05", "emulated"])
    parser.add_argument("--overlap-envs", type=int, default=4, help="total N (G=2: N/2 per group)")
    parser.add_argument("--overlap-chunk", type=int, default=2)
    parser.add_argument("--overlap-k", type=int, default=5, help="tiny PI0.5 denoise steps K (sizes the policy)")
    parser.add_argument("--ms-per-sample", type=float, default=None, help="emulated policy (default: calibrated)")
    parser.add_argument("--ms-host-per-call", type=float, default=0.0,
                        help="emulated policy: ms of each call spent in Python holding the GIL")
    parser.add_argument("--steps", type=int, default=4, help="wrapper steps per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context", default=None, help="multiprocessing start method (fork, forkserver, spawn)")
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-serial", action="store_true")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--no-prefetch", action="store_true", help="skip groups=2 with prefetch=True")
    args = parser.parse_args()

    if args.which == "plot":
        plot(args.out, args.png or args.out.with_suffix(".png"))
        return
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    if args.which in ("overhead", "all"):
        config_name = args.config or ("base" if device.type == "cuda" else "tiny")
        iters = args.iters or (20 if device.type == "cuda" else 9)
        emit(bench_overhead(device, config_name, args.batches, args.cameras, args.chunk, iters, args.warmup), args.out)
    if args.which in ("overlap", "all"):
        for kind in args.policy:
            row = bench_overlap(
                kind,
                args.overlap_envs,
                args.overlap_chunk,
                args.steps,
                args.rounds,
                args.context,
                num_steps=args.overlap_k,
                ms_per_sample=args.ms_per_sample,
                group_counts=args.groups,
                serial=not args.no_serial,
                prefetch=not args.no_prefetch,
                check_equal=not args.no_check,
                device=device,
                config_name=args.config or ("base" if device.type == "cuda" else "tiny"),
                ms_host_per_call=args.ms_host_per_call,
            )
            emit([row], args.out)


if __name__ == "__main__":
    main()
