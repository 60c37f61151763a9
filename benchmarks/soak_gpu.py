"""GPU soak: 5,000 captured rollout steps of a full-size PI0.5 at a fixed batch; memory and graphs stay flat.

The LIBERO RL setting (DESIGN C8): `Pi05Config.pi05_base()` in bf16 with random weights, 2 cameras, a 48-token
prompt, K=5 denoise steps, horizon H=10, chunk C=5, batch 1, method ``sde`` with values -- about 17 ms a step
on an H200 (batch 1 keeps the 5,000 steps under two minutes). The scheduler declares one batch bucket (1),
one prompt bucket (48) and one K, so start-up captures few graphs. One *step* is one ``policy.act_inputs`` call
on processed inputs already on the device (`benchmarks/bench_policy.py` measures the processor separately).

Checks: ``torch.cuda.memory_allocated()`` after warm-up and every 500 steps never exceeds the warm-up value
(+1 MiB tolerance), and ``scheduler.stats.captures`` is the same before and after the soak (nothing is
captured on the hot path).

    python -m benchmarks.soak_gpu [--out DIR]                 # on a GPU, ~2 minutes; row -> soak.jsonl
    python -m benchmarks.soak_gpu --dry-run --out /tmp/soak   # CPU smoke test: tiny, 50 steps, batch 2

`run(out)` is the `soak` section of `benchmarks/gpu_suite.py`; it returns the row.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ModelProcessor, make_inputs, write_rows
from policies.pi05.config import Pi05Config
from policies.pi05.model import Pi05Model, torch_dtype
from policies.pi05.policy import Pi05Policy, RolloutConfig
from policies.pi05.scheduler import SchedulerConfig

BENCH = "soak"

SETTING = dict(cams=(0, 1), prompt=48, num_steps=5, horizon=10, chunk=5, batch=1)
"""The LIBERO RL setting of DESIGN C8."""
TOLERANCE_BYTES = 1 << 20


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return -1


def build(dry_run: bool, batch: int) -> Pi05Policy:
    """Full-size bf16 policy on CUDA (or tiny fp32 on CPU for the dry run) with one graph key per stage."""
    s = SETTING
    base = Pi05Config.tiny() if dry_run else Pi05Config.pi05_base()
    config = dataclasses.replace(base, action_horizon=s["horizon"], num_steps=s["num_steps"])
    device = torch.device("cpu" if dry_run else "cuda")
    with torch.device(device):
        model = Pi05Model(config)
    model.set_precision(torch_dtype(config.dtype))
    scheduler = SchedulerConfig(
        max_batch_size=batch, batch_buckets=(batch,), prompt_buckets=(s["prompt"],),
        num_steps=(s["num_steps"],), camera_sets=(s["cams"],),
    )  # fmt: skip
    rollout = RolloutConfig(method="sde", num_steps=s["num_steps"], action_chunk=s["chunk"])
    return Pi05Policy(model, ModelProcessor(s["cams"], (s["prompt"],)), rollout, scheduler)


def _memory(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return _rss_bytes()


def run(out_path: str | Path | None, steps: int = 5_000, every: int = 500, warmup: int = 20,
        dry_run: bool = False, batch: int | None = None) -> dict[str, Any]:
    """Runs the soak (batch default: 1); appends its row to ``soak.jsonl`` under `out_path` (None: results/)."""
    if not dry_run and not torch.cuda.is_available():
        raise RuntimeError("soak_gpu: needs a CUDA GPU (use --dry-run for the CPU smoke test)")
    start = time.perf_counter()
    batch = batch or SETTING["batch"]
    policy = build(dry_run, batch)
    startup_s = time.perf_counter() - start
    s, device = SETTING, policy.device
    image_size = policy.config.vision.image_size
    inputs = make_inputs(batch, s["cams"], s["prompt"], image_size, device)
    env_ids = list(range(batch))
    policy.act_inputs(inputs, seeds=list(range(batch)), env_ids=env_ids)
    for _ in range(warmup - 1):
        out = policy.act_inputs(inputs, env_ids=env_ids)
    del out
    captures_before = policy.scheduler.stats.captures
    replays_before = policy.scheduler.stats.replays
    baseline = _memory(device)
    samples: list[dict[str, Any]] = [{"step": 0, "bytes": baseline, "seconds": 0.0}]
    loop_start = time.perf_counter()
    for step in range(1, steps + 1):
        out = policy.act_inputs(inputs, env_ids=env_ids)
        if step % every == 0 or step == steps:
            del out
            samples.append({"step": step, "bytes": _memory(device), "seconds": time.perf_counter() - loop_start})
    seconds = time.perf_counter() - loop_start
    captures_after = policy.scheduler.stats.captures
    peak = max(x["bytes"] for x in samples)
    row = {
        "kind": "gpu",
        "dry_run": dry_run,
        "config": "tiny (CPU dry run)" if dry_run else "pi05_base",
        "dtype": policy.config.dtype,
        **{k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()},
        "batch": batch,
        "method": "sde",
        "value_source": policy.config.value_source,
        "steps": steps,
        "warmup_steps": warmup,
        "memory_kind": "RSS (CPU)" if device.type == "cpu" else "torch.cuda.memory_allocated",
        "memory_after_warmup_bytes": baseline,
        "memory_samples": samples,
        "memory_growth_bytes": peak - baseline,
        "captures_before": captures_before,
        "captures_after": captures_after,
        "replays": policy.scheduler.stats.replays - replays_before,
        "startup_s": startup_s,
        "seconds": seconds,
        "ms_per_step": seconds / steps * 1e3,
        "samples_per_s": batch * steps / seconds,
    }
    memory_ok = device.type == "cpu" or peak - baseline <= TOLERANCE_BYTES
    row["passed"] = bool(memory_ok and captures_after == captures_before)
    policy.close()
    return write_rows(BENCH, [row], out_path)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for soak.jsonl (default: results/, a temporary folder with --dry-run)")
    parser.add_argument("--steps", type=int, default=None, help="default 5000 (50 with --dry-run)")
    parser.add_argument("--every", type=int, default=None, help="memory sample period (default 500; 10 dry)")
    parser.add_argument("--dry-run", action="store_true", help="tiny config on CPU (smoke test of this script)")
    parser.add_argument("--batch", type=int, default=None, help="default 1 (2 with --dry-run)")
    args = parser.parse_args()
    steps = args.steps or (50 if args.dry_run else 5_000)
    every = args.every or (10 if args.dry_run else 500)
    batch = args.batch or (2 if args.dry_run else SETTING["batch"])
    out = args.out or (Path(tempfile.gettempdir()) / "phyai_soak_gpu_dry_run" if args.dry_run else None)
    row = run(out, steps=steps, every=every, warmup=5 if args.dry_run else 20, dry_run=args.dry_run, batch=batch)
    if not row["passed"]:
        print(
            f"FAIL: memory grew {row['memory_growth_bytes']} bytes or captures changed "
            f"({row['captures_before']} -> {row['captures_after']})",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
