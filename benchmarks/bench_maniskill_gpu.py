"""ManiSkill3 on the GPU next to the full-size PI0.5 policy, end to end through `PolicyVectorEnv`.

Setting (RLinf's ManiSkill PI0.5 PPO): one camera (``base_camera`` at 224x224 -> ``base_0_rgb``), K = 4 flow-SDE
denoise steps (RLinf uses 4 for ManiSkill), C = 5 env steps per policy call, ``pd_ee_delta_pose`` (7 dims),
random ``pi05_base`` weights and the stand-in tokenizer (the state enters the prompt). One policy serves every N:
graphs are captured for the batch buckets 64, 128, 256 (N = 512 runs as two 256 replays) and the prompt buckets
that PickCube's prompts use.

Sections (``--which``, each in its own try/except, every row appended to ``--out`` as soon as it is measured):

* ``rollout`` -- for each N: ``make_maniskill_env(task, num_envs=N, sim_backend="gpu")``, warm-up steps, then
  timed ``PolicyVectorEnv.step()`` calls. The policy's ``act`` and ``value`` and the env's ``step``/``reset`` are
  timed separately (CUDA-synchronised around each call), so each row gives env-steps/s and the split
  (``policy_ms_p50`` = act, ``value_ms_p50`` = the critic on the final observations, ``env_ms_p50`` = the C
  simulator sub-steps and the partial resets of one wrapper step). Rows ``{"bench": "maniskill_gpu_rollout"}``.
* ``proof`` -- that observations stay on the device: a torch.profiler trace of one wrapper step, counting the
  host<->device memcpys and their sizes (none may be image-sized, S*S*3 bytes), the number of host syncs in that
  step (``torch.cuda.set_sync_debug_mode("warn")``; they are N-sized bools/ids, not images), and the device of
  ``obs["images"]["image"]``. Row ``{"bench": "maniskill_gpu_device_proof"}``.
* ``overlap`` -- at N = 256: one env (G = 1) vs two envs of 128 (G = 2) and G = 2 with prefetch, on the same GPU.
  Row ``{"bench": "maniskill_gpu_overlap"}``.
* ``ppo`` -- ``examples/ppo_pi05.py --env PickCube-v1 --config base --device cuda --num-envs 64`` for 3 iterations
  (one epoch, two minibatches: the point is that it runs, with finite losses and a weight sync per iteration).
  Row ``{"bench": "maniskill_gpu_ppo"}`` with the per-iteration split.

``sim_backend="gpu"`` needs SAPIEN's PhysX GPU library (``~/.sapien/physx/<version>/libPhysXGpu_64.so``, which
SAPIEN downloads from GitHub on first use). Without it, ``--sim-backend cpu`` measures CPU PhysX in AsyncVectorEnv
subprocesses (N > 4) with SAPIEN still rendering on the GPU; its rows are ``maniskill_cpusim_rollout``.

    python benchmarks/bench_maniskill_gpu.py --out maniskill.jsonl                      # GPU, the full sweep
    python benchmarks/bench_maniskill_gpu.py --which ppo --out maniskill.jsonl          # the PPO run
    python benchmarks/bench_maniskill_gpu.py --config tiny --device cpu --sim-backend cpu --num-envs 2 \\
        --steps 2 --warmup 1 --image-size 64 --which rollout --out /tmp/ms.jsonl            # CPU smoke run
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ROOT, environment  # noqa: E402
from policies.pi05.config import Pi05Config  # noqa: E402
from policies.pi05.policy import Pi05Policy, RolloutConfig  # noqa: E402
from policies.pi05.processor import Pi05Processor  # noqa: E402
from policies.pi05.prompt import DEFAULT_BUCKETS  # noqa: E402
from policies.pi05.scheduler import SchedulerConfig  # noqa: E402
from wrappers import PolicyVectorEnv  # noqa: E402

SECTIONS = ("rollout", "proof", "overlap", "ppo")
CAMERA_MAP = {"image": "base_0_rgb"}


def _emit(out: Path, row: dict) -> None:
    row = {**environment(), **row}
    print(json.dumps(row), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as handle:
        handle.write(json.dumps(row) + "\n")


def _p50(samples: Sequence[float]) -> float | None:
    return round(statistics.median(samples), 3) if samples else None


class CallTimer:
    """Times the calls of chosen bound methods (synchronising the device around each), grouped by key.

    Example:
        >>> timer = CallTimer(torch.device("cpu"))
        >>> class Box:
        ...     def go(self):
        ...         return 1
        >>> box = Box()
        >>> timer.wrap(box, "go", "go")
        >>> box.go(), len(timer.step_ms["go"])
        (1, 1)
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.step_ms: dict[str, list[float]] = {}
        """key -> milliseconds of each call since the last `take`."""

    def sync(self) -> None:
        """Waits for the device (CUDA only)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, obj: Any, name: str, key: str) -> None:
        """Replaces ``obj.name`` (an instance attribute shadowing the method) with a timed call."""
        inner: Callable[..., Any] = getattr(obj, name)
        self.step_ms.setdefault(key, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.sync()
                self.step_ms[key].append((time.perf_counter() - start) * 1e3)

        setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        """Per key, the total milliseconds since the last take; clears them."""
        totals = {key: sum(values) for key, values in self.step_ms.items()}
        for values in self.step_ms.values():
            values.clear()
        return totals


def make_sim(args: argparse.Namespace, num_envs: int) -> Any:
    """The freezable ManiSkill vector env of the benchmark."""
    from wrappers.adapters.maniskill import make_maniskill_env

    extra = {"vectorization": "async"} if args.sim_backend == "cpu" and num_envs > 4 else {}
    return make_maniskill_env(
        args.task, num_envs=num_envs, sim_backend=args.sim_backend, image_size=args.image_size,
        control_mode="pd_ee_delta_pose", **extra,
    )  # fmt: skip


def _prompt_buckets(config: Pi05Config, probe_obs: dict, device: str) -> tuple[int, ...]:
    """The three smallest default prompt buckets that hold the probe's prompts (fewer graphs to capture)."""
    from phyai_gym.make import standin_tokenizer

    processor = Pi05Processor.for_config(
        config, action_dim=7, device=device, tokenizer=standin_tokenizer(), camera_map=CAMERA_MAP,
        norm_mode="identity",
    )  # fmt: skip
    longest = int(processor(probe_obs).lengths.max())
    fitting = [b for b in DEFAULT_BUCKETS if b >= longest and b <= config.max_token_len]
    return tuple(fitting[:3]) or (config.max_token_len,)


