"""Counter-based random streams (DESIGN C3): batch-composition independence, distinctness, moments, ranges.

The hash kernel (`policies.rng_kernel`) is held bitwise to the PyTorch ops (`rng.bits_reference`) by Triton's
CPU interpreter, which needs triton installed and ``TRITON_INTERPRET=1`` set before import:

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python -m pytest -q tests/policies/test_rng.py

A plain pytest run with triton installed runs this file once more in such a subprocess (`test_interpreter_run`),
so every draw test below then goes through the kernel too; without triton (CI) the kernel tests skip. The
``cuda``-marked tests hold the compiled kernel to the same ops on the GPU, in and out of a CUDA graph.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from policies import rng, rng_kernel

SHAPE = (3, 4, 5)
STREAMS = (rng.STREAM_X0, rng.STREAM_XI, rng.STREAM_J, rng.STREAM_AUX)
HAS_TRITON = importlib.util.find_spec("triton") is not None
ROOT = Path(__file__).resolve().parents[2]
interpreted = pytest.mark.skipif(
    not rng_kernel.INTERPRETED,
    reason="runs once more under TRITON_INTERPRET=1 in test_interpreter_run's subprocess"
    if HAS_TRITON
    else "needs triton and TRITON_INTERPRET=1 at import (`pip install triton`: its CPU interpreter)",
)


def on_cuda(test: Callable) -> Callable:
    """A GPU test of the compiled kernel: marked `cuda` (benchmarks/gpu_suite.py runs them), else skipped."""
    test = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the kernel under test)")(test)
    test = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by gpu_suite)")(test)
    return pytest.mark.cuda(test)


# 64-bit seeds and counters around every 32-bit boundary, negative ones included
SEEDS = torch.tensor([0, 1, -1, -5, 2**31, 2**32 - 1, 2**32, 2**40 + 3, 2**63 - 1, -(2**63), 7, 123456789])
COUNTERS = torch.tensor([0, 3, 2**33, -1, 7, 2**32 + 1, 5, 2**63 - 1, -(2**63), 1, 2**32 - 1, 0])
# (N, numel, stream): one element, a row shorter than a block, rows straddling blocks, odd and 64-bit streams
CASES = [
    (1, 1, rng.STREAM_J),
    (12, 1, rng.STREAM_J),
    (12, 5, rng.STREAM_X0),
    (3, 1023, rng.STREAM_XI),
    (12, 1025, rng.STREAM_AUX),
    (5, 3200, rng.STREAM_XI),
    (12, 77, 0),
    (12, 77, -3),
    (12, 77, 2**31 + 5),
    (12, 77, 2**40 + 1),
]


def draw(seeds, counters, stream=rng.STREAM_X0, shape=SHAPE):
    return rng.normal(torch.as_tensor(seeds), torch.as_tensor(counters), stream, shape)


@pytest.mark.parametrize("stream", STREAMS)
def test_env_draws_do_not_depend_on_batch_composition(stream: int) -> None:
    seeds = torch.tensor([11, 5, 2**40 + 3, 0, 7])
    counters = torch.tensor([0, 3, 1, 9, 2**33])
    batch = draw(seeds, counters, stream)
    for i in range(len(seeds)):
        alone = draw(seeds[i : i + 1], counters[i : i + 1], stream)
        assert torch.equal(alone[0], batch[i])
    # padded with zero-seed rows (what the scheduler does) and reordered
    zeros = torch.zeros(3, dtype=torch.int64)
    padded = draw(torch.cat([seeds, zeros]), torch.cat([counters, zeros]), stream)
    assert torch.equal(padded[: len(seeds)], batch)
    perm = torch.tensor([3, 0, 4, 2, 1])
    assert torch.equal(draw(seeds[perm], counters[perm], stream), batch[perm])
    # duplicated rows are identical
    dup = draw(seeds[[1, 1]], counters[[1, 1]], stream)
    assert torch.equal(dup[0], dup[1])
    # uniforms and randint too
    u = rng.uniform(seeds, counters, stream, (6,))
    assert torch.equal(rng.uniform(seeds[perm], counters[perm], stream, (6,)), u[perm])
    j = rng.randint(seeds, counters, stream, 7)
    assert torch.equal(rng.randint(seeds[perm], counters[perm], stream, 7), j[perm])


def test_seeds_counters_and_streams_give_different_draws() -> None:
    base = draw([5], [0])[0]
    others = {
        "seed+1": draw([6], [0])[0],
        "counter+1": draw([5], [1])[0],
        "high seed bits": draw([5 + 2**32], [0])[0],
        "high counter bits": draw([5], [2**32])[0],
        "negative seed": draw([-5], [0])[0],
        "stream": draw([5], [0], rng.STREAM_XI)[0],
    }
    for name, other in others.items():
        # independent N(0,1) draws: agreement of even one element of 60 would be a hash failure
        assert (other != base).all(), name
        corr = torch.corrcoef(torch.stack([base.flatten(), other.flatten()]))[0, 1]
        assert abs(corr) < 0.5, name
    # all pairwise different over a grid of (seed, counter)
    grid = draw(torch.arange(20).repeat_interleave(20), torch.arange(20).repeat(20), shape=(8,))
    assert torch.unique(grid[:, 0]).numel() == 400
    # the first elements of the two Box-Muller halves are not tied to each other
    assert not torch.equal(grid[:, 0], grid[:, 4])


def test_normal_moments() -> None:
    n_env, numel = 64, 4096
    z = rng.normal(torch.arange(n_env) * 7919 + 3, torch.arange(n_env) % 5, rng.STREAM_XI, (numel,)).double()
    assert z.dtype == torch.float64 and torch.isfinite(z).all()
    flat = z.flatten()
    n = flat.numel()
    mean, std = flat.mean().item(), flat.std().item()
    assert abs(mean) < 4 / math.sqrt(n)
    assert abs(std - 1) < 4 / math.sqrt(2 * n)
    skew = ((flat - mean) ** 3).mean().item() / std**3
    kurt = ((flat - mean) ** 4).mean().item() / std**4
    assert abs(skew) < 4 * math.sqrt(6 / n)
    assert abs(kurt - 3) < 4 * math.sqrt(24 / n)
    # tail mass beyond 2 sigma (~4.55 %) and a per-env mean check (no degenerate streams)
    tail = (flat.abs() > 2).double().mean().item()
    assert abs(tail - 0.0455) < 0.003
    assert (z.mean(dim=1).abs() < 5 / math.sqrt(numel)).all()
    # lag-1 autocorrelation within a stream
    lag = (z[:, 1:] * z[:, :-1]).mean().item()
    assert abs(lag) < 4 / math.sqrt(n)


def test_uniform_open_interval_and_float32() -> None:
    u = rng.uniform(torch.arange(32), torch.zeros(32, dtype=torch.int64), rng.STREAM_AUX, (2048,))
    assert u.dtype == torch.float32 and u.shape == (32, 2048)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.double().mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / u.numel())
    z = rng.normal(torch.arange(4), torch.zeros(4, dtype=torch.int64), rng.STREAM_AUX, (2, 3))
    assert z.dtype == torch.float32 and z.shape == (4, 2, 3)


def test_randint_range_and_uniformity() -> None:
    n = 20000
    seeds, counters = torch.arange(n), torch.full((n,), 3)
    j = rng.randint(seeds, counters, rng.STREAM_J, 5)
    assert j.dtype == torch.int64 and j.min() >= 0 and j.max() <= 4
    counts = torch.bincount(j, minlength=5).double()
    expected = n / 5
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 18.5  # chi2(4) 99.9 % quantile
    # per-env upper bounds (ignore_last uses K-1), high = 1 always gives 0
    high = torch.tensor([1, 2, 3, 10]).repeat(n // 4)
    jj = rng.randint(seeds, counters, rng.STREAM_J, high)
    assert (jj >= 0).all() and (jj < high).all()
    assert (jj[high == 1] == 0).all()
    for h in (2, 3, 10):
        assert torch.unique(jj[high == h]).numel() == h


def test_stream_table_take_set_and_grow() -> None:
    table = rng.StreamTable(torch.device("cpu"), size=2)
    table.set_seeds(torch.tensor([0, 1]), torch.tensor([100, 101]))
    s, c = table.take(torch.tensor([1]))
    assert (s.tolist(), c.tolist()) == ([101], [0])
    s, c = table.take(torch.tensor([1, 0]))
    assert (s.tolist(), c.tolist()) == ([101, 100], [1, 0])
    _, c = table.take(torch.tensor([0]), advance=False)
    assert c.tolist() == [1] and table.counters[0] == 1
    # growing keeps existing streams; new envs get seed = env id, counter 0
    s, c = table.take(torch.tensor([5]), upper=6)
    assert (s.tolist(), c.tolist()) == ([5], [0])
    assert table.seeds[:2].tolist() == [100, 101] and table.counters[:2].tolist() == [1, 2]
    # set_seeds resets counters
    table.set_seeds(torch.tensor([1]), torch.tensor([7]))
    assert table.take(torch.tensor([1]))[1].tolist() == [0]
    seeds, counters = table.state()
    seeds[0] = -1
    assert table.seeds[0] == 100


def test_kernel_serves_integer_vectors_only() -> None:
    served = HAS_TRITON and rng_kernel.INTERPRETED  # CPU tensors: only under the interpreter
    assert rng_kernel.serves(SEEDS, COUNTERS, 8) == served
    assert not rng_kernel.serves(SEEDS.double(), COUNTERS, 8)  # float seeds: the PyTorch ops truncate them
    assert not rng_kernel.serves(SEEDS, COUNTERS[:3], 8)
    assert not rng_kernel.serves(SEEDS[:4].view(2, 2), COUNTERS[:4].view(2, 2), 8)


# ------------------------------------------------------------------------------- the kernel (interpreter)
@pytest.mark.skipif(not HAS_TRITON or rng_kernel.INTERPRETED, reason="needs triton; runs this file interpreted")
@pytest.mark.interpreter
def test_interpreter_run() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda",
           "-k", "not test_interpreter_run", str(Path(__file__))]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def uniform_of(bits: torch.Tensor) -> torch.Tensor:
    """`rng.uniform`'s conversion of 32-bit values, as PyTorch ops."""
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal dtype, shape and bit pattern (float32 compared as its int32 bits)."""
    if got.dtype == torch.float32 and want.dtype == torch.float32:
        got, want = got.view(torch.int32), want.view(torch.int32)
    return got.dtype == want.dtype and torch.equal(got, want)


@interpreted
@pytest.mark.parametrize(("n", "numel", "stream"), CASES)
def test_kernel_bits_match_pytorch_ops(n: int, numel: int, stream: int) -> None:
    seeds, counters = SEEDS[:n], COUNTERS[:n]
    want = rng.bits_reference(seeds, counters, stream, numel)
    assert same_bits(rng_kernel.bits(seeds, counters, stream, numel), want)
    assert same_bits(rng_kernel.bits(seeds, counters, stream, numel, uniform=True), uniform_of(want))


@interpreted
def test_kernel_reads_any_integer_dtype_and_strides() -> None:
    seeds, counters = torch.arange(-20, 20, 3, dtype=torch.int32), torch.arange(14, dtype=torch.int32) * 99991
    for s, c in [(seeds, counters), (seeds.to(torch.int16), counters.to(torch.uint8)),
                 (SEEDS[::2], COUNTERS[1::2]), (SEEDS, torch.tensor(2**45 + 1).expand(len(SEEDS)))]:  # fmt: skip
        assert rng_kernel.serves(s, c, 50)
        assert same_bits(rng_kernel.bits(s, c, rng.STREAM_AUX, 50), rng.bits_reference(s, c, rng.STREAM_AUX, 50))
    empty = torch.zeros(0, dtype=torch.int64)
    assert rng_kernel.bits(empty, empty, rng.STREAM_X0, 7).shape == (0, 7)
    assert rng.normal(SEEDS, COUNTERS, rng.STREAM_X0, (0, 3)).shape == (len(SEEDS), 0, 3)


def draws(seeds: torch.Tensor, counters: torch.Tensor, python_high: bool = True) -> list[torch.Tensor]:
    """What a rollout draws (`sampler.draw_noise`, `sampler.controls`), plus odd shapes and per-env bounds.

    `python_high`: also a randint with a Python bound (its host-to-device copy cannot be captured in a graph).
    """
    device = seeds.device
    out = [
        rng.normal(seeds, counters, rng.STREAM_X0, (50, 32)),
        rng.normal(seeds, counters, rng.STREAM_XI, (10, 50, 32)),
        rng.normal(seeds, counters, rng.STREAM_AUX, (3, 7)),
        rng.uniform(seeds, counters, rng.STREAM_AUX, (1029,)),
        rng.randint(seeds, counters, rng.STREAM_J, torch.full((), 10.0, device=device)),
        rng.randint(seeds, counters, rng.STREAM_J, torch.arange(1, len(seeds) + 1, device=device).float()),
    ]
    return out + [rng.randint(seeds, counters, rng.STREAM_J, 3)] if python_high else out


@interpreted
def test_kernel_draws_equal_pytorch_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rng_kernel.serves(SEEDS, COUNTERS, 1)
    fused = draws(SEEDS, COUNTERS)
    monkeypatch.setattr(rng_kernel, "serves", lambda *args: False)  # the PyTorch ops, as without triton
    for got, want in zip(fused, draws(SEEDS, COUNTERS), strict=True):
        assert same_bits(got, want)


# ------------------------------------------------------------------------------- the kernel on the GPU
@on_cuda
@pytest.mark.parametrize(("n", "numel", "stream"), CASES)
def test_cuda_kernel_bits_match_pytorch_ops(n: int, numel: int, stream: int) -> None:
    seeds, counters = SEEDS[:n].cuda(), COUNTERS[:n].cuda()
    assert rng_kernel.serves(seeds, counters, numel)
    want = rng.bits_reference(seeds, counters, stream, numel)
    assert torch.equal(want.cpu(), rng.bits_reference(SEEDS[:n], COUNTERS[:n], stream, numel))  # integers: exact
    assert same_bits(rng_kernel.bits(seeds, counters, stream, numel), want)
    assert same_bits(rng_kernel.bits(seeds, counters, stream, numel, uniform=True), uniform_of(want))


@on_cuda
def test_cuda_kernel_draws_equal_pytorch_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    seeds, counters = SEEDS.cuda(), COUNTERS.cuda()
    fused = draws(seeds, counters)
    monkeypatch.setattr(rng_kernel, "serves", lambda *args: False)
    for got, want in zip(fused, draws(seeds, counters), strict=True):
        assert same_bits(got, want)


@on_cuda
def test_cuda_kernel_in_graph_replays_eager_draws() -> None:
    n = 8
    seeds = torch.arange(n, dtype=torch.int64, device="cuda") * 7919 - 3
    counters = torch.zeros(n, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernel outside the capture
        draws(seeds, counters, python_high=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = draws(seeds, counters, python_high=False)  # outputs alias the graph's memory
    for step in range(3):  # new streams written into the static inputs, as the scheduler does
        seeds.copy_(torch.arange(n, device="cuda") * (step + 11) + 2**40 * step - 5)
        counters.fill_(step * 2**32 + step)
        graph.replay()
        for got, want in zip(static_out, draws(seeds, counters, python_high=False), strict=True):
            assert same_bits(got, want)
