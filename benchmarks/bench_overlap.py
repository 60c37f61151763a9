"""Env stepping overlapped with inference (env groups; DESIGN target >= 1.6x when both take similar time).

Pusher-v5 rendered at 224x224 in AsyncVectorEnv subprocesses, ``groups=1`` vs ``groups=2`` (within-step overlap),
``groups=2, prefetch=True`` (cross-step prefetch: a group's policy call for the next step starts as soon as its
chunk is done) and ``groups=2`` with the thread pool disabled (the same groups run one after the other), with the
same total N, interleaved in rounds. Reports env-steps/s, the policy-busy fraction (time inside ``policy.act`` /
wall time), the env and policy time per chunk measured alone, and the speedup. Two policies: the tiny PI0.5 (CPU
compute in the main process) and an "accelerator-emulating" policy that waits ``ms_per_sample * n`` without
using the CPU (as the host does while a GPU computes), then returns Gaussian actions. It also checks that
``groups=2`` (with and without prefetch) returns the same rewards, states, images and actions as ``groups=1``
for the same seeds. Needs mujoco and EGL (or OSMesa).

    MUJOCO_GL=egl python -m benchmarks.bench_overlap --policy emulated --out DIR     # rows -> wrapper_overlap.jsonl

`run(out)` is the `overlap` section of `gpu_suite.py`: full-size PI0.5 with CUDA graphs, 16 envs, renders on the
second GPU when there are two.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from benchmarks.common import build_pi05, percentiles, write_rows
from policies.base import PolicyOutput
from policies.baseline import GaussianPolicy
from wrappers.freeze import make_freezable_vector_env, set_read_every
from wrappers.policy_vector_env import PolicyVectorEnv

BENCH = "wrapper_overlap"
ACTION_DIM = 7


class TimedPolicy:
    """Forwards to a policy and accumulates the time it is busy in ``act``/``value``.

    On CPU: the host time inside the call. On CUDA, without synchronizing (a device-wide sync here would hold
    the caller until every queued call finished, and so change the schedule it measures): in each call the larger
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
    """Env time per chunk (C steps of one group's async vector env) and policy time of one call, each alone."""
    venv = groups[0]
    n = venv.num_envs
    set_read_every(venv, chunk)  # as inside PolicyVectorEnv: render only the chunk's last sub-step
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
        "env_chunk_ms_per_group_p50": round(percentiles(env_ms[1:])[0], 2),
        "policy_ms_per_group_call_p50": round(percentiles(pol_ms[1:])[0], 2),
        "policy_ms_all_envs_p50": round(percentiles(pol_all_ms[1:])[0], 2),
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
    alone["env_chunk_ms_all_envs_p50"] = round(percentiles(env_all[1:])[0], 2)

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
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{os.cpu_count()}",
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
            "gymnasium": gym.__version__,
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


def run(out: Path | None = None) -> list[dict[str, Any]]:
    """Full-size PI0.5 (CUDA graphs) + 16 Pusher-v5 envs rendered with EGL in forkserver subprocesses, G=1 vs G=2
    vs G=2 with prefetch, with and without ``env_concurrency=1``; one row per chunk size C.

    On 2+ GPUs the envs render on GPU 1: EGL contexts of 16 env processes on the policy's GPU time-slice with its
    CUDA graphs. C=2 makes a group's env chunk about as long as its policy call; at C=10 the envs take several
    times the policy and overlap can hide little. ``PHYAI_OVERLAP_CHUNKS`` picks the chunk sizes (default "2,10");
    the full-size equivalence check runs at C=2 unless ``PHYAI_OVERLAP_CHECK_EQUAL=0``.
    """
    os.environ.setdefault("MUJOCO_GL", "egl")
    if torch.cuda.device_count() > 1:
        os.environ.setdefault("MUJOCO_EGL_DEVICE_ID", "1")
    rows = []
    for chunk in [int(c) for c in os.environ.get("PHYAI_OVERLAP_CHUNKS", "2,10").split(",")]:
        check = chunk <= 2 and os.environ.get("PHYAI_OVERLAP_CHECK_EQUAL", "1") != "0"
        row = bench_overlap("pi05", 16, chunk, steps=12 if chunk <= 2 else 4, rounds=2, context="forkserver",
                            num_steps=5, check_equal=check, device="cuda", config_name="base")  # fmt: skip
        rows += write_rows(BENCH, [row], out)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for wrapper_overlap.jsonl (default: results/)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", choices=["tiny", "base"], default=None, help="default: tiny on CPU, base on CUDA")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (1: no OpenMP contention)")
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
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    for kind in args.policy:
        row = bench_overlap(
            kind, args.overlap_envs, args.overlap_chunk, args.steps, args.rounds, args.context,
            num_steps=args.overlap_k, ms_per_sample=args.ms_per_sample, group_counts=args.groups,
            serial=not args.no_serial, prefetch=not args.no_prefetch, check_equal=not args.no_check, device=device,
            config_name=args.config or ("base" if device.type == "cuda" else "tiny"),
            ms_host_per_call=args.ms_host_per_call,
        )  # fmt: skip
        write_rows(BENCH, [row], args.out)


if __name__ == "__main__":
    main()