def build_policy(args: argparse.Namespace, probe_obs: dict) -> tuple[Pi05Policy, float]:
    """The benchmark's policy (random weights) with graphs for the batch buckets of every N; build seconds."""
    from phyai_gym.make import standin_tokenizer

    start = time.perf_counter()
    config = Pi05Config.pi05_base() if args.config == "base" else Pi05Config.tiny(max_token_len=128)
    buckets = _prompt_buckets(config, probe_obs, args.device)
    processor = Pi05Processor.for_config(
        config, action_dim=7, device=args.device, tokenizer=standin_tokenizer(), camera_map=CAMERA_MAP,
        norm_mode="identity", prompt_buckets=buckets,
    )  # fmt: skip
    largest = min(max(args.num_envs), args.max_batch_size)
    sizes = {min(n, largest) for n in args.num_envs} | {min(n // 2, largest) for n in args.num_envs if n >= 2}
    scheduler = SchedulerConfig(
        max_batch_size=largest,
        batch_buckets=tuple(sorted(sizes | {largest})),
        num_steps=(args.denoise_steps,),
        camera_sets=(tuple(processor.slots),),
        prompt_buckets=processor.prompt_buckets,
        cuda_graphs=args.device.startswith("cuda"),
    )
    rollout = RolloutConfig(method="sde", num_steps=args.denoise_steps, action_chunk=args.chunk)
    policy = Pi05Policy.from_config(config, processor, device=args.device, seed=0, rollout=rollout, scheduler=scheduler)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return policy, time.perf_counter() - start


def _timed_steps(venv: PolicyVectorEnv, timer: CallTimer, steps: int) -> tuple[list[dict[str, float]], float]:
    """`steps` wrapper steps; per step the timer's split and the wall ms; the total wall seconds."""
    split = []
    timer.take()
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        venv.step()
        timer.sync()
        split.append({**timer.take(), "wall": (time.perf_counter() - t0) * 1e3})
    return split, time.perf_counter() - start


def _instrument(sims: Sequence[Any], policy: Pi05Policy, timer: CallTimer) -> None:
    for sim in sims:
        timer.wrap(sim, "step", "env")
        timer.wrap(sim, "reset", "env")
    timer.wrap(policy, "act", "act")
    timer.wrap(policy, "value", "value")


def _restore(objs: Sequence[Any], names: Sequence[str] = ("step", "reset", "act", "value")) -> None:
    for obj in objs:
        for name in names:
            if name in vars(obj):
                delattr(obj, name)


def _rollout_row(args: argparse.Namespace, n: int, split: list[dict[str, float]], wall_s: float, **extra: Any) -> dict:
    col = lambda key: [s.get(key, 0.0) for s in split]  # noqa: E731
    return {
        "bench": "maniskill_gpu_rollout" if args.sim_backend == "gpu" else "maniskill_cpusim_rollout",
        "config": args.config, "task": args.task, "num_envs": n,
        "chunk": args.chunk, "cameras": 1, "num_steps": args.denoise_steps, "image_size": args.image_size,
        "sim_backend": args.sim_backend, "timed_steps": len(split),
        "env_steps_per_s": round(n * args.chunk * len(split) / wall_s, 1),
        "policy_ms_p50": _p50(col("act")), "value_ms_p50": _p50(col("value")), "env_ms_p50": _p50(col("env")),
        "wrapper_ms_p50": _p50(col("wall")),
        "other_ms_p50": _p50([s["wall"] - s.get("act", 0) - s.get("value", 0) - s.get("env", 0) for s in split]),
        **extra,
    }  # fmt: skip


def _memcpy_summary(trace_file: Path) -> dict[str, dict[str, int]]:
    """Count and bytes (largest, total) of the host<->device memcpys in a chrome trace."""
    events = json.loads(trace_file.read_text()).get("traceEvents", [])
    summary: dict[str, dict[str, int]] = {}
    for event in events:
        name = str(event.get("name", ""))
        if event.get("cat") != "gpu_memcpy" and not name.startswith("Memcpy"):
            continue
        kind = next((k for k in ("HtoD", "DtoH", "DtoD", "HtoH") if k in name), "other")
        size = int((event.get("args") or {}).get("bytes", -1))
        entry = summary.setdefault(kind, {"count": 0, "max_bytes": 0, "total_bytes": 0})
        entry["count"] += 1
        entry["max_bytes"] = max(entry["max_bytes"], size)
        entry["total_bytes"] += max(size, 0)
    return summary


def device_proof(args: argparse.Namespace, venv: PolicyVectorEnv, n: int) -> dict:
    """Profiles one wrapper step: host<->device copies (none image-sized) and host syncs."""
    obs, *_ = venv.step()
    image = obs["images"]["image"]
    image_bytes = args.image_size * args.image_size * 3
    row: dict[str, Any] = {
        "bench": "maniskill_gpu_device_proof", "task": args.task, "num_envs": n, "config": args.config,
        "image_device": str(image.device) if isinstance(image, torch.Tensor) else type(image).__name__,
        "state_device": str(obs["state"].device) if isinstance(obs["state"], torch.Tensor) else "numpy",
        "image_bytes": image_bytes, "method": "torch.profiler memcpy count + set_sync_debug_mode('warn')",
    }  # fmt: skip
    if not torch.cuda.is_available():
        return {**row, "skipped": "no CUDA"}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        venv.step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        memcpy = _memcpy_summary(trace)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            venv.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    host_copies = [memcpy.get(k, {}) for k in ("HtoD", "DtoH")]
    largest = max([c.get("max_bytes", 0) for c in host_copies] + [0])
    return {
        **row,
        "memcpy": memcpy,
        "largest_host_copy_bytes": largest,
        "host_syncs_per_step": len(syncs),
        "sync_sites": sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})[:20],
        "on_device": row["image_device"].startswith("cuda") and largest < image_bytes,
    }


