"""Weight-sync latency (DESIGN C6 targets): in-process sync of expert + heads and of all parameters, from GPU
tensors and from pinned host memory, beside the raw host-to-device (and device-to-device) copy of the same
bytes measured in the same run.

One row per (subset, source): host wall time from `begin_weight_update` to the commit having run on the GPU
(`torch.cuda.synchronize()` after `finish_weight_update`), warm-up excluded, p50/p90 over --iters runs.

    python -m benchmarks.bench_weight_sync --config base [--out DIR]       # rows -> weight_sync.jsonl

Every row goes to ``weight_sync.jsonl``; the phase, profile and host-overhead rows carry ``kind``.

`run(out_path, config_name)` is the entry point `benchmarks/gpu_suite.py` calls.

`--host-overhead` isolates the host (Python) cost of a sync on CPU: a model with pi05_base's number and names
of tensors (LM / expert depth 18, SigLIP depth 27: 825 parameters, 222 trainable) but tiny sizes, so the
copies cost next to nothing and what is timed is begin + update + finish (validation, staging, commit,
table refresh). `--save-baseline FILE` stores the p50s; a later run with `--baseline FILE` reports them as
`p50_ms_before` beside this run's `p50_ms_after`:

    python -m benchmarks.bench_weight_sync --host-overhead --save-baseline /tmp/before.json   # old code
    python -m benchmarks.bench_weight_sync --host-overhead --baseline /tmp/before.json        # new code
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, git_commit, synchronize, wall_time_ms, write_rows
from benchmarks.common import ModelProcessor as _Processor
from policies.pi05.config import Pi05Config
from policies.pi05.model import Pi05Model
from policies.pi05.policy import Pi05Policy, RolloutConfig
from policies.pi05.scheduler import SchedulerConfig

TARGET_MS = {"expert": 10.0, "all": 30.0}  # DESIGN: in-process sync on an H200
PINNED_RATIO_TARGET = 1.3


def _append_rows(out_path: str | Path | None, rows: list[dict[str, Any]]) -> None:
    """Append each row to its benchmark's JSONL (``<bench>.jsonl`` under the folder `out_path`, or results/)."""
    for row in rows:
        write_rows(row["bench"], [row], out_path, echo=False)


def _flat_copy(tensors: dict[str, torch.Tensor], device: str | torch.device, pin: bool) -> dict[str, torch.Tensor]:
    """Copies of `tensors` as views of one flat buffer per dtype (one pinned allocation instead of hundreds)."""
    out: dict[str, torch.Tensor] = {}
    for dtype in {t.dtype for t in tensors.values()}:
        group = {n: t for n, t in tensors.items() if t.dtype == dtype}
        flat = torch.empty(sum(t.numel() for t in group.values()), dtype=dtype, device=device, pin_memory=pin)
        offset = 0
        for n, t in group.items():
            view = flat[offset : offset + t.numel()].view(t.shape)
            view.copy_(t)
            out[n] = view
            offset += t.numel()
    return {n: out[n] for n in tensors}


def build_policy(config_name: str, device: torch.device) -> Pi05Policy:
    config = Pi05Config.pi05_base() if config_name == "base" else Pi05Config.tiny()
    with torch.device(device):
        model = Pi05Model(config)  # default initialisation: the values do not matter, finiteness does
    model.set_precision(torch.bfloat16 if device.type == "cuda" else torch.float32)
    slots = tuple(range(len(config.camera_slots)))
    sched = SchedulerConfig(max_batch_size=1, num_steps=(config.num_steps,), camera_sets=(slots,), prompt_buckets=(16,))
    rollout = RolloutConfig(num_steps=config.num_steps, action_chunk=min(5, config.action_horizon))
    return Pi05Policy(model, _Processor(slots, (16,)), rollout, sched)


