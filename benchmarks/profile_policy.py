"""Where the time of a policy call goes: per-kernel CUDA time of the prefix and denoise replays, by category.

    python -m benchmarks.profile_policy [--out DIR]           # on a GPU; rows -> profile.jsonl

For the C8 cases at a few batch sizes, the prefix and denoise graphs are replayed under `torch.profiler`
(CUPTI records the kernels of a graph replay individually). Kernels are grouped into GEMM, attention,
normalisation, elementwise, copy and other; each row gives the kernel count per replay, the summed kernel
time, the wall time of the replay, and the ten most expensive kernels. If the profiler sees no kernels inside
the replays (older CUPTI), the same stage runs eagerly on the same buffers instead and the row says so.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.common import CASES, build_case_policy, make_inputs, run_cli, write_rows
from policies.pi05.config import Pi05Config

BENCH = "profile"

CATEGORIES = (
    ("attention", ("sdpa", "flash", "fmha", "attention", "softmax")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "wgmma", "cublas", "splitk", "sm90_", "sm80_")),
    ("norm", ("norm",)),
    ("copy", ("copy", "memcpy", "memset", "cat", "index")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce", "triton")),
)


def category(name: str) -> str:
    """Coarse class of a kernel from its name."""
    low = name.lower()
    for label, keys in CATEGORIES:
        if any(k in low for k in keys):
            return label
    return "other"


def _kernel_events(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def profile_stage(run, reps: int = 5) -> dict:
    """Profile `reps` calls of `run()`; per-call kernel count, summed kernel time and top kernels."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end) / reps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    events = _kernel_events(prof)
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        by_cat[category(e.name)] += us / reps
        by_name[e.name][0] += us / reps
        by_name[e.name][1] += 1 / reps
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]
    return {
        "wall_ms": wall_ms,
        "kernels_per_call": len(events) / reps,
        "kernel_ms": sum(by_cat.values()) / 1e3,
        "by_category_ms": {k: round(v / 1e3, 3) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top": [{"name": n[:140], "ms": round(v[0] / 1e3, 3), "count": round(v[1], 1)} for n, v in top],
    }


def _runner(sched, stage: str, key: tuple, graphs: bool):
    """A no-argument call of one stage: its graph replay, or its eager body on the same static buffers."""
    if graphs:
        return (lambda: sched._run_prefix(*key)) if stage == "prefix" else (lambda: sched._run_denoise(*key))
    body = sched._prefix_stage if stage == "prefix" else sched._denoise_stage

    def eager() -> None:
        with torch.no_grad():
            body(*key)

    return eager


COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat", "aten::flip")


def copy_sources(run_eager, reps: int = 2) -> list[dict]:
    """Which source lines of the eager stage issue copies: per (op, input shapes, project frame) the GPU time per
    call, the 15 largest."""
    from torch.profiler import ProfilerActivity, profile

    run_eager()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as prof:
        for _ in range(reps):
            run_eager()
        torch.cuda.synchronize()
    totals: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or e.name not in COPY_OPS:
            continue
        frames = [f for f in (e.stack or []) if "policies/" in f or "benchmarks/" in f]
        key = (e.name, str(e.input_shapes)[:120], frames[0] if frames else "?")
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        totals[key][0] += us / reps
        totals[key][1] += 1 / reps
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:15]
    return [{"op": k[0], "shapes": k[1], "frame": k[2][-160:], "ms": round(v[0] / 1e3, 3), "count": round(v[1], 1)}
            for k, v in top]  # fmt: skip


