"""Start-up at full size: build the model, allocate and capture every declared graph (K in {5, 10}, 4 prompt
buckets, 7 batch buckets, 3 cameras, prefix values), then the peak memory of a batch-64 rollout.

    python -m benchmarks.bench_startup [--out DIR]            # on a GPU; one row -> startup.jsonl

Random weights built on the GPU: a checkpoint load adds the safetensors read.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ModelProcessor, make_inputs, run_cli, write_rows

BENCH = "startup"


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
    torch.cuda.reset_peak_memory_stats()
    policy.act_inputs(make_inputs(64, (0, 1, 2), 200, 224, "cuda"))
    torch.cuda.synchronize()
    rows = write_rows(BENCH, [{
        "build_s": built - start, "setup_capture_s": ready - built, "total_s": ready - start,
        "graphs": policy.scheduler.stats.captures, "batch_buckets": list(sched.batch_buckets),
        "prompt_buckets": list(sched.prompt_buckets), "num_steps": [5, 10],
        "peak_mem_gib_batch64_3cam": torch.cuda.max_memory_allocated() / 2**30,
        "note": "random weights built on the GPU (a checkpoint load adds the safetensors read)",
    }], out)  # fmt: skip
    del policy, model
    torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