def _proof(args: argparse.Namespace, out: Path, venv: PolicyVectorEnv, n: int) -> None:
    _emit(out, device_proof(args, venv, n))


def section_rollout(args: argparse.Namespace, out: Path) -> None:
    """The N sweep, then the device proof (first N) and the overlap (its env kept open from the sweep)."""
    policy = None
    kept: tuple[PolicyVectorEnv, Any] | None = None  # the overlap's G = 1 env, run after the sweep
    for n in args.num_envs:
        sim = venv = None
        try:
            sim = make_sim(args, n)
            obs, _ = sim.reset(seed=0)
            if policy is None:
                policy, build_s = build_policy(args, obs)
                _emit(
                    out,
                    {
                        "bench": "maniskill_gpu_policy_build",
                        "config": args.config,
                        "build_s": round(build_s, 1),
                        "graph_captures": getattr(getattr(policy.scheduler, "stats", None), "captures", None),
                    },
                )
            venv = PolicyVectorEnv(sim, policy, action_chunk=args.chunk)
            venv.reset(seed=0)
            for _ in range(args.warmup):
                venv.step()
            timer = CallTimer(torch.device(args.device))
            _instrument([sim], policy, timer)
            try:
                split, wall_s = _timed_steps(venv, timer, args.steps)
            finally:
                _restore([sim, policy])
            peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
            _emit(out, _rollout_row(args, n, split, wall_s, peak_mem_gib=peak and round(peak, 2)))
            if "proof" in args.which and n == args.num_envs[0]:
                _section(out, "proof", functools.partial(_proof, args, out, venv, n))
            if "overlap" in args.which and n == args.overlap_envs:
                kept, venv, sim = (venv, sim), None, None
        except Exception as err:  # noqa: BLE001  (a failed N must not lose the others)
            _failed(out, f"rollout N={n}", err)
        finally:
            if venv is not None:
                venv.close()
            elif sim is not None:
                sim.close()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if kept is not None:
        _section(out, "overlap", functools.partial(section_overlap, args, out, policy, *kept))
        kept[0].close()
    if policy is not None:
        policy.close()


