"""Policy throughput and latency (DESIGN C8): `act()` from host canonical observations, model-only time,
per-stage times (prefix = vision + LM, denoise = K expert steps), achieved TFLOP/s against the C8 FLOP count,
peak memory and start-up (load + allocate + capture).

    python -m benchmarks.bench_policy --case a --batches 1 8 64          # on a GPU; rows -> results/policy.jsonl

`run(out)` is the `policy` section of `gpu_suite.py` (both C8 sweeps), `run_rollout(out)` the `rollout` section
(sde + prefix values at batch 8 and 64), `run_quick(out)` the `policy_quick` section and `run_public(out)` the
`public` section (the public act() against the harness's call on the same policy, rows of kind ``public``).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from benchmarks.common import CASES, build_case_policy, make_inputs, percentiles, write_rows
from benchmarks.flops import pi05_flops
from policies.base import RolloutConfig
from policies.pi05.config import Pi05Config
from policies.pi05.inputs import ModelInputs
from policies.pi05.policy import Pi05Policy

BENCH = "policy"


def time_stages(policy: Pi05Policy, inputs: ModelInputs, opts: RolloutConfig, iters: int) -> dict:
    """CUDA-event timing of the prefix and denoise replays and of the whole model call."""
    sched = policy.scheduler
    n = inputs.batch_size
    b = sched.bucket_for(n)
    length = sched.prompt_bucket_for(inputs.tokens.shape[1])
    cams = tuple(inputs.slots)
    seeds = torch.arange(n, device=policy.device)
    prefix_ms, denoise_ms, model_ms = [], [], []
    for _ in range(iters):
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        sched._load(inputs, seeds, seeds * 0, opts, b, length)
        e0.record()
        sched._run_prefix(b, length, cams)
        e1.record()
        sched._run_denoise(b, length, cams, opts.num_steps)
        e2.record()
        torch.cuda.synchronize()
        prefix_ms.append(e0.elapsed_time(e1))
        denoise_ms.append(e1.elapsed_time(e2))
        model_ms.append(e0.elapsed_time(e2))
    return {
        "prefix_ms_p50": percentiles(prefix_ms)[0],
        "denoise_ms_p50": percentiles(denoise_ms)[0],
        "model_ms_p50": percentiles(model_ms)[0],
    }


def bench_case(name: str, batches, out: Path | None, method: str = "ode", value_source: str = "none",
               warmup: int = 3, iters: int = 20, fused_kernels: bool = True) -> list[dict]:
    """Sweep `batches` for case `name` ("a" or "b"); appends rows to `out` (a folder, or None for results/).

    `fused_kernels`: `SchedulerConfig.fused_kernels` (recorded in the rows, with ``attention``, the resolved attention
    plan). ``h2d_ms_p50`` times the inputs' host -> device copy alone
    (pageable host memory, as the timed calls use), ``h2d_pinned_ms_p50`` the same from pinned memory.
    """
    case = CASES[name]
    config = Pi05Config.pi05_base()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    policy: Pi05Policy = build_case_policy(case, batches, method, value_source, fused_kernels)
    torch.cuda.synchronize()
    startup = time.perf_counter() - start
    rows = []
    flops = pi05_flops(policy.config, num_cameras=len(case["cams"]), prompt_len=case["prompt"],
                       num_steps=case["num_steps"], horizon=case["horizon"], value_source=value_source)["total"]
    for n in batches:
        inputs = make_inputs(n, case["cams"], case["prompt"], config.vision.image_size, policy.device)
        host_inputs = inputs.to("cpu")
        opts = policy.sampling_options(deterministic=method == "ode")
        for _ in range(warmup):
            policy.act_inputs(host_inputs.to(policy.device), deterministic=method == "ode").actions.cpu()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        lat = []
        for _ in range(iters):
            t0 = time.perf_counter()
            out_ = policy.act_inputs(host_inputs.to(policy.device), deterministic=method == "ode")
            out_.actions.cpu()  # the final action transfer a numpy env needs
            lat.append((time.perf_counter() - t0) * 1e3)
        p50, p90 = percentiles(lat)
        stages = time_stages(policy, inputs, opts, iters)
        pinned = replace(host_inputs, **{f.name: getattr(host_inputs, f.name).pin_memory() for f in fields(host_inputs)
                                         if isinstance(getattr(host_inputs, f.name), torch.Tensor)})
        copies = {}
        for key, src in (("h2d_ms_p50", host_inputs), ("h2d_pinned_ms_p50", pinned)):
            times = []
            for _ in range(iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                src.to(policy.device)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            copies[key] = percentiles(times)[0]
        row = {
            "case": name, **{k: (list(v) if isinstance(v, tuple) else v) for k, v in case.items()},
            "method": method, "value_source": value_source, "batch": n, "dtype": config.dtype,
            "fused_kernels": fused_kernels,
            "p50_ms": p50, "p90_ms": p90, "samples_per_s": n / (p50 / 1e3), **stages,
            "model_samples_per_s": n / (stages["model_ms_p50"] / 1e3),
            "tflop_per_sample": flops / 1e12, "achieved_tflops": flops * n / (stages["model_ms_p50"] / 1e3) / 1e12,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "startup_s": startup, "graph_captures": policy.scheduler.stats.captures,
            "input_path": "processed uint8 inputs on host -> device (processor timed separately)", **copies,
            "attention": policy.model.plan.report(),
        }
        rows += write_rows(BENCH, [row], out)
    del policy
    torch.cuda.empty_cache()
    return rows


def run(out: Path | None = None) -> None:
    """C8 sweeps: (a) 3 cameras / 200 tokens / K=10 / H=50 and (b) the LIBERO RL setting, plain inference."""
    bench_case("a", [1, 2, 4, 8, 16, 32, 64, 128], out, iters=10)
    bench_case("b", [1, 2, 4, 8, 16, 32, 40, 64, 128], out, iters=10)


def run_rollout(out: Path | None = None) -> None:
    """Rollout (sde + prefix values) at batch 8 and 64 in both cases, to hold against plain inference."""
    for case in ("a", "b"):
        bench_case(case, [8, 64], out, method="sde", value_source="prefix", iters=10)


def run_targets(out: Path | None = None) -> None:
    """The speed targets' rows: case (a) batch 1 and 64, case (b) batch 64, and the same work as phyai (1, 32)."""
    bench_case("a", [1, 64], out, iters=10)
    bench_case("b", [64], out, iters=10)
    bench_case("phyai", [1, 32], out, iters=10)


