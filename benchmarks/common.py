"""What every benchmark script shares: result rows, timing, percentiles and the machine a row was measured on.

Rows go to one append-only JSONL per benchmark, ``benchmarks/results/<bench>.jsonl`` (or ``<out>/<bench>.jsonl``
when a script is given ``--out DIR``, as on the GPU machine), each with the GPU, torch version, commit and date
beside the script's own configuration and measurements. ``python -m benchmarks.summary`` turns them into
``results/SUMMARY.md``.

Run the scripts as modules from the repository root (``python -m benchmarks.bench_policy --help``) or with the root
on ``PYTHONPATH``.

The policy-side helpers at the end (`ModelProcessor`, `make_inputs`, `build_case_policy`, `build_pi05`) build the
random-weight policies the measurements share; they import the project lazily, so `bench_lerobot.py` can use the
row writer without it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from phyai_gym.evaluation import project_commit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

CASES: dict[str, dict[str, Any]] = {
    "a": dict(cams=(0, 1, 2), prompt=200, num_steps=10, horizon=50, chunk=50),
    "b": dict(cams=(0, 1), prompt=48, num_steps=5, horizon=10, chunk=5),
    "phyai": dict(cams=(0, 1, 2), prompt=16, num_steps=10, horizon=50, chunk=50),
}
"""The two DESIGN C8 cases: (a) 3 cameras / 200 tokens / K=10 / H=50, (b) the LIBERO RL setting; and "phyai", the
seed system's published configuration (its harness's 1-token prompt in the 16-token bucket, 784 prefix tokens)."""


# ------------------------------------------------------------------------------------------------- rows
def git_commit() -> str:
    """The measured commit (`phyai_gym.evaluation.project_commit`: ``PHYAI_GYM_COMMIT`` if set, else git's HEAD)."""
    return project_commit()


def environment() -> dict[str, Any]:
    """Where and when a row was measured: GPU (or ``cpu``), GPU count, torch, commit, UTC date, host CPUs, threads."""
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": f"{platform.machine()} x{os.cpu_count()}",
        "torch_threads": torch.get_num_threads(),
    }


def results_path(bench: str, out: str | Path | None = None) -> Path:
    """The JSONL of `bench`: ``results/<bench>.jsonl``, ``<out>/<bench>.jsonl`` for a folder, `out` for a file."""
    if out is None:
        return RESULTS / f"{bench}.jsonl"
    out = Path(out)
    return out if out.suffix == ".jsonl" else out / f"{bench}.jsonl"


