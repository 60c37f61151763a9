"""Processor latency: canonical obs (host numpy, 3 cameras of 256x256 uint8) -> ModelInputs on the device.

Usage: python benchmarks/bench_processor.py [--out results.jsonl] [--batch 8 64] [--iters 20]
Prints one JSON row per (device, batch, resize mode); with --out the rows are appended to that JSONL file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policies.pi05.normalize import NormStats  # noqa: E402
from policies.pi05.processor import Pi05Processor, ProcessorConfig  # noqa: E402
from policies.pi05.tokenizer import build_standin_tokenizer, default_standin_dir  # noqa: E402


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def make_obs(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    cams = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    return {
        "images": {c: rng.integers(0, 256, (n, 256, 256, 3), dtype=np.uint8) for c in cams},
        "state": rng.uniform(-1, 1, (n, 8)).astype(np.float32),
        "task": [f"pick up the black bowl number {i % 4} and place it on the plate" for i in range(n)],
    }


def measure(proc: Pi05Processor, obs: dict, iters: int, warmup: int) -> list[float]:
    cuda = proc.device.type == "cuda"
    for _ in range(warmup):
        proc(obs)
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            x = proc(obs)
            end.record()
            torch.cuda.synchronize()
            del x
            times.append((time.perf_counter() - t0) * 1e3)  # host-to-result wall time, like policy.act()
        else:
            t0 = time.perf_counter()
            proc(obs)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="append JSONL rows here (default: print only)")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["antialias", "bilinear"])
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: build the stand-in)")
    args = parser.parse_args()

    tok = args.tokenizer or str(build_standin_tokenizer(default_standin_dir()))
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    stats = NormStats(q01=-np.ones(8), q99=np.ones(8), mean=np.zeros(8), std=np.ones(8))
    rows = []
    for device in devices:
        for mode in args.modes:
            cfg = ProcessorConfig(resize_mode=mode, state_stats=stats, action_dim=7, tokenizer=tok)
            proc = Pi05Processor(cfg, device=device)
            for n in args.batch:
                obs = make_obs(n)
                t = np.array(measure(proc, obs, args.iters, args.warmup))
                row = {
                    "bench": "processor",
                    "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__,
                    "commit": git_commit(),
                    "batch": n,
                    "cameras": 3,
                    "image_hw": [256, 256],
                    "config": {"resize_mode": mode, "prompt_format": cfg.prompt_format, "image_size": cfg.image_size},
                    "threads": torch.get_num_threads(),
                    "p50_ms": float(np.percentile(t, 50)),
                    "p90_ms": float(np.percentile(t, 90)),
                    "samples_per_s": float(n / np.percentile(t, 50) * 1e3),
                    "iters": args.iters,
                }
                rows.append(row)
                print(json.dumps(row))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
