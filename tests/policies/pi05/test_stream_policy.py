"""Pi05Policy as a `StreamPolicy` (DESIGN C3): a call with explicit counters draws exactly what a plain call at
those counters draws and changes no stream; `advance_streams` then records it."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import make_inputs, make_policy

from policies.base import StreamPolicy


def test_explicit_counters_draw_like_a_plain_call_and_change_nothing_until_advanced() -> None:
    plain, speculating = make_policy("suffix", method="sde"), make_policy("suffix", method="sde")
    assert isinstance(speculating, StreamPolicy)
    x = make_inputs(3, seed=1)
    for policy in (plain, speculating):
        policy.act_inputs(x, seeds=[4, 5, 6], env_ids=[2, 0, 5])
    ids = [0, 5]
    seeds, counters = speculating.stream_state(ids)
    assert seeds.tolist() == [5, 6] and counters.tolist() == [1, 1]
    before = speculating.streams.state()
    ahead = speculating.act_inputs(x.select(slice(1, 3)), env_ids=ids, counters=counters)
    again = speculating.act_inputs(x.select(slice(1, 3)), env_ids=ids, counters=counters)
    for a, b in zip(before, speculating.streams.state()):  # two speculative calls: the table is as it was
        assert torch.equal(a, b)
    assert torch.equal(ahead.chains, again.chains) and torch.equal(ahead.denoise_inds, again.denoise_inds)
    reference = plain.act_inputs(x.select(slice(1, 3)), env_ids=ids)
    for name in ("chains", "denoise_inds", "log_prob", "values"):
        assert torch.equal(getattr(ahead, name), getattr(reference, name)), name
    speculating.advance_streams(ids, counters)
    for a, b in zip(plain.streams.state(), speculating.streams.state()):  # advanced = as if it had been plain
        assert torch.equal(a, b)


def test_explicit_counters_are_checked_and_a_refused_call_changes_nothing() -> None:
    policy = make_policy("none", method="sde")
    x = make_inputs(2, seed=2)
    policy.act_inputs(x, seeds=[1, 2])
    before = policy.streams.state()
    with pytest.raises(ValueError, match=re.escape(
        "Pi05Policy.act: got both `seeds` and `counters`; a call with explicit counters draws from the streams' "
        "current seeds and changes nothing. Fix: pass one of them"
    )):  # fmt: skip
        policy.act_inputs(x, seeds=[1, 2], counters=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=re.escape(
        "Pi05Policy.act: argument `counters` must be 2 integer counters (one per observation row), got "
        "torch.int64 of shape (3,). Fix: pass stream_state(env_ids)[1]."
    )):  # fmt: skip
        policy.act_inputs(x, counters=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"Pi05Policy.advance_streams: argument `counters` must be 2 integer counters"):
        policy.advance_streams([0, 1], torch.zeros(2))
    for a, b in zip(before, policy.streams.state()):
        assert torch.equal(a, b)

