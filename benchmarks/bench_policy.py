"""Policy throughput and latency (DESIGN C8): `act()` from host canonical observations, model-only time,
per-stage times (prefix = vision + LM, denoise = K expert steps), achieved TFLOP/s against the C8 FLOP count,
peak memory and start-up (load + allocate + capture).

    python benchmarks/bench_policy.py --case a --batches 1 8 64 --out results.jsonl   # on a GPU

Rows are JSONL with GPU name, torch version, git commit and the case configuration.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.flops import pi05_flops  # noqa: E402
from policies.pi05.config import Pi05Config  # noqa: E402
from policies.pi05.inputs import ModelInputs  # noqa: E402
from policies.pi05.model import Pi05Model, torch_dtype  # noqa: E402
from policies.pi05.policy import Pi05Policy, RolloutConfig  # noqa: E402
from policies.pi05.scheduler import SchedulerConfig  # noqa: E402

CASES = {
    "a": dict(cams=(0, 1, 2), prompt=200, num_steps=10, horizon=50, chunk=50),
    "b": dict(cams=(0, 1), prompt=48, num_steps=5, horizon=10, chunk=5),
}


def git_commit() -> str:
    import os

    if os.environ.get("PHYAI_GYM_COMMIT"):
        return os.environ["PHYAI_GYM_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, cwd=Path(__file__).parent).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def env_row() -> dict:
    """Device and software identification for every JSONL row."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "commit": git_commit()}


class _Processor:
    """Minimal processor for model-side benchmarks on already processed inputs."""

    def __init__(self, slots, buckets):
        self.slots = tuple(slots)
        self.action_dim = 7
        self.prompt_buckets = tuple(buckets)

    def postprocess(self, model_actions: torch.Tensor, chunk: int) -> torch.Tensor:
        return model_actions[:, :chunk, : self.action_dim].float()


def make_inputs(n: int, cams, prompt: int, image_size: int, device) -> ModelInputs:
    """Random uint8 images for the used cameras and a fully valid prompt of `prompt` tokens."""
    gen = torch.Generator().manual_seed(n)
    images = torch.randint(0, 256, (n, len(cams), 3, image_size, image_size), generator=gen, dtype=torch.uint8)
    tokens = torch.randint(3, 30000, (n, prompt), generator=gen, dtype=torch.int32)
    tokens[:, 0] = 2
    return ModelInputs(
        images=images.to(device),
        image_mask=torch.ones(n, len(cams), dtype=torch.bool, device=device),
        slots=tuple(cams),
        tokens=tokens.to(device),
        lengths=torch.full((n,), prompt, dtype=torch.int32, device=device),
    )


def _percentiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 2], s[min(len(s) - 1, int(0.9 * len(s)))]


def build_policy(case: dict, batches, config: Pi05Config, method: str, value_source: str) -> tuple[Pi05Policy, float]:
    """Full-size random-weight policy with graphs for the case's buckets; returns (policy, start-up seconds)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = Pi05Config(**{**config.__dict__, "action_horizon": case["horizon"], "num_steps": case["num_steps"],
                        "value_source": value_source})
    torch.cuda.synchronize() if device.type == "cuda" else None
    start = time.perf_counter()
    with torch.device(device):
        model = Pi05Model(cfg)
    model.set_precision(torch_dtype(cfg.dtype))
    sched = SchedulerConfig(
        max_batch_size=max(batches), batch_buckets=tuple(sorted(set(batches))), prompt_buckets=(case["prompt"],),
        num_steps=(case["num_steps"],), camera_sets=(case["cams"],),
    )
    rollout = RolloutConfig(method=method, num_steps=case["num_steps"], action_chunk=case["chunk"])
    policy = Pi05Policy(model, _Processor(case["cams"], (case["prompt"],)), rollout, sched)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return policy, time.perf_counter() - start


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
        "prefix_ms_p50": _percentiles(prefix_ms)[0],
        "denoise_ms_p50": _percentiles(denoise_ms)[0],
        "model_ms_p50": _percentiles(model_ms)[0],
    }


def bench_case(name: str, batches, out: Path | None, method: str = "ode", value_source: str = "none",
               warmup: int = 3, iters: int = 20) -> list[dict]:
    """Sweep `batches` for case `name` ("a" or "b"); appends rows to `out`."""
    case = CASES[name]
    config = Pi05Config.pi05_base()
    torch.cuda.reset_peak_memory_stats()
    policy, startup = build_policy(case, batches, config, method, value_source)
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
        p50, p90 = _percentiles(lat)
        stages = time_stages(policy, inputs, opts, iters)
        row = {
            **env_row(), "bench": "policy", "case": name, **{k: (list(v) if isinstance(v, tuple) else v)
                                                             for k, v in case.items()},
            "method": method, "value_source": value_source, "batch": n, "dtype": config.dtype,
            "p50_ms": p50, "p90_ms": p90, "samples_per_s": n / (p50 / 1e3), **stages,
            "model_samples_per_s": n / (stages["model_ms_p50"] / 1e3),
            "tflop_per_sample": flops / 1e12, "achieved_tflops": flops * n / (stages["model_ms_p50"] / 1e3) / 1e12,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "startup_s": startup, "graph_captures": policy.scheduler.stats.captures,
            "input_path": "processed uint8 inputs on host -> device (processor timed separately)",
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out is not None:
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    del policy
    torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=sorted(CASES), default="a")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--method", default="ode")
    parser.add_argument("--value-source", default="none")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    bench_case(args.case, args.batches, args.out, args.method, args.value_source)
