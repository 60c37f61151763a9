"""Every GPU test and measurement of the project in one call (device time is scarce).

    python -m benchmarks.gpu_suite --out $OUT [--sections tests model policy rollout sync processor ...]

Each section runs in isolation (a failure is recorded in ``gpu_suite.jsonl`` and ``error_<section>.txt`` and the
suite goes on) and appends rows to ``$OUT/<bench>.jsonl``, the same names as under ``benchmarks/results/``;
pytest output goes to ``$OUT/pytest_cuda.log``. Afterwards ``python -m benchmarks.summary --merge <copy of $OUT>``
appends the rows to ``benchmarks/results/`` and regenerates ``SUMMARY.md`` (logs and traces stay out of git).

A section is a function of the output folder: add one to `SECTIONS` (usually ``section("benchmarks.bench_x")``,
which imports the script when the section runs and calls its ``run(out)``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ROOT, write_rows

Section = Callable[[Path], Any]


def section(module: str, function: str = "run", **kwargs: Any) -> Section:
    """A section that imports `module` when it runs and calls ``module.function(out, **kwargs)``."""

    def run(out: Path) -> Any:
        return getattr(importlib.import_module(module), function)(out, **kwargs)

    run.__doc__ = f"{module}.{function}(out, **{kwargs})"
    return run


def _subprocess_env() -> dict[str, str]:
    """This environment with the repository root on PYTHONPATH (for ``python -m benchmarks.*`` children)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def cuda_tests(out: Path) -> None:
    """CUDA tests and Triton interpreter runs under tests/policies and tests/wrappers; one ``cuda_tests`` row."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda or interpreter", "-p", "no:cacheprovider",
           "tests/policies", "tests/wrappers"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=_subprocess_env())
    (out / "pytest_cuda.log").write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    write_rows("gpu_suite", [{"kind": "cuda_tests", "returncode": proc.returncode, "summary": tail}], out)


def weight_sync(out: Path) -> None:
    """In-process weight sync: host time per phase, latency from GPU and pinned sources, a profiled sync."""
    from benchmarks import bench_weight_sync

    bench_weight_sync.phase_times(out, "base")
    bench_weight_sync.run(out, "base")
    bench_weight_sync.profile_sync(out, "base", trace_dir=out)


def broadcast(out: Path) -> None:
    """Rank 0 -> rank 1 weight broadcast against raw NCCL (needs 2 GPUs; torchrun in a subprocess): the default
    bucket size (with GPU-only chrome traces of one more broadcast per rank), 9 buckets of ~123 MB, and the
    default on a process group with high-priority NCCL streams."""
    if torch.cuda.device_count() < 2:
        write_rows("gpu_suite", [{"section": "broadcast", "status": f"not run: {torch.cuda.device_count()} GPU(s), "
                                  "needs 2"}], out)  # fmt: skip
        return
    runs = (  # constant argv lists, run in `out` (rows and traces land there)
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "benchmarks.bench_broadcast",
         "--out", ".", "--iters", "30", "--trace-dir", ".", "--gpu-only-trace"],
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "benchmarks.bench_broadcast",
         "--out", ".", "--iters", "30", "--buckets", "9"],
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "benchmarks.bench_broadcast",
         "--out", ".", "--iters", "30", "--high-priority"],
    )  # fmt: skip
    logs = []
    for cmd in runs:
        proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=300, env=_subprocess_env())
        logs.append(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            break
    (out / "broadcast.log").write_text("\n".join(logs))
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}; see broadcast.log")


def profile(out: Path) -> None:
    """Where the time goes: the expert-attention crossover, then per-kernel time of every replay by class."""
    from benchmarks import bench_expert_attention, profile_policy

    bench_expert_attention.run(out)
    profile_policy.run(out)


SECTIONS: dict[str, Section] = {
    "tests": cuda_tests,
    "model": section("benchmarks.bench_model_eager"),
    "policy": section("benchmarks.bench_policy"),
    "rollout": section("benchmarks.bench_policy", "run_rollout"),
    "sync": weight_sync,
    "startup": section("benchmarks.bench_startup"),
    "ratio": section("benchmarks.bench_ratio"),
    "policy_quick": section("benchmarks.bench_policy", "run_quick"),
    "policy_targets": section("benchmarks.bench_policy", "run_targets"),
    "public": section("benchmarks.bench_policy", "run_public"),
    "wrapper": section("benchmarks.bench_wrapper", device="cuda", cameras=(3,), iters=10),
    "soak": section("benchmarks.soak_gpu"),
    "processor": section("benchmarks.bench_processor", device="cuda"),
    "profile": profile,
    "kernels": section("benchmarks.bench_kernels"),
    "kernel_counts": section("benchmarks.bench_kernels", "kernel_counts"),
    "kernels_agreement": section("benchmarks.bench_kernels", "agreement"),
    "broadcast": broadcast,
    "overlap": section("benchmarks.bench_overlap"),
    "batch_invariance": section("benchmarks.bench_batch_invariance"),
    "ppo": section("benchmarks.bench_ppo"),
    "attention_backend": section("benchmarks.bench_attention_backend"),
    "attention_expert": section("benchmarks.bench_attention_backend", sites=("expert",)),
    "attention_tune": section("benchmarks.bench_attention_backend", "tune"),
    "prefix_parts": section("benchmarks.bench_prefix_parts"),
    "profile_a1": section("benchmarks.profile_policy", plan=(("a", (1,)),)),
    "profile_targets": section("benchmarks.profile_policy", plan=(("a", (1, 64)), ("b", (64,))), copies=True),
    "attention_lm": section("benchmarks.bench_attention_backend", sites=("prefix", "expert")),
    "attention_variants": section("benchmarks.bench_attention_variants"),
    "timeline": section("benchmarks.profile_policy", "call_timeline"),
}
"""Section name -> function of the output folder, in the order ``--sections`` defaults to."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the <bench>.jsonl files and logs")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS), metavar="SECTION",
                        help=f"default: all of {' '.join(SECTIONS)}")  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.sections:
        start = time.perf_counter()
        try:
            SECTIONS[name](args.out)
            status = "ok"
        except Exception as err:  # noqa: BLE001 - record and go on
            status = f"failed: {type(err).__name__}: {err}"
            (args.out / f"error_{name}.txt").write_text(traceback.format_exc())
        write_rows("gpu_suite", [{"section": name, "status": status, "seconds": round(time.perf_counter() - start, 1)}],
                   args.out)  # fmt: skip
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
