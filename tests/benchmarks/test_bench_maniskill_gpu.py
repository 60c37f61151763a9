"""The host-side helpers of benchmarks/bench_maniskill_gpu.py (the benchmark itself runs on the GPU machine)."""

import json

import torch

from benchmarks.bench_maniskill_gpu import CallTimer, _memcpy_summary


def test_memcpy_summary_counts_host_device_copies_by_direction(tmp_path):
    events = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "args": {"correlation": 1}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "args": {"bytes": 64}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "args": {"bytes": 4}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "args": {"bytes": 8}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "args": {"bytes": 150528}},
        {"ph": "X", "cat": "kernel", "name": "elementwise_kernel"},
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    assert _memcpy_summary(trace) == {
        "HtoD": {"count": 1, "max_bytes": 64, "total_bytes": 64},
        "DtoH": {"count": 2, "max_bytes": 8, "total_bytes": 12},
        "DtoD": {"count": 1, "max_bytes": 150528, "total_bytes": 150528},
    }


def test_call_timer_times_each_call_and_take_clears():
    class Env:
        def step(self, x):
            return x + 1

    env, timer = Env(), CallTimer(torch.device("cpu"))
    timer.wrap(env, "step", "env")
    assert env.step(1) == 2 and env.step(2) == 3
    totals = timer.take()
    assert set(totals) == {"env"} and totals["env"] >= 0 and timer.step_ms["env"] == []
    del env.step  # the instance attribute goes, the class method is back
    assert env.step(5) == 6 and timer.step_ms["env"] == []