def run(out: Path | None = None, plan=(("a", (1, 64)), ("b", (1, 64))), copies: bool = False) -> list[dict]:
    """Profile the prefix and denoise replays of each (case, batches); appends rows to ``profile.jsonl``."""
    rows = []
    config = Pi05Config.pi05_base()
    for name, batches in plan:
        case = CASES[name]
        policy = build_case_policy(case, batches, "ode", "none")
        sched = policy.scheduler
        opts = policy.sampling_options(deterministic=True)
        for n in batches:
            inputs = make_inputs(n, case["cams"], case["prompt"], config.vision.image_size, policy.device)
            seeds = torch.arange(n, device=policy.device)
            b, length, cams = sched.bucket_for(n), sched.prompt_bucket_for(case["prompt"]), tuple(case["cams"])
            sched._load(inputs, seeds, seeds * 0, opts, b, length)
            for stage in ("prefix", "denoise"):
                key = (b, length, cams) if stage == "prefix" else (b, length, cams, case["num_steps"])
                result = profile_stage(_runner(sched, stage, key, graphs=True))
                mode = "graph replay"
                if result["kernels_per_call"] == 0:  # the profiler did not see inside the graph
                    result = profile_stage(_runner(sched, stage, key, graphs=False))
                    mode = "eager stage on the same buffers (graph kernels not visible to the profiler)"
                rows += write_rows(BENCH, [{"case": name, "batch": n, "stage": stage, "mode": mode, **result}], out)
                if copies:  # nested copies (e.g. a clone's copy_) count under each op
                    found = copy_sources(_runner(sched, stage, key, graphs=False))
                    row = {"case": name, "batch": n, "stage": stage, "mode": "copy sources (eager)", "copies": found}
                    rows += write_rows(BENCH, [row], out)
        del policy
        torch.cuda.empty_cache()
    return rows


def call_timeline(out: Path | None = None, name: str = "a", batch: int = 64, reps: int = 5) -> list[dict]:
    """Where the wall time of a whole timed call goes (`bench_policy`'s loop body: pageable host -> device copy of
    the inputs, `act_inputs`, the actions' copy back), from a profile of host and device together.

    One row for the median call: ``wall_ms``; ``device_busy_ms`` (the union of kernels and copies); ``lead_ms``
    (call start to the first device activity), ``tail_ms`` (last device activity to the call's end) and the idle
    gaps between (``gaps``: each over 20 us with its offset, the device activities either side and the host ops
    running during it).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    case = CASES[name]
    config = Pi05Config.pi05_base()
    policy = build_case_policy(case, (batch,), "ode", "none")
    host = make_inputs(batch, case["cams"], case["prompt"], config.vision.image_size, policy.device).to("cpu")

    def call() -> None:
        policy.act_inputs(host.to(policy.device), deterministic=True).actions.cpu()

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            with record_function("timed_call"):
                call()
    events = prof.events()
    device = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)  # fmt: skip
    host_ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name != "timed_call"]
    calls = sorted((e for e in events if e.name == "timed_call"), key=lambda e: e.time_range.elapsed_us())
    c = calls[len(calls) // 2]
    t0, t1 = c.time_range.start, c.time_range.end
    inside = [e for e in device if t0 <= e.time_range.start < t1]
    busy, gaps, end, prev = 0.0, [], t0, None
    for e in inside:
        s, f = e.time_range.start, e.time_range.end
        if s > end + 20 and prev is not None:
            during = sorted({h.name for h in host_ops if h.time_range.start < s and h.time_range.end > end})
            gaps.append({"at_ms": round((end - t0) / 1e3, 3), "us": round(s - end, 1), "after": prev[:80],
                         "before": e.name[:80], "host_ops": during[:12]})  # fmt: skip
        busy += max(0.0, f - max(s, end))
        end, prev = max(end, f), e.name
    row = {"case": name, "batch": batch, "stage": "timed call", "mode": "host + device profile",
           "wall_ms": (t1 - t0) / 1e3, "device_busy_ms": busy / 1e3,
           "lead_ms": ((inside[0].time_range.start if inside else t1) - t0) / 1e3, "tail_ms": (t1 - end) / 1e3,
           "device_activities": len(inside), "gap_ms": sum(g["us"] for g in gaps) / 1e3,
           "gaps": sorted(gaps, key=lambda g: -g["us"])[:15],
           "memcpy": [{"name": e.name[:60], "us": round(e.time_range.elapsed_us(), 1)} for e in inside
                      if "Memcpy" in e.name][:10]}  # fmt: skip
    return write_rows(BENCH, [row], out)


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
