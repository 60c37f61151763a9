"""GaussianPolicy as a `StreamPolicy` (DESIGN C3): explicit counters draw like a plain call and change no stream."""

from __future__ import annotations

import re

import pytest
import torch

from policies.base import BatchSizePolicy, Policy, StreamPolicy
from policies.baseline import ConstantPolicy, GaussianPolicy

OBS = {"task": ["a", "b", "c"]}


def test_protocols() -> None:
    gaussian, constant = GaussianPolicy(2, 4), ConstantPolicy([0.0, 1.0], 4)
    assert isinstance(gaussian, StreamPolicy) and isinstance(constant, Policy)
    assert not isinstance(constant, StreamPolicy)  # no stream table: prefetch refuses it
    assert not isinstance(gaussian, BatchSizePolicy)  # nothing to prepare per batch size


def test_explicit_counters_draw_like_a_plain_call_and_change_nothing_until_advanced() -> None:
    plain, speculating = GaussianPolicy(2, 4, std=0.5), GaussianPolicy(2, 4, std=0.5)
    ids = [4, 1, 7]
    for policy in (plain, speculating):
        policy.act(OBS, seeds=[10, 11, 12], env_ids=ids)
    seeds, counters = speculating.stream_state(ids)
    assert seeds.tolist() == [10, 11, 12] and counters.tolist() == [1, 1, 1]
    before = speculating.streams.state()
    ahead = speculating.act(OBS, env_ids=ids, counters=counters, action_chunk=3)
    for a, b in zip(before, speculating.streams.state()):
        assert torch.equal(a, b)
    reference = plain.act(OBS, env_ids=ids, action_chunk=3)
    assert torch.equal(ahead.actions, reference.actions) and torch.equal(ahead.log_prob, reference.log_prob)
    speculating.advance_streams(ids, counters)
    for a, b in zip(plain.streams.state(), speculating.streams.state()):
        assert torch.equal(a, b)


def test_explicit_counters_are_checked() -> None:
    policy = GaussianPolicy(2, 4)
    before = policy.streams.state()
    with pytest.raises(ValueError, match=re.escape("GaussianPolicy.act: got both `seeds` and `counters`")):
        policy.act(OBS, seeds=[1, 2, 3], counters=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=re.escape(
        "GaussianPolicy.act: argument `counters` must be 3 integer counters (one per observation row), got "
        "torch.float32 of shape (3,). Fix: pass stream_state(env_ids)[1]."
    )):  # fmt: skip
        policy.act(OBS, counters=torch.zeros(3))
    for a, b in zip(before, policy.streams.state()):
        assert torch.equal(a, b)
