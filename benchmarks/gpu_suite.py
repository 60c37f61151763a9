"""Every GPU test and measurement of the project in one call (device time is scarce).

    python benchmarks/gpu_suite.py --out $OUT [--sections tests model policy rollout sync processor]

Each section runs in isolation (a failure is recorded and the suite goes on) and appends JSONL rows to
$OUT/gpu_results.jsonl; pytest output goes to $OUT/pytest_cuda.log. Commit the rows under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_policy import bench_case, env_row  # noqa: E402


def _emit(out: Path, row: dict) -> None:
    row = {**env_row(), **row}
    print(json.dumps(row), flush=True)
    with (out / "gpu_results.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


def section_tests(out: Path) -> None:
    """The CUDA-marked pytest tests (graph vs eager, adversarial buckets, aliasing, sync-free step, sync, prefetch)."""
    log = out / "pytest_cuda.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/policies",
           "tests/wrappers"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    log.write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    _emit(out, {"section": "tests", "returncode": proc.returncode, "summary": tail})


def section_model(out: Path) -> None:
    """Full-size pi05_base, random bf16 weights: eager sample_actions, 3 cameras, batch 1 and 8, per backend."""
    from policies.pi05.attention import AttentionConfig, flash_attn_available
    from policies.pi05.config import Pi05Config
    from policies.pi05.model import Pi05Model

    cfg = Pi05Config.pi05_base()
    with torch.device("cuda"):
        model = Pi05Model(cfg)
    model.set_precision(torch.bfloat16)
    for backend in ("eager", "sdpa", "flash"):
        if backend == "flash" and not flash_attn_available():
            _emit(out, {"section": "model", "backend": "flash", "status": "not run: flash-attn not installed"})
            continue
        model.attention_config = AttentionConfig(vision=backend, prefix=backend, expert=backend)
        plan = model.resolve_attention()
        for batch in (1, 8):
            images = torch.randint(0, 256, (batch, 3, 3, 224, 224), dtype=torch.uint8, device="cuda")
            mask = torch.ones(batch, 3, dtype=torch.bool, device="cuda")
            tokens = torch.randint(3, 30000, (batch, 200), device="cuda")
            tmask = torch.ones(batch, 200, dtype=torch.bool, device="cuda")
            noise = torch.randn(batch, 50, 32, device="cuda")
            for _ in range(2):
                model.sample_actions(images, mask, tokens, tmask, noise, 10)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                actions = model.sample_actions(images, mask, tokens, tmask, noise, 10)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            times.sort()
            _emit(out, {"section": "model", "mode": "eager sample_actions", "backend": backend, "plan": plan.report(),
                        "batch": batch, "cameras": 3, "prompt": 200, "K": 10, "H": 50, "p50_ms": times[len(times) // 2],
                        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
                        "finite": bool(torch.isfinite(actions).all())})
    _emit(out, {"section": "model", "sdpa_kernels": sdpa_kernels(model)})
    del model
    torch.cuda.empty_cache()


def sdpa_kernels(model) -> dict:
    """Which CUDA kernels SDPA actually launched per site (from the profiler's kernel names)."""
    from torch.profiler import ProfilerActivity, profile

    from policies.pi05.attention import AttentionConfig

    model.attention_config = AttentionConfig(vision="sdpa", prefix="sdpa", expert="sdpa")
    model.resolve_attention()
    images = torch.randint(0, 256, (1, 3, 3, 224, 224), dtype=torch.uint8, device="cuda")
    found = {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.sample_actions(images, torch.ones(1, 3, dtype=torch.bool, device="cuda"),
                             torch.randint(3, 300, (1, 200), device="cuda"),
                             torch.ones(1, 200, dtype=torch.bool, device="cuda"),
                             torch.randn(1, 50, 32, device="cuda"), 2)
    for evt in prof.key_averages():
        name = evt.key.lower()
        if any(k in name for k in ("flash", "fmha", "efficient", "attention", "cudnn")):
            found[evt.key[:120]] = evt.count
    return found


def section_policy(out: Path) -> None:
    """C8 sweeps: (a) 3 cameras / 200 tokens / K=10 / H=50 and (b) the LIBERO RL setting."""
    batches = [1, 2, 4, 8, 16, 32, 64, 128]
    bench_case("a", batches, out / "gpu_results.jsonl", method="ode", value_source="none", iters=10)
    bench_case("b", [1, 2, 4, 8, 16, 32, 40, 64, 128], out / "gpu_results.jsonl", method="ode", value_source="none",
               iters=10)


def section_rollout(out: Path) -> None:
    """Rollout (sde + prefix values) vs plain inference (ode, no values) at batch 8 and 64, both cases."""
    for case in ("a", "b"):
        bench_case(case, [8, 64], out / "gpu_results.jsonl", method="sde", value_source="prefix", iters=10)


def _randomize_on_gpu(model, seed: int = 0, std: float = 0.02, device: str = "cuda") -> None:
    """Seeded N(0, std) for every parameter, drawn on the GPU (zero-initialised adaRMS would switch the expert's
    residual branches off and hide any precision gap)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.empty(p.shape, device=device, dtype=torch.float32).normal_(0.0, std, generator=gen)
            p.copy_(noise.to(p.dtype))


def section_ratio(out: Path, device: str = "cuda", cfg=None, batch: int = 64) -> None:
    """Issue 5 on the GPU, LIBERO RL setting: update-0 log-ratio of the bf16 graph rollout against an eager trainer
    copy (bf16 and fp32), and graph vs eager rollout outputs."""
    from benchmarks.bench_policy import _Processor, make_inputs
    from policies.pi05.config import Pi05Config
    from policies.pi05.model import Pi05Model
    from policies.pi05.policy import Pi05Policy, RolloutConfig
    from policies.pi05.scheduler import SchedulerConfig

    cfg = cfg or Pi05Config.pi05_base(action_horizon=10, num_steps=5, value_source="prefix")
    proc = _Processor((0, 1), (48,))
    rollout_cfg = RolloutConfig(method="sde", num_steps=5, noise_level=0.5, action_chunk=5)
    sched = SchedulerConfig(max_batch_size=batch, batch_buckets=(batch,), prompt_buckets=(48,), num_steps=(5,),
                            camera_sets=((0, 1),))
    with torch.device(device):
        model = Pi05Model(cfg)
    _randomize_on_gpu(model, device=device)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.set_precision(torch.bfloat16)
    graph = Pi05Policy(model, proc, rollout_cfg, sched)
    x = make_inputs(batch, (0, 1), 48, cfg.vision.image_size, device)
    rollout = graph.act_inputs(x, seeds=torch.arange(batch, device=device))
    for dtype in (torch.bfloat16, torch.float32):
        with torch.device(device):
            trainer_model = Pi05Model(cfg)
        trainer_model.load_state_dict(state)
        trainer_model.set_precision(dtype)
        trainer = Pi05Policy(trainer_model, proc, rollout_cfg, replace_graphs(sched))
        if dtype == torch.bfloat16:
            eager = trainer.act_inputs(x, seeds=torch.arange(batch, device=device))
            _emit(out, {"section": "ratio", "check": "graph vs eager rollout (same bf16 model weights)",
                        "chains_max_abs_diff": float((eager.chains - rollout.chains).abs().max()),
                        "log_prob_max_abs_diff": float((eager.log_prob - rollout.log_prob).abs().max())})
        ev = trainer.evaluate(rollout)
        log_ratio = (ev.log_prob.detach() - rollout.log_prob).float()
        _emit(out, {"section": "ratio", "setting": "LIBERO RL (2 cams, 48 tok, K=5, H=10, C=5, A=7, sde a=0.5)",
                    "batch": batch, "trainer_dtype": str(dtype), "mean_abs_log_ratio": float(log_ratio.abs().mean()),
                    "max_abs_log_ratio": float(log_ratio.abs().max()),
                    "clip_fraction": float(((log_ratio.exp() - 1).abs() > 0.2).float().mean()),
                    "mean_abs_value_diff": float((ev.values.detach() - rollout.values).abs().mean())})
        del trainer, trainer_model
    del graph, model
    if device == "cuda":
        torch.cuda.empty_cache()


def replace_graphs(sched):
    """The same scheduler settings without CUDA graphs (the eager trainer copy)."""
    import dataclasses

    return dataclasses.replace(sched, cuda_graphs=False)


def section_startup(out: Path) -> None:
    """Start-up at full size: build, allocate and capture every declared graph (K in {5, 10}, 4 prompt
    buckets, 7 batch buckets, 3 cameras, prefix values), then peak memory of a batch-64 rollout."""
    from benchmarks.bench_policy import _Processor, make_inputs
    from policies.pi05.config import Pi05Config
    from policies.pi05.model import Pi05Model
    from policies.pi05.policy import Pi05Policy, RolloutConfig
    from policies.pi05.scheduler import SchedulerConfig

    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.device("cuda"):
        model = Pi05Model(Pi05Config.pi05_base(value_source="prefix"))
    model.set_precision(torch.bfloat16)
    built = time.perf_counter()
    sched = SchedulerConfig(max_batch_size=64, prompt_buckets=(16, 48, 112, 200), num_steps=(5, 10),
                            camera_sets=((0, 1, 2),))
    policy = Pi05Policy(model, _Processor((0, 1, 2), (16, 48, 112, 200)), RolloutConfig(num_steps=10), sched)
    torch.cuda.synchronize()
    ready = time.perf_counter()
    torch.cuda.reset_peak_memory_stats()
    x = make_inputs(64, (0, 1, 2), 200, 224, "cuda")
    policy.act_inputs(x)
    torch.cuda.synchronize()
    _emit(out, {"section": "startup", "build_s": built - start, "setup_capture_s": ready - built,
                "total_s": ready - start, "graphs": policy.scheduler.stats.captures,
                "batch_buckets": list(sched.batch_buckets), "prompt_buckets": list(sched.prompt_buckets),
                "num_steps": [5, 10], "peak_mem_gib_batch64_3cam": torch.cuda.max_memory_allocated() / 2**30,
                "note": "random weights built on the GPU (a checkpoint load adds the safetensors read)"})
    del policy, model
    torch.cuda.empty_cache()


def section_soak(out: Path) -> None:
    """5,000 full-size captured steps: memory flat after warm-up, no recapture."""
    try:
        from benchmarks import soak_gpu
    except ImportError as err:
        _emit(out, {"section": "soak", "status": f"not run: {err}"})
        return
    soak_gpu.run(out / "gpu_results.jsonl")


def section_policy_quick(out: Path) -> None:
    """A short re-measure at the current commit: case (a) batch 1 and 64, case (b) batch 8, 40 and 64."""
    bench_case("a", [1, 64], out / "gpu_results.jsonl", method="ode", value_source="none", iters=10)
    bench_case("b", [8, 40, 64], out / "gpu_results.jsonl", method="ode", value_source="none", iters=10)


def section_wrapper(out: Path) -> None:
    """Wrapper + processor overhead over the bare policy call at N = 8 and 64 (full size, 3 cameras)."""
    try:
        from benchmarks import bench_wrapper
    except ImportError as err:
        _emit(out, {"section": "wrapper", "status": f"not run: {err}"})
        return
    bench_wrapper.run(out / "gpu_results.jsonl", "cuda", cameras=(3,), iters=10)


def section_overlap(out: Path) -> None:
    """Env/policy overlap on the GPU: full-size PI0.5 (CUDA graphs) + Pusher-v5 rendered with EGL in subprocesses,
    G=1 vs G=2 vs G=2 with prefetch, with and without ``env_concurrency=1`` (needs mujoco and EGL on the machine;
    on 2+ GPUs the envs render on GPU 1)."""
    import os

    from benchmarks import bench_wrapper

    os.environ.setdefault("MUJOCO_GL", "egl")
    if torch.cuda.device_count() > 1:
        # render on the second GPU: EGL contexts of 16 env processes on the policy's GPU time-slice with its
        # CUDA graphs (measured: a 36 ms policy call took ~52 ms while the envs rendered on the same GPU)
        os.environ.setdefault("MUJOCO_EGL_DEVICE_ID", "1")
    # C=2 makes a group's env chunk (~40 ms for 8 envs at ~2.4 ms per EGL-rendered step on the H200 host) about
    # as long as its policy call (~35 ms); at C=10 the envs take 7x the policy and overlap can hide little.
    # PHYAI_OVERLAP_CHUNKS picks the chunk sizes (default "2,10"); C=2 steps are short, so it runs more of them
    chunks = [int(c) for c in os.environ.get("PHYAI_OVERLAP_CHUNKS", "2,10").split(",")]
    for chunk in chunks:
        steps = 12 if chunk <= 2 else 4
        # the full-size equivalence check (G=2 with and without prefetch vs G=1 on Pusher; ~40 s) runs at C=2
        # unless PHYAI_OVERLAP_CHECK_EQUAL=0
        check = chunk <= 2 and os.environ.get("PHYAI_OVERLAP_CHECK_EQUAL", "1") != "0"
        row = bench_wrapper.bench_overlap("pi05", 16, chunk, steps=steps, rounds=2, context="forkserver", num_steps=5,
                                          check_equal=check, device="cuda", config_name="base")
        bench_wrapper.emit([row], out / "gpu_results.jsonl")


def section_sync(out: Path) -> None:
    """Weight-sync benchmarks (in-process, pinned host)."""
    try:
        from benchmarks import bench_weight_sync
    except ImportError as err:
        _emit(out, {"section": "sync", "status": f"not run: {err}"})
        return
    bench_weight_sync.phase_times(out / "gpu_results.jsonl", "base")
    bench_weight_sync.run(out / "gpu_results.jsonl", "base")
    bench_weight_sync.profile_sync(out / "gpu_results.jsonl", "base", trace_dir=out)


def section_processor(out: Path) -> None:
    """Processor time for N = 8 and 64 with 3 cameras of 256x256 uint8."""
    try:
        from benchmarks import bench_processor
    except ImportError as err:
        _emit(out, {"section": "processor", "status": f"not run: {err}"})
        return
    bench_processor.run(out / "gpu_results.jsonl", device="cuda")


def section_profile(out: Path) -> None:
    """Per-kernel time of the prefix and denoise replays, by category (where the time goes)."""
    from benchmarks import profile_policy

    profile_policy.attention_crossover(out / "gpu_results.jsonl")
    profile_policy.run(out / "gpu_results.jsonl")


def section_broadcast(out: Path) -> None:
    """Rank 0 -> rank 1 weight broadcast against raw NCCL (needs 2 GPUs; torchrun in a subprocess): the default
    bucket size (with GPU-only chrome traces of one more broadcast per rank), 9 buckets of ~123 MB, and the
    default on a process group with high-priority NCCL streams."""
    if torch.cuda.device_count() < 2:
        _emit(out, {"section": "broadcast", "status": f"not run: {torch.cuda.device_count()} GPU(s), needs 2"})
        return
    results = str(out / "gpu_results.jsonl")
    runs = [
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "benchmarks/bench_broadcast.py",
         "--out", results, "--iters", "30", "--trace-dir", str(out), "--gpu-only-trace"],
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "benchmarks/bench_broadcast.py",
         "--out", results, "--iters", "30", "--buckets", "9"],
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "benchmarks/bench_broadcast.py",
         "--out", results, "--iters", "30", "--high-priority"],
    ]  # fmt: skip
    logs = []
    for cmd in runs:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        logs.append(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            break
    (out / "broadcast.log").write_text("\n".join(logs))
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}; see broadcast.log")


def section_batch_invariance(out: Path) -> None:
    """Same 16 observations, seeds and env ids: one batch-16 call vs two batch-8 calls (what G=1 and G=2 run).

    The initial noise of the chains must match bitwise (same per-env streams); the actions differ only by the
    batch-shape-dependent rounding of the replayed graphs (GEMM kernels are chosen per shape)."""
    import numpy as np

    from benchmarks import bench_wrapper

    rng = np.random.default_rng(0)
    n = 16
    obs = {
        "images": {"image": rng.integers(0, 256, (n, 224, 224, 3), dtype=np.uint8)},
        "state": rng.uniform(-1, 1, (n, 23)).astype(np.float32),
        "task": tuple(f"push the puck to goal {i}" for i in range(n)),
    }
    half = lambda lo, hi: {"images": {"image": obs["images"]["image"][lo:hi]}, "state": obs["state"][lo:hi],
                           "task": obs["task"][lo:hi]}  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a quick run of the code path
    for config_name in ("tiny", "base") if device.type == "cuda" else ("tiny",):
        policy = bench_wrapper.build_pi05(config_name, device, {"image": "base_0_rgb"}, [8, 16], 5, 10, 2,
                                          state_dim=23)  # fmt: skip
        full = policy.act(obs, seeds=list(range(n)), env_ids=list(range(n)), action_chunk=2)
        parts = [policy.act(half(lo, lo + 8), seeds=list(range(lo, lo + 8)), env_ids=list(range(lo, lo + 8)),
                            action_chunk=2) for lo in (0, 8)]  # fmt: skip
        cat = lambda name, parts=parts: torch.cat([getattr(p, name) for p in parts]).float()
        actions, chains = full.actions.float(), full.chains.float()
        _emit(out, {
            "section": "batch_invariance", "config": config_name, "dtype": str(policy.model.compute_dtype),
            "initial_noise_equal": bool(torch.equal(chains[:, 0], cat("chains")[:, 0])),
            "actions_max_abs_diff": float((actions - cat("actions")).abs().max()),
            "actions_max_abs": float(actions.abs().max()),
            "chain_max_abs_diff_per_step": [float(d) for d in (chains - cat("chains")).abs().amax((0, 2, 3))],
            "log_prob_max_abs_diff": float((full.log_prob.float() - cat("log_prob")).abs().max()),
        })  # fmt: skip
        policy.close()
        del policy
        if device.type == "cuda":
            torch.cuda.empty_cache()


SECTIONS = {
    "tests": section_tests,
    "model": section_model,
    "policy": section_policy,
    "rollout": section_rollout,
    "sync": section_sync,
    "startup": section_startup,
    "ratio": section_ratio,
    "policy_quick": section_policy_quick,
    "wrapper": section_wrapper,
    "soak": section_soak,
    "processor": section_processor,
    "profile": section_profile,
    "broadcast": section_broadcast,
    "overlap": section_overlap,
    "batch_invariance": section_batch_invariance,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.sections:
        start = time.perf_counter()
        try:
            SECTIONS[name](args.out)
            status = "ok"
        except Exception as err:  # noqa: BLE001 - record and go on
            status = f"failed: {type(err).__name__}: {err}"
            (args.out / f"error_{name}.txt").write_text(traceback.format_exc())
        _emit(args.out, {"section": name, "status": status, "seconds": round(time.perf_counter() - start, 1)})
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
