"""Update-0 log-ratio on the GPU, LIBERO RL setting: the bf16 graph rollout against an eager trainer copy with the
same weights (bf16 and fp32), and graph vs eager rollout outputs.

    python -m benchmarks.bench_ratio [--out DIR]              # on a GPU; rows -> ratio.jsonl

Every weight is drawn N(0, 0.02) on the GPU (zero-initialised adaRMS would switch the expert's residual
branches off and hide any precision gap); 2 cameras, 48 tokens, K=5, H=10, C=5, sde with a=0.5, prefix values.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ModelProcessor, make_inputs, run_cli, write_rows

BENCH = "ratio"
SETTING = "LIBERO RL (2 cams, 48 tok, K=5, H=10, C=5, A=7, sde a=0.5)"


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.02, device: str = "cuda") -> None:
    """Seeded N(0, std) for every parameter in name order, drawn on `device`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.empty(p.shape, device=device, dtype=torch.float32).normal_(0.0, std, generator=gen)
            p.copy_(noise.to(p.dtype))


def run(out: Path | None = None, device: str = "cuda", batch: int = 64) -> list[dict[str, Any]]:
    """One graph-vs-eager row and one row per trainer dtype; appends to ``ratio.jsonl``."""
    from policies.pi05.config import Pi05Config
    from policies.pi05.model import Pi05Model
    from policies.pi05.policy import Pi05Policy, RolloutConfig
    from policies.pi05.scheduler import SchedulerConfig

    cfg = Pi05Config.pi05_base(action_horizon=10, num_steps=5, value_source="prefix")
    proc = ModelProcessor((0, 1), (48,))
    rollout_cfg = RolloutConfig(method="sde", num_steps=5, noise_level=0.5, action_chunk=5)
    sched = SchedulerConfig(max_batch_size=batch, batch_buckets=(batch,), prompt_buckets=(48,), num_steps=(5,),
                            camera_sets=((0, 1),))  # fmt: skip
    with torch.device(device):
        model = Pi05Model(cfg)
    randomize(model, device=device)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.set_precision(torch.bfloat16)
    graph = Pi05Policy(model, proc, rollout_cfg, sched)
    x = make_inputs(batch, (0, 1), 48, cfg.vision.image_size, device)
    rollout = graph.act_inputs(x, seeds=torch.arange(batch, device=device))
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        with torch.device(device):
            trainer_model = Pi05Model(cfg)
        trainer_model.load_state_dict(state)
        trainer_model.set_precision(dtype)
        trainer = Pi05Policy(trainer_model, proc, rollout_cfg, dataclasses.replace(sched, cuda_graphs=False))
        if dtype == torch.bfloat16:
            eager = trainer.act_inputs(x, seeds=torch.arange(batch, device=device))
            rows += write_rows(BENCH, [{
                "check": "graph vs eager rollout (same bf16 model weights)",
                "chains_max_abs_diff": float((eager.chains - rollout.chains).abs().max()),
                "log_prob_max_abs_diff": float((eager.log_prob - rollout.log_prob).abs().max()),
            }], out)  # fmt: skip
        ev = trainer.evaluate(rollout)
        log_ratio = (ev.log_prob.detach() - rollout.log_prob).float()
        rows += write_rows(BENCH, [{
            "setting": SETTING, "batch": batch, "trainer_dtype": str(dtype),
            "mean_abs_log_ratio": float(log_ratio.abs().mean()), "max_abs_log_ratio": float(log_ratio.abs().max()),
            "clip_fraction": float(((log_ratio.exp() - 1).abs() > 0.2).float().mean()),
            "mean_abs_value_diff": float((ev.values.detach() - rollout.values).abs().mean()),
        }], out)  # fmt: skip
        del trainer, trainer_model
    del graph, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
