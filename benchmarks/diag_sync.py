"""Temporary diagnostic: where does an in-process expert sync spend its time on the GPU (see e82c118)."""

import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_weight_sync import _flat_copy, build_policy  # noqa: E402


def clocks() -> str:
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()


def main() -> None:
    policy = build_policy("base", torch.device("cuda"))
    params = {n: p.detach() for n, p in policy.trainable_parameters()}
    source = _flat_copy(params, "cuda", pin=False)
    for variant in ("plain", "release_each", "spin_before", "plain"):
        rows = []
        for _i in range(8):
            if variant == "release_each":
                policy.release_weight_staging()
            if variant == "spin_before":
                a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
                for _ in range(20):
                    a @ a
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            policy.begin_weight_update("trainable")
            t1 = time.perf_counter()
            txn = policy._weight_update
            s = txn.stream
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record(s)
            policy.update_weights(source)
            e1.record(s)
            t2 = time.perf_counter()
            e1.synchronize()
            t3 = time.perf_counter()
            policy.finish_weight_update()
            t4 = time.perf_counter()
            torch.cuda.synchronize()
            t5 = time.perf_counter()
            rows.append([(t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, e0.elapsed_time(e1), (t4 - t3) * 1e3,
                         (t5 - t4) * 1e3, (t5 - t0) * 1e3])
        p50 = [round(statistics.median(c), 3) for c in zip(*rows[2:])]
        print(variant, "begin, update host, wait staging, staging GPU span, finish, sync after, total:", p50,
              "| clocks", clocks(), flush=True)


def profile_finish() -> None:
    import cProfile
    import pstats

    policy = build_policy("base", torch.device("cuda"))
    params = {n: p.detach() for n, p in policy.trainable_parameters()}
    source = _flat_copy(params, "cuda", pin=False)
    for _ in range(3):
        policy.sync_weights(source)
    torch.cuda.synchronize()
    policy.begin_weight_update("trainable")
    policy.update_weights(source)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    policy.finish_weight_update()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    profile_finish()
    main()
