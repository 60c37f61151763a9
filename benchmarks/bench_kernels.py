"""The fused hot-path kernels (`policies/pi05/kernels.py`) on and off: kernels per layer-step, agreement, latency.

    python -m benchmarks.bench_kernels [--out DIR]       # on a GPU; the `kernels` section of gpu_suite.py

1. `expert_kernels` rows: CUDA kernels per expert layer-step and per LM layer, with `SchedulerConfig.fused_kernels`
   off and on, at full widths (case (a) geometry, batch 1). A layer's count is exact: the stage is profiled on a
   1-layer and a 2-layer model of the same widths and the difference taken (divided by K for the denoise loop);
   the per-layer kernel names come with it, and those of the denoise stage outside the layers (per step: the
   once-per-stage kernels, noise draws and controls, are spread over the K steps). The stages run eagerly on the
   static buffers: the same kernels as the graph replay, and visible to every CUPTI.
2. `expert_kernels` rows of kind ``check``: full-size case (a) chains with the fused kernels against the unfused
   ones (same model, same inputs and seeds), and graph replay against the eager stage with them on.
3. `policy` rows: `bench_policy.bench_case` for case (a) batch 1 and 64 and case (b) batch 64, off and on.

Each part records a failure as a `gpu_suite` row and goes on with the next.
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common import CASES, build_case_policy, make_inputs, run_cli, write_rows
from policies.pi05.config import Pi05Config

BENCH = "expert_kernels"


def _kernel_names(run) -> Counter:
    """Names of the CUDA kernels one call of `run()` launches (after two warm-up calls)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def stage_kernels(case_name: str, depth: int, fused_kernels: bool, batch: int = 1) -> dict[str, Counter]:
    """Kernel names of one eager prefix stage and one eager denoise stage of a `depth`-layer full-width model."""
    case = CASES[case_name]
    base = Pi05Config.pi05_base()
    overrides = dict(llm=replace(base.llm, depth=depth), expert=replace(base.expert, depth=depth),
                     vision=replace(base.vision, depth=1))  # fmt: skip
    policy = build_case_policy(case, [batch], "ode", "none", fused_kernels, overrides)
    sched = policy.scheduler
    inputs = make_inputs(batch, case["cams"], case["prompt"], base.vision.image_size, policy.device)
    seeds = torch.arange(batch, device=policy.device)
    b, length, cams = sched.bucket_for(batch), sched.prompt_bucket_for(case["prompt"]), tuple(case["cams"])
    sched._load(inputs, seeds, seeds * 0, policy.sampling_options(deterministic=True), b, length)

    def prefix() -> None:
        with torch.no_grad():
            sched._prefix_stage(b, length, cams)

    def denoise() -> None:
        with torch.no_grad():
            sched._denoise_stage(b, length, cams, case["num_steps"])

    out = {"prefix": _kernel_names(prefix), "denoise": _kernel_names(denoise)}
    del policy
    torch.cuda.empty_cache()
    return out


def kernel_counts(out: Path | None = None, case_name: str = "a", batch: int = 1) -> list[dict]:
    """`expert_kernels` rows: kernels per expert layer-step and per LM layer, fused kernels off and on."""
    rows = []
    k = CASES[case_name]["num_steps"]
    for fused in (False, True):
        one, two = stage_kernels(case_name, 1, fused, batch), stage_kernels(case_name, 2, fused, batch)
        layer_step = two["denoise"] - one["denoise"]
        prefix_layer = two["prefix"] - one["prefix"]
        per_step = sum(layer_step.values()) / k
        outside = (sum(one["denoise"].values()) - per_step * k) / k  # per denoise step, outside the layers
        outside_names = one["denoise"] - layer_step  # one stage's kernels outside the layers, by name
        rows += write_rows(BENCH, [{
            "case": case_name, "batch": batch, "fused_kernels": fused,
            "kernels_per_layer_step": per_step,
            "prefix_kernels_per_layer": sum(prefix_layer.values()),
            "denoise_kernels_per_step_outside_layers": outside,
            "layer_step_kernels": {name[:120]: n / k for name, n in layer_step.most_common()},
            "outside_kernels_per_step": {name[:120]: n / k for name, n in outside_names.most_common()},
            "prefix_layer_kernels": {name[:120]: n for name, n in prefix_layer.most_common()},
            "method": "eager stages on the static buffers, 2-layer minus 1-layer model at full widths",
        }], out)  # fmt: skip
    return rows


def agreement(out: Path | None = None, case_name: str = "a", batches=(1, 8)) -> list[dict]:
    """``check`` rows: fused vs unfused chains on one full-size model; graph == eager with fused."""
    case = CASES[case_name]
    rows = []
    policy = build_case_policy(case, list(batches), "ode", "none", True)
    config = policy.model.config
    results = {}
    for n in batches:
        inputs = make_inputs(n, case["cams"], case["prompt"], config.vision.image_size, policy.device)
        results[n] = [inputs, policy.act_inputs(inputs, seeds=range(n)).chains]
    model, processor, rollout = policy.model, policy.processor, policy.rollout
    for n, (inputs, fused_chain) in results.items():
        sched = replace(policy.scheduler.config, cuda_graphs=False)
        eager = type(policy)(model, processor, rollout, sched).act_inputs(inputs, seeds=range(n)).chains
        plain = type(policy)(model, processor, rollout, replace(sched, fused_kernels=False, cuda_graphs=True))
        unfused = plain.act_inputs(inputs, seeds=range(n)).chains
        rows += write_rows(BENCH, [{
            "kind": "check", "case": case_name, "batch": n, "graph_equals_eager": bool(torch.equal(fused_chain, eager)),
            "chains_max_abs_diff": (fused_chain - unfused).abs().max().item(),
            "chains_max_abs": unfused.abs().max().item(),
            "final_actions_max_abs_diff": (fused_chain[:, -1] - unfused[:, -1]).abs().max().item(),
        }], out)  # fmt: skip
        del plain
    del policy
    torch.cuda.empty_cache()
    return rows


def policy_ab(out: Path | None = None) -> None:
    """`policy` rows with the fused kernels off and on: case (a) batch 1 and 64, case (b) batch 64."""
    from benchmarks.bench_policy import bench_case

    for fused in (False, True):
        bench_case("a", [1, 64], out, iters=10, fused_kernels=fused)
        bench_case("b", [64], out, iters=10, fused_kernels=fused)


def run(out: Path | None = None) -> None:
    """All three parts; a failing part is recorded (`gpu_suite` row, ``error_kernels_<part>.txt``) and skipped."""
    for name, part in (("counts", kernel_counts), ("agreement", agreement), ("policy_ab", policy_ab)):
        try:
            part(out)
            status = "ok"
        except Exception as err:  # noqa: BLE001 - record and go on
            status = f"failed: {type(err).__name__}: {err}"
            if out is not None:
                (Path(out) / f"error_kernels_{name}.txt").write_text(traceback.format_exc())
        write_rows("gpu_suite", [{"section": f"kernels.{name}", "status": status}], out)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
