"""Cross-GPU weight broadcast (DESIGN C6) against raw NCCL bandwidth, rank 0 (trainer) -> rank 1 (rollout policy).

    torchrun --nproc_per_node 2 -m benchmarks.bench_broadcast [--out DIR] [--config base|tiny]
    torchrun --nproc_per_node 2 -m benchmarks.bench_broadcast --config host --buckets 17
    torchrun --nproc_per_node 2 -m benchmarks.bench_broadcast --trace-dir traces/

`--config host` (CPU, gloo) uses pi05_base's tensor count and names at tiny sizes, so what is timed is the
protocol's host work and the transfers; `--buckets N` sets the bucket size to give N buckets (17 is what the
expert set takes in 64-MiB buckets at full size).

Rank 0 holds a trainer model (no policy); rank 1 a `Pi05Policy`. Measured in the same run: a plain
`dist.broadcast` of one flat buffer with the bytes of the expert + heads, and `broadcast_weights` of the same
parameters (manifest as tensors, bounded buckets, validation, vote, commit). Each rank times from a common
barrier to its own end (rank 1 after its commit ran on its GPU); the row reports the slowest rank per
iteration (and each rank's p50), for the raw broadcast too. Rank 0 appends the row to ``weight_broadcast.jsonl``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import ModelProcessor as _Processor
from benchmarks.common import write_rows
from policies.pi05.broadcast import DEFAULT_BUCKET_BYTES, broadcast_weights
from policies.pi05.config import Pi05Config
from policies.pi05.model import Pi05Model
from policies.pi05.policy import Pi05Policy, RolloutConfig
from policies.pi05.scheduler import SchedulerConfig


def _p50(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for weight_broadcast.jsonl (default: results/)")
    parser.add_argument("--config", choices=("base", "tiny", "host"), default="base")
    parser.add_argument("--buckets", type=int, default=None, help="bucket size for about this many buckets")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--trace-dir", type=Path, default=None,
                        help="after timing, profile one more broadcast on every rank and write its chrome trace here")
    parser.add_argument("--gpu-only-trace", action="store_true",
                        help="the trace records GPU activity only (host timing then stays close to an untraced run)")
    parser.add_argument("--high-priority", action="store_true",
                        help="NCCL process group on high-priority streams (ProcessGroupNCCL.Options)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    options = None
    if cuda and args.high_priority:
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True
    dist.init_process_group("nccl" if cuda else "gloo", pg_options=options)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.config == "base":
        cfg = Pi05Config.pi05_base(action_horizon=10, num_steps=5)
    elif args.config == "host":
        from benchmarks.bench_weight_sync import host_overhead_config

        cfg = host_overhead_config()
    else:
        cfg = Pi05Config.tiny()
    with torch.device(device):
        model = Pi05Model(cfg)
    model.set_precision(torch.bfloat16 if cuda else torch.float32)
    policy = None
    if rank != 0:
        sched = SchedulerConfig(max_batch_size=1, prompt_buckets=(16,), num_steps=(cfg.num_steps,),
                                camera_sets=((0,),), cuda_graphs=False)
        policy = Pi05Policy(model, _Processor((0,), (16,)), RolloutConfig(num_steps=cfg.num_steps, action_chunk=5),
                            sched)
    # The trainable set of the rollout policy (expert + projections + time MLP + heads), on the trainer side.
    trainable = {n for n, p in model.named_parameters() if _is_trainable(n)}
    source = {n: p for n, p in model.named_parameters() if n in trainable}
    nbytes = sum(p.numel() * p.element_size() for p in source.values())
    bucket = DEFAULT_BUCKET_BYTES if args.buckets is None else max(16, -(-nbytes // args.buckets))
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw, synced = [], []
    sync = policy.weight_sync if policy is not None else None
    for it in range(args.iters + 1):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.broadcast(flat, src=0)
        if cuda:
            torch.cuda.synchronize()
        if it:
            raw.append((time.perf_counter() - t0) * 1e3)
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        report = broadcast_weights(sync, source if rank == 0 else None, expected="trainable", bucket_bytes=bucket)
        if cuda:
            torch.cuda.synchronize()
        if it:
            synced.append((time.perf_counter() - t0) * 1e3)
    if args.trace_dir is not None:  # one profiled broadcast per rank: where the time beyond raw NCCL goes
        from torch.profiler import ProfilerActivity, profile

        activities = [] if args.gpu_only_trace and cuda else [ProfilerActivity.CPU]
        activities += [ProfilerActivity.CUDA] if cuda else []
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            broadcast_weights(sync, source if rank == 0 else None, src=0, expected="trainable", bucket_bytes=bucket)
            if cuda:
                torch.cuda.synchronize()
        args.trace_dir.mkdir(parents=True, exist_ok=True)
        kind = "gpu_" if args.gpu_only_trace and cuda else ""
        prof.export_chrome_trace(str(args.trace_dir / f"broadcast_{kind}trace_rank{rank}.json.gz"))
    # every rank's times: a broadcast is done when the slowest rank is (rank 1 has committed on its GPU)
    times = torch.zeros(2, dist.get_world_size(), len(synced), dtype=torch.float64, device=device)
    times[0, rank] = torch.tensor(raw, dtype=torch.float64)
    times[1, rank] = torch.tensor(synced, dtype=torch.float64)
    dist.all_reduce(times)
    raw_slowest = times[0].max(0).values.tolist()
    slowest = times[1].max(0).values.tolist()
    per_rank = [_p50(times[1, r].tolist()) for r in range(dist.get_world_size())]
    version = torch.tensor([policy.weight_version if policy is not None else -1], device=device)
    dist.all_reduce(version, op=dist.ReduceOp.MAX)
    if rank == 0:
        row = {"config": args.config, "world_size": dist.get_world_size(),
               "backend": dist.get_backend(), "tensors": len(source), "bytes": nbytes,
               "raw_broadcast_p50_ms": _p50(raw_slowest), "raw_GB_per_s": nbytes / _p50(raw_slowest) / 1e6,
               "broadcast_weights_p50_ms": _p50(slowest), "ratio_to_raw": _p50(slowest) / _p50(raw_slowest),
               "broadcast_weights_p50_ms_per_rank": per_rank,
               "bucket_bytes": bucket, "high_priority": args.high_priority,
               "target_ratio": 2.5,
               "final_version": int(version.item()),
               "report_tensors": report.num_tensors}
        write_rows("weight_broadcast", [row], args.out)
    dist.barrier()
    dist.destroy_process_group()


def _is_trainable(name: str) -> bool:
    return name.startswith(("expert.", "action_in_proj", "action_out_proj", "time_mlp", "value_head", "noise_head"))


if __name__ == "__main__":
    main()