def append_jsonl(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Append `rows` to `path` as JSON lines (its folder made if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def write_rows(
    bench: str, rows: Iterable[Mapping[str, Any]], out: str | Path | None = None, echo: bool = True
) -> list[dict[str, Any]]:
    """Append `rows` of benchmark `bench` to its JSONL (see `results_path`) with `environment()` fields added.

    A row's own fields win over the environment's (a row measured elsewhere keeps its ``gpu`` and ``commit``).
    Returns the rows as written; `echo` also prints each one.

    Example:
        >>> rows = write_rows("demo", [{"case": "x", "p50_ms": 1.0}], "/tmp/phyai_demo", echo=False)
        >>> rows[0]["bench"], "commit" in rows[0]
        ('demo', True)
    """
    env = environment()
    full = [{"bench": bench, **env, **dict(row)} for row in rows]
    for row in full:
        if echo:
            print(json.dumps(row), flush=True)
    append_jsonl(results_path(bench, out), full)
    return full


def run_cli(run: Callable[[Path | None], Any], bench: str, doc: str) -> None:
    """Command line of a script whose one option is ``--out DIR``: parse it and call ``run(out)``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help=f"folder for {bench}.jsonl (default: results/)")
    run(parser.parse_args().out)


# ----------------------------------------------------------------------------------------------- timing
def percentiles(samples: Sequence[float]) -> tuple[float, float]:
    """(p50, p90) by nearest rank: the middle sample and the one at 90 % of the sorted list."""
    if not samples:
        raise ValueError("percentiles: expected at least one sample, got none.")
    s = sorted(samples)
    return float(s[len(s) // 2]), float(s[min(len(s) - 1, int(0.9 * len(s)))])


def synchronize(device: str | torch.device | None = None) -> None:
    """Wait for the GPU when `device` is a CUDA device (no-op on CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def graph_time_us(fn: Callable[[], Any], calls: int = 20, reps: int = 10) -> float:
    """GPU time in us of one call of `fn`: `calls` calls captured in one CUDA graph (no launch overhead), the median
    of `reps` replays."""
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def cuda_time_ms(fn: Callable[[], Any], iters: int, warmup: int = 2) -> list[float]:
    """GPU time of each of `iters` calls of `fn` between CUDA events on the current stream (warm-up excluded)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def wall_time_ms(
    fn: Callable[[], Any], iters: int, warmup: int = 2, device: str | torch.device | None = None
) -> list[float]:
    """Host wall time of each of `iters` calls of `fn`, each ended by a synchronize of `device` (warm-up excluded)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


# ------------------------------------------------------------------------------------------ policy side
class ModelProcessor:
    """The processor fields `Pi05Policy` reads, for model-side benchmarks fed already processed inputs.

    Args:
        slots: camera slots the inputs fill.
        buckets: prompt lengths the scheduler declares.
        action_dim: environment action size the outputs are cut to.

    Example:
        >>> ModelProcessor((0, 1), (48,)).prompt_buckets
        (48,)
    """

    def __init__(self, slots: Sequence[int], buckets: Sequence[int], action_dim: int = 7) -> None:
        self.slots = tuple(slots)
        self.action_dim = action_dim
        self.prompt_buckets = tuple(buckets)

    def postprocess(self, model_actions: torch.Tensor, chunk: int) -> torch.Tensor:
        """The first `chunk` actions of the first `action_dim` dimensions, as float32."""
        return model_actions[:, :chunk, : self.action_dim].float()


def make_inputs(n: int, cams: Sequence[int], prompt: int, image_size: int, device: str | torch.device) -> Any:
    """`ModelInputs` of `n` samples: random uint8 images for `cams` and a fully valid `prompt`-token prompt."""
    from policies.pi05.inputs import ModelInputs

    gen = torch.Generator().manual_seed(n)
    images = torch.randint(0, 256, (n, len(cams), 3, image_size, image_size), generator=gen, dtype=torch.uint8)
    tokens = torch.randint(3, 30000, (n, prompt), generator=gen, dtype=torch.int32)
    tokens[:, 0] = 2
    return ModelInputs(
        images=images.to(device),
        image_mask=torch.ones(n, len(cams), dtype=torch.bool, device=device),
        slots=tuple(cams),
        tokens=tokens.to(device),
        lengths=torch.full((n,), prompt, dtype=torch.int32, device=device),
    )


def build_case_policy(
    case: Mapping[str, Any],
    batches: Sequence[int],
    method: str,
    value_source: str,
    fused_kernels: bool = True,
    config_overrides: Mapping[str, Any] | None = None,
) -> Any:
    """Full-size random-weight `Pi05Policy` with graphs for one of `CASES` at `batches`, on CUDA if present.

    `fused_kernels` is `SchedulerConfig.fused_kernels`; `config_overrides` replace `Pi05Config` fields (e.g. a
    shallower `llm`/`expert` for per-layer kernel counts).
    """
    from policies.pi05.config import Pi05Config
    from policies.pi05.model import Pi05Model, torch_dtype
    from policies.pi05.policy import Pi05Policy, RolloutConfig
    from policies.pi05.scheduler import SchedulerConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = Pi05Config.pi05_base(action_horizon=case["horizon"], num_steps=case["num_steps"], value_source=value_source,
                               **(config_overrides or {}))  # fmt: skip
    with torch.device(device):
        model = Pi05Model(cfg)
    model.set_precision(torch_dtype(cfg.dtype))
    sched = SchedulerConfig(
        max_batch_size=max(batches), batch_buckets=tuple(sorted(set(batches))), prompt_buckets=(case["prompt"],),
        num_steps=(case["num_steps"],), camera_sets=(tuple(case["cams"]),), fused_kernels=fused_kernels,
    )  # fmt: skip
    rollout = RolloutConfig(method=method, num_steps=case["num_steps"], action_chunk=case["chunk"])
    return Pi05Policy(model, ModelProcessor(case["cams"], (case["prompt"],)), rollout, sched)


def build_pi05(
    config_name: str,
    device: torch.device,
    camera_map: Mapping[str, str],
    batches: Sequence[int],
    num_steps: int,
    horizon: int,
    chunk: int,
    state_dim: int = 8,
    action_dim: int = 7,
) -> Any:
    """Random-weight PI0.5 from observations (tiny fp32 or full-size bf16), stand-in tokenizer, unit state stats."""
    import numpy as np

    from policies.pi05.config import Pi05Config
    from policies.pi05.normalize import NormStats
    from policies.pi05.policy import Pi05Policy, RolloutConfig
    from policies.pi05.processor import Pi05Processor
    from policies.pi05.scheduler import SchedulerConfig

    overrides = dict(action_horizon=horizon, num_steps=num_steps, max_token_len=48)
    if config_name == "tiny":
        config, dtype = Pi05Config.tiny(**overrides), "float32"
    elif config_name == "base":
        config, dtype = Pi05Config.pi05_base(**overrides), "bfloat16"
    else:
        raise ValueError(f"config_name: expected 'tiny' or 'base', got {config_name!r}.")
    stats = NormStats(mean=np.zeros(state_dim), std=np.ones(state_dim), q01=-np.ones(state_dim), q99=np.ones(state_dim))
    processor = Pi05Processor.for_config(
        config, action_dim=action_dim, device=device, tokenizer="phyai-standin", camera_map=dict(camera_map),
        state_stats=stats,
    )  # fmt: skip
    scheduler = SchedulerConfig(
        max_batch_size=max(batches), batch_buckets=tuple(sorted(set(batches))),
        prompt_buckets=tuple(processor.prompt_buckets), num_steps=(num_steps,), camera_sets=(tuple(processor.slots),),
        cuda_graphs=device.type == "cuda",
    )  # fmt: skip
    rollout = RolloutConfig(method="sde", num_steps=num_steps, action_chunk=chunk)
    return Pi05Policy.from_config(
        config, processor, action_dim=action_dim, device=device, dtype=dtype, seed=0, rollout=rollout,
        scheduler=scheduler,
    )  # fmt: skip