def run(out_path: str | Path, config_name: str = "base", iters: int = 10) -> list[dict[str, Any]]:
    """Measure and append JSONL rows to `out_path`; returns the rows."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    policy = build_policy(config_name, device)
    setup_s = time.perf_counter() - started
    meta = {
        "bench": "weight_sync",
        "config": config_name,
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "commit": git_commit(),
        "dtype": str(policy.model.compute_dtype).removeprefix("torch."),
        "setup_s": round(setup_s, 2),
    }
    rows: list[dict[str, Any]] = []
    subsets = {
        "expert": dict(policy.trainable_parameters()),
        "all": dict(policy.model.named_parameters()),
    }
    for subset, params in subsets.items():
        expected = "trainable" if subset == "expert" else "all"
        nbytes = sum(p.numel() * p.element_size() for p in params.values())
        base = {
            **meta,
            "subset": subset,
            "num_params": sum(p.numel() for p in params.values()),
            "num_tensors": len(params),
            "bytes": nbytes,
        }
        detached = {n: p.detach() for n, p in params.items()}
        gpu_source = _flat_copy(detached, device, pin=False)
        sources = {"device": gpu_source}
        if device.type == "cuda":
            sources["pinned_host"] = _flat_copy(detached, "cpu", pin=True)
        del detached
        results: dict[str, float] = {}
        for source_name, source in sources.items():
            times = wall_time_ms(lambda s=source, e=expected: policy.sync_weights(s, expected=e), iters, 2, device)
            results[source_name] = statistics.median(times)
            rows.append(
                {
                    **base,
                    "case": f"sync_from_{source_name}",
                    "p50_ms": round(statistics.median(times), 3),
                    "p90_ms": round(sorted(times)[int(0.9 * (len(times) - 1))], 3),
                    "target_ms": TARGET_MS[subset] if source_name == "device" else None,
                }
            )
        # raw copies of the same bytes, one contiguous buffer each: the floor a sync is judged against
        flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        flat_dst = torch.empty_like(flat_dev)
        raw = {"raw_device_copy": (flat_dst, flat_dev)}
        if device.type == "cuda":
            raw["raw_host_to_device_copy"] = (flat_dst, torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        for case, (dst, src) in raw.items():
            times = wall_time_ms(lambda d=dst, s=src: d.copy_(s, non_blocking=True), iters, 2, device)
            results[case] = statistics.median(times)
            rows.append(
                {
                    **base,
                    "case": case,
                    "p50_ms": round(statistics.median(times), 3),
                    "p90_ms": round(sorted(times)[int(0.9 * (len(times) - 1))], 3),
                    "GB_per_s": round(nbytes / (statistics.median(times) * 1e-3) / 1e9, 1),
                }
            )
        if "pinned_host" in results:
            ratio = results["pinned_host"] / results["raw_host_to_device_copy"]
            rows.append(
                {
                    **base,
                    "case": "pinned_sync_over_raw_h2d",
                    "ratio": round(ratio, 3),
                    "target_ratio": PINNED_RATIO_TARGET,
                    "meets_target": ratio <= PINNED_RATIO_TARGET,
                }
            )
        del sources, gpu_source, raw, flat_dev, flat_dst
        if device.type == "cuda":
            torch.cuda.empty_cache()
    policy.close()
    _append_rows(out_path, rows)
    return rows


def profile_sync(
    out_path: str | Path, config_name: str = "base", reps: int = 3, trace_dir: str | Path | None = None
) -> list[dict[str, Any]]:
    """Where a sync's time goes: torch.profiler over `reps` syncs of the expert set from GPU and pinned sources.

    Rows give the wall time per sync, the GPU busy time per sync (kernels + copies), and the top host ops by
    self CPU time and top GPU activities, so host overhead and GPU work can be told apart. With `trace_dir`,
    each source's chrome trace is written there as `sync_trace_{source}.json.gz`.
    """
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    policy = build_policy(config_name, device)
    params = {n: p.detach() for n, p in policy.trainable_parameters()}
    sources = {"device": _flat_copy(params, device, pin=False), "pinned_host": _flat_copy(params, "cpu", pin=True)}
    rows = []
    for name, source in sources.items():
        for _ in range(2):
            policy.sync_weights(source)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(reps):
                policy.sync_weights(source)
                torch.cuda.synchronize()
            wall = (time.perf_counter() - start) * 1e3 / reps
        if trace_dir is not None:
            prof.export_chrome_trace(str(Path(trace_dir) / f"sync_trace_{name}.json.gz"))
        events = prof.key_averages()
        cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]
        gpu = sorted(events, key=lambda e: -getattr(e, "self_device_time_total", 0))[:10]
        gpu_busy = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3 / reps
        rows.append({
            "bench": "weight_sync", "kind": "profile", "config": config_name, "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "commit": git_commit(), "source": name, "subset": "expert",
            "wall_ms_per_sync": round(wall, 3), "gpu_busy_ms_per_sync": round(gpu_busy, 3),
            "top_cpu": [{"op": e.key[:80], "self_ms": round(e.self_cpu_time_total / 1e3 / reps, 3),
                         "calls": e.count // reps} for e in cpu],
            "top_gpu": [{"op": e.key[:80], "ms": round(getattr(e, "self_device_time_total", 0) / 1e3 / reps, 3),
                         "calls": e.count // reps} for e in gpu],
        })  # fmt: skip
    policy.close()
    _append_rows(out_path, rows)
    return rows


def phase_times(out_path: str | Path, config_name: str = "base", iters: int = 10) -> list[dict[str, Any]]:
    """Host time of each phase of an in-process sync (begin, update, finish) and the time to the synchronize after
    it, p50 over `iters`, for the expert set, then all parameters, then the expert set again (an order effect, such
    as the staging buffers of one set given back for the other's, shows as a difference between the two expert
    rounds)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy = build_policy(config_name, device)
    sets = {
        "trainable": {n: p.detach() for n, p in policy.trainable_parameters()},
        "all": {n: p.detach() for n, p in policy.model.named_parameters()},
    }
    sources = {k: _flat_copy(v, device, pin=False) for k, v in sets.items()}
    rows = []
    for expected in ("trainable", "all", "trainable"):
        source, marks = sources[expected], []
        for i in range(iters + 2):
            t0 = time.perf_counter()
            policy.begin_weight_update(expected)
            t1 = time.perf_counter()
            policy.update_weights(source)
            t2 = time.perf_counter()
            policy.finish_weight_update()
            t3 = time.perf_counter()
            synchronize(device)
            t4 = time.perf_counter()
            if i >= 2:
                marks.append([(b - a) * 1e3 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t0, t4))])
        p50 = [round(statistics.median(col), 3) for col in zip(*marks)]
        rows.append({
            "bench": "weight_sync", "kind": "phases", "config": config_name, "gpu": torch.cuda.get_device_name(device)
            if device.type == "cuda" else "cpu", "torch": torch.__version__, "commit": git_commit(),
            "expected": expected, "begin_ms": p50[0], "update_ms": p50[1], "finish_ms": p50[2],
            "sync_after_ms": p50[3], "total_ms": p50[4],
        })  # fmt: skip
    policy.close()
    _append_rows(out_path, rows)
    return rows