def section_overlap(args: argparse.Namespace, out: Path, policy: Pi05Policy, g1: PolicyVectorEnv, g1_sim: Any) -> None:
    """G = 1 (the sweep's env) vs G = 2 envs of N/2, without and with prefetch, interleaved in rounds."""
    n = g1.num_envs
    halves = [make_sim(args, n // 2) for _ in range(2)]
    variants = {
        "G1": (g1, [g1_sim]),
        "G2": (PolicyVectorEnv(halves, policy, action_chunk=args.chunk), halves),
        "G2_prefetch": (PolicyVectorEnv(halves, policy, action_chunk=args.chunk, prefetch=True), halves),
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    splits: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    timer = CallTimer(torch.device(args.device))
    try:
        for _ in range(args.rounds):
            for name, (venv, sims) in variants.items():
                venv.reset(seed=0)  # G2 and G2_prefetch share their two envs: each block starts from a reset
                venv.step()
                _instrument(sims, policy, timer)
                try:
                    split, wall_s = _timed_steps(venv, timer, args.overlap_steps)
                finally:
                    _restore([*sims, policy])
                results[name].append(n * args.chunk * len(split) / wall_s)
                splits[name] += split
        rates = {name: round(statistics.mean(r), 1) for name, r in results.items()}
        _emit(out, {
            "bench": "maniskill_gpu_overlap", "task": args.task, "num_envs": n, "config": args.config,
            "chunk": args.chunk, "num_steps": args.denoise_steps,
            "env_steps_per_s": rates, "rounds": {k: [round(x, 1) for x in v] for k, v in results.items()},
            "policy_ms_p50": {k: _p50([s.get("act", 0) for s in v]) for k, v in splits.items()},
            "env_ms_p50": {k: _p50([s.get("env", 0) for s in v]) for k, v in splits.items()},
            "speedup": {k: round(rates[k] / rates["G1"], 3) for k in rates if k != "G1"},
        })  # fmt: skip
    finally:
        for name in ("G2", "G2_prefetch"):  # the second close of the shared envs may refuse
            try:
                variants[name][0].close()
            except Exception as err:  # noqa: BLE001
                print(f"overlap: closing {name}: {err}", flush=True)


def section_ppo(args: argparse.Namespace, out: Path) -> None:
    """examples/ppo_pi05.py on the task for `args.ppo_iterations` iterations, in this process; one row."""
    import runpy

    csv_path = Path(args.ppo_csv or tempfile.mkstemp(suffix=".csv")[1])
    argv = [
        "--env", args.task, "--config", args.config, "--device", args.device, "--num-envs", str(args.ppo_envs),
        "--total-iterations", str(args.ppo_iterations), "--num-steps", "2", "--update-epochs", "1",
        "--num-minibatches", "2", "--action-chunk", str(args.chunk), "--denoise-steps", str(args.denoise_steps),
        "--eval-episodes", "0", "--csv", str(csv_path),
    ]  # fmt: skip
    start = time.perf_counter()
    error = None
    try:
        example = runpy.run_path(str(ROOT / "examples" / "ppo_pi05.py"))
        example["train"](example["parse_args"](argv))
    except Exception as err:  # noqa: BLE001  (the row records the failure)
        error = f"{type(err).__name__}: {err}"[:1500]
    wall_s = time.perf_counter() - start
    rows = list(csv.DictReader(csv_path.open())) if csv_path.is_file() and csv_path.stat().st_size else []
    keys = ("pg_loss", "v_loss", "approx_kl", "clipfrac", "time_rollout", "time_train", "time_sync", "sps")
    iterations = [
        {"iteration": int(r["iteration"]), "weight_version": int(r["weight_version"]),
         **{k: round(float(r[k]), 5) for k in keys if k in r}}
        for r in rows
    ]  # fmt: skip
    finite = bool(iterations) and all(
        math.isfinite(it[k]) for it in iterations for k in ("pg_loss", "v_loss", "approx_kl") if k in it
    )
    versions = [it["weight_version"] for it in iterations]
    _emit(out, {
        "bench": "maniskill_gpu_ppo", "config": args.config, "task": args.task, "num_envs": args.ppo_envs,
        "chunk": args.chunk, "num_steps": args.denoise_steps, "iterations": len(iterations), "finite": finite,
        "weight_synced": versions == list(range(versions[0], versions[0] + len(versions))) if versions else False,
        "per_iteration": iterations, "wall_s": round(wall_s, 1), "command": " ".join(argv),
        **({"error": error} if error else {}),
    })  # fmt: skip


def _failed(out: Path, what: str, err: BaseException) -> None:
    traceback.print_exc()
    _emit(out, {"bench": "maniskill_gpu_error", "section": what, "error": f"{type(err).__name__}: {err}"[:2000]})


def _section(out: Path, name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001  (one failed section must not lose the others)
        _failed(out, name, err)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (see the module docstring)."""
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSONL file the rows are appended to")
    parser.add_argument("--which", nargs="+", default=["rollout", "proof", "overlap"], choices=SECTIONS)
    parser.add_argument("--task", default="PickCube-v1")
    parser.add_argument("--config", default="base", choices=("base", "tiny"))
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--sim-backend", default="gpu" if cuda else "cpu", choices=("gpu", "cpu"))
    parser.add_argument("--num-envs", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--max-batch-size", type=int, default=256, help="largest captured batch (N above it splits)")
    parser.add_argument("--denoise-steps", type=int, default=4, help="K")
    parser.add_argument("--chunk", type=int, default=5, help="C, env steps per policy call")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=2, help="untimed wrapper steps per N")
    parser.add_argument("--steps", type=int, default=6, help="timed wrapper steps per N")
    parser.add_argument("--overlap-envs", type=int, default=256, help="N of the overlap section")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the overlap section")
    parser.add_argument("--overlap-steps", type=int, default=4, help="timed wrapper steps per overlap block")
    parser.add_argument("--ppo-envs", type=int, default=64)
    parser.add_argument("--ppo-iterations", type=int, default=3)
    parser.add_argument("--ppo-timeout", type=float, default=160.0)
    parser.add_argument("--ppo-csv", default=None, help="where the PPO run writes its curve CSV")
    args = parser.parse_args(argv)
    if args.sim_backend == "cpu" and not cuda and max(args.num_envs) > 4:
        parser.error(
            f"--num-envs: the CPU simulator runs one process-less env per sub-env; use <= 4, got {args.num_envs}"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    """Runs the chosen sections."""
    args = parse_args(argv)
    if "rollout" in args.which:
        _section(args.out, "rollout", lambda: section_rollout(args, args.out))
    if "ppo" in args.which:
        _section(args.out, "ppo", lambda: section_ppo(args, args.out))


if __name__ == "__main__":
    main()