def run_public(out: Path | None = None, cases=("a", "phyai"), batches=(1, 64), iters: int = 20) -> list[dict]:
    """`act()` through the public API (`make_policy`, uint8 256 x 256 numpy images, a task string, actions back on
    the host) against the harness's call on the same policy in the same run: `act_inputs` on the already processed
    device inputs of the same observations, actions back on the host. The two are timed alternately; the difference
    is the host path (resize, normalise, tokenise, copies). One ``kind: public`` row per case and batch."""
    import numpy as np

    from phyai_gym.make import make_policy

    slots = {"image": "base_0_rgb", "wrist": "left_wrist_0_rgb", "right": "right_wrist_0_rgb"}
    rows = []
    for name in cases:
        case = CASES[name]
        cams = dict(list(slots.items())[: len(case["cams"])])
        config = Pi05Config.pi05_base(action_horizon=case["horizon"], num_steps=case["num_steps"])
        rollout = RolloutConfig(num_steps=case["num_steps"], action_chunk=case["chunk"])
        policy = make_policy(
            config=config, device="cuda", camera_map=cams, max_batch_size=max(batches), rollout=rollout
        )
        rng = np.random.default_rng(0)
        words, task, length = "pick up the red cube and place it in the basket".split(), "pick", 0
        while length < case["prompt"]:  # the longest task whose prompt (state included) fits the case's length
            longer = f"{task} {words[len(task.split()) % len(words)]}"
            probe = {"images": {c: np.zeros((1, 8, 8, 3), np.uint8) for c in cams},
                     "state": np.zeros((1, 8), np.float32), "task": [longer]}  # fmt: skip
            grown = int(policy.processor(probe).lengths[0])
            if grown > case["prompt"] or grown == length:  # too long, or truncated at max_token_len
                break
            task, length = longer, grown
        for n in batches:
            obs = {"images": {c: rng.integers(0, 256, (n, 256, 256, 3), dtype=np.uint8) for c in cams},
                   "state": rng.standard_normal((n, 8)).astype(np.float32), "task": [task] * n}  # fmt: skip
            inputs = policy.processor(obs)
            public, harness, processor = [], [], []
            for i in range(iters + 3):
                calls = ((policy.act, obs, public), (policy.act_inputs, inputs, harness))
                for fn, arg, times in calls:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn(arg).actions.cpu()
                    if i >= 3:
                        times.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                policy.processor(obs)
                torch.cuda.synchronize()
                processor.append((time.perf_counter() - t0) * 1e3)
            pub, har = percentiles(public)[0], percentiles(harness)[0]
            rows += write_rows(BENCH, [{
                "kind": "public", "case": name, "batch": n, "prompt_tokens": int(inputs.tokens.shape[1]),
                "image_size_in": 256, "public_ms_p50": pub, "harness_ms_p50": har, "host_ms": pub - har,
                "public_over_harness": pub / har,
                "processor_ms_p50": percentiles(processor[3:])[0], "public_samples_per_s": n / (pub / 1e3),
                "attention": policy.model.plan.report(),
            }], out)  # fmt: skip
        policy.close()
        del policy
        torch.cuda.empty_cache()
    return rows


def run_quick(out: Path | None = None) -> None:
    """A short re-measure: case (a) batch 1 and 64, case (b) batch 8, 40 and 64."""
    bench_case("a", [1, 64], out, iters=10)
    bench_case("b", [8, 40, 64], out, iters=10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), default="a")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--method", default="ode")
    parser.add_argument("--value-source", default="none")
    parser.add_argument("--out", type=Path, default=None, help="folder for policy.jsonl (default: benchmarks/results)")
    args = parser.parse_args()
    bench_case(args.case, args.batches, args.out, args.method, args.value_source)
