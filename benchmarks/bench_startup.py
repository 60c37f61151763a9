"""Start-up at full size: build the model and allocate (graphs are captured on first use), the first act() (its
graphs captured then), and the peak memory of a batch-64 rollout; then the same through the public API, as a
user meets it: `make_policy(config="base", device="cuda")`, then act() on uint8 256 x 256 numpy images and task
strings at batch 1 and 64 (`first_act_s`: the first call at that batch, captures included; `act_s`: a later call).

    python -m benchmarks.bench_startup [--out DIR]            # on a GPU; rows -> startup.jsonl

Random weights built on the GPU: a checkpoint load adds the safetensors read.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ModelProcessor, make_inputs, run_cli, write_rows

BENCH = "startup"
CAMERAS = {"image": "base_0_rgb", "wrist": "left_wrist_0_rgb"}


def run(out: Path | None = None) -> list[dict[str, Any]]:
    """Times build and setup + capture; appends one row to ``startup.jsonl``."""
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
    buckets = (16, 48, 112, 200)
    sched = SchedulerConfig(max_batch_size=64, prompt_buckets=buckets, num_steps=(5, 10), camera_sets=((0, 1, 2),))
    policy = Pi05Policy(model, ModelProcessor((0, 1, 2), buckets), RolloutConfig(num_steps=10), sched)
    torch.cuda.synchronize()
    ready = time.perf_counter()
    captures_at_start = policy.scheduler.stats.captures
    torch.cuda.reset_peak_memory_stats()
    policy.act_inputs(make_inputs(64, (0, 1, 2), 200, 224, "cuda"))
    torch.cuda.synchronize()
    rows = write_rows(BENCH, [{
        "path": "inputs", "build_s": built - start, "setup_capture_s": ready - built, "total_s": ready - start,
        "captures_at_start": captures_at_start, "first_act_s": time.perf_counter() - ready,
        "graphs": policy.scheduler.stats.captures, "batch_buckets": "every size (default)",
        "prompt_buckets": list(sched.prompt_buckets), "num_steps": [5, 10],
        "peak_mem_gib_batch64_3cam": torch.cuda.max_memory_allocated() / 2**30,
        "note": "random weights built on the GPU (a checkpoint load adds the safetensors read)",
    }], out)  # fmt: skip
    del policy, model
    torch.cuda.empty_cache()
    return rows + run_public(out) + run_checkpoint(out)


def run_checkpoint(out: Path | None = None) -> list[dict[str, Any]]:
    """`run_public` from a full-size checkpoint folder (written by `save_pretrained` of a random policy first)."""
    from phyai_gym.make import make_policy

    with tempfile.TemporaryDirectory() as folder:
        policy = make_policy(config="base", device="cuda", camera_map=CAMERAS)
        policy.save_pretrained(folder)
        policy.close()
        del policy
        torch.cuda.empty_cache()
        return run_public(out, folder)


def run_public(out: Path | None = None, checkpoint: str | None = None) -> list[dict[str, Any]]:
    """`make_policy(config="base", device="cuda")` (or `make_policy(checkpoint)`) to ready, then act() at batch 1
    and 64 (first and later call)."""
    import numpy as np

    from phyai_gym.make import make_policy

    torch.cuda.synchronize()
    start = time.perf_counter()
    if checkpoint is None:
        policy = make_policy(config="base", device="cuda", camera_map=CAMERAS)
    else:
        policy = make_policy(checkpoint, device="cuda")
    torch.cuda.synchronize()
    ready = time.perf_counter()
    row: dict[str, Any] = {"path": "public" if checkpoint is None else "public_checkpoint",
                           "make_policy_s": ready - start,
                           "captures_at_start": policy.scheduler.stats.captures}  # fmt: skip
    rng = np.random.default_rng(0)
    for n in (1, 64):
        obs = {
            "images": {c: rng.integers(0, 256, (n, 256, 256, 3), dtype=np.uint8) for c in ("image", "wrist")},
            "state": rng.standard_normal((n, 8)).astype(np.float32),
            "task": ["put the bowl on the plate"] * n,
        }
        for key in (f"first_act_s_batch{n}", f"act_s_batch{n}"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            policy.act(obs).actions.cpu()
            row[key] = time.perf_counter() - t0
    row["graphs"], row["capture_s"] = policy.scheduler.stats.captures, policy.scheduler.stats.capture_seconds
    row["first_act_s"] = row["first_act_s_batch1"]
    row["to_first_action_s"] = row["make_policy_s"] + row["first_act_s"]
    policy.close()
    torch.cuda.empty_cache()
    return write_rows(BENCH, [row], out)


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
