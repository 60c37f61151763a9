"""Eager full-size `sample_actions` (no graphs, random bf16 weights) per attention backend, and which CUDA
kernels SDPA launched per site.

    python -m benchmarks.bench_model_eager [--out DIR]        # on a GPU; rows -> model_eager.jsonl

3 cameras, a 200-token prompt, K=10, H=50 at batch 1 and 8, p50 of 5 calls (CUDA events) after 2 warm-ups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.common import cuda_time_ms, percentiles, run_cli, write_rows

BENCH = "model_eager"


def sdpa_kernels(model: Any) -> dict[str, int]:
    """Which CUDA kernels SDPA actually launched (profiler kernel names containing an attention keyword)."""
    from torch.profiler import ProfilerActivity, profile

    from policies.pi05.attention import AttentionConfig

    model.attention_config = AttentionConfig(vision="sdpa", prefix="sdpa", expert="sdpa")
    model.resolve_attention()
    images = torch.randint(0, 256, (1, 3, 3, 224, 224), dtype=torch.uint8, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.sample_actions(images, torch.ones(1, 3, dtype=torch.bool, device="cuda"),
                             torch.randint(3, 300, (1, 200), device="cuda"),
                             torch.ones(1, 200, dtype=torch.bool, device="cuda"),
                             torch.randn(1, 50, 32, device="cuda"), 2)  # fmt: skip
    keys = ("flash", "fmha", "efficient", "attention", "cudnn")
    return {evt.key[:120]: evt.count for evt in prof.key_averages() if any(k in evt.key.lower() for k in keys)}


def run(out: Path | None = None, batches: tuple[int, ...] = (1, 8), iters: int = 5) -> list[dict[str, Any]]:
    """One row per (backend, batch), then one row with the SDPA kernels; appends to ``model_eager.jsonl``."""
    from policies.pi05.attention import AttentionConfig, flash_attn_available
    from policies.pi05.config import Pi05Config
    from policies.pi05.model import Pi05Model

    with torch.device("cuda"):
        model = Pi05Model(Pi05Config.pi05_base())
    model.set_precision(torch.bfloat16)
    rows = []
    for backend in ("eager", "sdpa", "flash"):
        if backend == "flash" and not flash_attn_available():
            rows += write_rows(BENCH, [{"backend": "flash", "status": "not run: flash-attn not installed"}], out)
            continue
        model.attention_config = AttentionConfig(vision=backend, prefix=backend, expert=backend)
        plan = model.resolve_attention()
        for batch in batches:
            images = torch.randint(0, 256, (batch, 3, 3, 224, 224), dtype=torch.uint8, device="cuda")
            mask = torch.ones(batch, 3, dtype=torch.bool, device="cuda")
            tokens = torch.randint(3, 30000, (batch, 200), device="cuda")
            tmask = torch.ones(batch, 200, dtype=torch.bool, device="cuda")
            noise = torch.randn(batch, 50, 32, device="cuda")
            result: dict[str, torch.Tensor] = {}

            def call(images=images, mask=mask, tokens=tokens, tmask=tmask, noise=noise, result=result, model=model):
                result["actions"] = model.sample_actions(images, mask, tokens, tmask, noise, 10)

            torch.cuda.reset_peak_memory_stats()
            times = cuda_time_ms(call, iters)
            rows += write_rows(BENCH, [{
                "mode": "eager sample_actions", "backend": backend, "plan": plan.report(), "batch": batch,
                "cameras": 3, "prompt": 200, "K": 10, "H": 50, "p50_ms": percentiles(times)[0],
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
                "finite": bool(torch.isfinite(result["actions"]).all()),
            }], out)  # fmt: skip
    rows += write_rows(BENCH, [{"sdpa_kernels": sdpa_kernels(model)}], out)
    del model
    torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