def host_overhead_config() -> Pi05Config:
    """pi05_base's tensor count and names (depths 18 / 18 / 27) at tiny sizes (a 1,024-row vocabulary)."""
    tiny = Pi05Config.tiny()
    return Pi05Config.tiny(
        vision=replace(tiny.vision, depth=27),
        llm=replace(tiny.llm, depth=18),
        expert=replace(tiny.expert, depth=18),
        vocab_size=1024,
    )


def run_host_overhead(
    out_path: str | Path | None, iters: int = 20, baseline: dict[str, float] | None = None
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Host time of begin + update + finish on CPU for every (subset, source); returns (rows, p50 by label)."""
    torch.manual_seed(0)
    config = host_overhead_config()
    model = Pi05Model(config)
    slots = tuple(range(len(config.camera_slots)))
    sched = SchedulerConfig(max_batch_size=1, num_steps=(config.num_steps,), camera_sets=(slots,), prompt_buckets=(16,))
    rollout = RolloutConfig(num_steps=config.num_steps, action_chunk=min(5, config.action_horizon))
    policy = Pi05Policy(model, _Processor(slots, (16,)), rollout, sched)
    trainer = copy.deepcopy(policy.model)
    device = torch.device("cpu")
    meta = {
        "bench": "weight_sync",
        "kind": "host_overhead",
        "device": "cpu",
        "torch": torch.__version__,
        "commit": git_commit(),
        "threads": torch.get_num_threads(),
        "iters": iters,
    }
    rows: list[dict[str, Any]] = []
    p50s: dict[str, float] = {}
    for subset, expected in (("expert", "trainable"), ("all", "all")):
        params = dict(policy.trainable_parameters()) if subset == "expert" else dict(policy.model.named_parameters())
        detached = {n: p.detach() for n, p in params.items()}
        sources: dict[str, Any] = {
            "module": trainer,
            "state_dict": {n: t.clone() for n, t in detached.items()},
            "flat_host": _flat_copy(detached, "cpu", pin=False),  # what a pinned-host source looks like on CPU
        }
        for source_name, source in sources.items():
            label = f"{subset}/{source_name}"
            times = wall_time_ms(lambda s=source, e=expected: policy.sync_weights(s, expected=e), iters, 3, device)
            p50 = statistics.median(times)
            p50s[label] = p50
            row = {
                **meta,
                "label": label,
                "tensors": len(params),
                "p50_ms_after": round(p50, 3),
                "p90_ms_after": round(sorted(times)[int(0.9 * (len(times) - 1))], 3),
            }
            if baseline is not None and label in baseline:
                row["p50_ms_before"] = round(baseline[label], 3)
                row["speedup"] = round(baseline[label] / p50, 2)
            rows.append(row)
    policy.close()
    if out_path is not None:
        _append_rows(out_path, rows)
    return rows, p50s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=("tiny", "base"), default="base")
    parser.add_argument("--out", default=None, help="folder for the <bench>.jsonl files (default: results/)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--host-overhead", action="store_true", help="CPU host-overhead mode (see the docstring)")
    parser.add_argument("--baseline", default=None, help="--host-overhead: JSON of p50s to report as 'before'")
    parser.add_argument("--save-baseline", default=None, help="--host-overhead: write this run's p50s here")
    args = parser.parse_args()
    if args.host_overhead:
        torch.set_num_threads(1)
        baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else None
        out = None if args.save_baseline else (args.out or RESULTS)
        rows, p50s = run_host_overhead(out, args.iters or 20, baseline)
        if args.save_baseline:
            Path(args.save_baseline).write_text(json.dumps(p50s))
        for row in rows:
            print(json.dumps(row))
        return
    for row in run(args.out, args.config, args.iters or 10):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
