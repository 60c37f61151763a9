"""Counter-based random streams (DESIGN C3): batch-composition independence, distinctness, moments, ranges."""

from __future__ import annotations

import math

import pytest
import torch

from policies import rng

SHAPE = (3, 4, 5)
STREAMS = (rng.STREAM_X0, rng.STREAM_XI, rng.STREAM_J, rng.STREAM_AUX)


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
