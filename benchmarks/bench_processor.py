"""Processor latency: canonical obs (host numpy, 3 cameras of 256x256 uint8) -> ModelInputs on the device.

    python -m benchmarks.bench_processor [--out DIR] [--batch 8 64] [--iters 20]    # rows -> processor.jsonl

One row per (device, resize mode, batch): host wall time from the numpy observation to the inputs on the device
(on CUDA up to a synchronize, as `policy.act()` sees it), warm-up excluded.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import percentiles, wall_time_ms, write_rows
from policies.pi05.normalize import NormStats
from policies.pi05.processor import Pi05Processor, ProcessorConfig
from policies.pi05.tokenizer import build_standin_tokenizer, default_standin_dir

BENCH = "processor"


def make_obs(n: int, seed: int = 0) -> dict[str, Any]:
    """`n` canonical observations: 3 cameras of random 256x256 uint8 images, an 8-dim state, a task each."""
    rng = np.random.default_rng(seed)
    cams = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    return {
        "images": {c: rng.integers(0, 256, (n, 256, 256, 3), dtype=np.uint8) for c in cams},
        "state": rng.uniform(-1, 1, (n, 8)).astype(np.float32),
        "task": [f"pick up the black bowl number {i % 4} and place it on the plate" for i in range(n)],
    }


def run(
    out: Path | None = None,
    device: str | None = None,
    batches: Sequence[int] = (8, 64),
    modes: Sequence[str] = ("antialias", "bilinear"),
    iters: int = 20,
    warmup: int = 3,
    tokenizer: str | None = None,
) -> list[dict[str, Any]]:
    """Rows for `device` (default: CPU, and CUDA when present); appends to ``processor.jsonl``."""
    tok = tokenizer or str(build_standin_tokenizer(default_standin_dir()))
    devices = [device] if device else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    stats = NormStats(q01=-np.ones(8), q99=np.ones(8), mean=np.zeros(8), std=np.ones(8))
    rows = []
    for dev in devices:
        for mode in modes:
            cfg = ProcessorConfig(resize_mode=mode, state_stats=stats, action_dim=7, tokenizer=tok)
            proc = Pi05Processor(cfg, device=dev)
            for n in batches:
                obs = make_obs(n)
                p50, p90 = percentiles(wall_time_ms(lambda obs=obs, proc=proc: proc(obs), iters, warmup, dev))
                rows += write_rows(BENCH, [{
                    "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "batch": n, "cameras": 3,
                    "image_hw": [256, 256],
                    "config": {"resize_mode": mode, "prompt_format": cfg.prompt_format, "image_size": cfg.image_size},
                    "threads": torch.get_num_threads(), "p50_ms": p50, "p90_ms": p90,
                    "samples_per_s": n / p50 * 1e3, "iters": iters,
                }], out)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for processor.jsonl (default: results/)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cpu, and cuda when present)")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["antialias", "bilinear"])
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: build the stand-in)")
    args = parser.parse_args()
    run(args.out, args.device, args.batch, args.modes, args.iters, args.warmup, args.tokenizer)


if __name__ == "__main__":
    main()
