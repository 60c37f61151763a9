"""Concurrency: `act()` from several threads is serialised by the policy lock and gives, per thread, exactly
what the same calls give when run one after another (each thread owns its env ids, so its streams are its own).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from reliability_support import assert_same_tensors, make_obs, make_tiny_policy, outputs_of

from policies.pi05.policy import Pi05Policy

THREADS = 4
CALLS = 3


def _plan(thread: int) -> list[dict[str, Any]]:
    """The calls of one thread: its own observation, env ids and seeds; only the first call seeds."""
    ids = [10 * thread, 10 * thread + 1]
    obs = make_obs(2, seed=100 + thread)
    return [
        {"obs": obs, "env_ids": ids, "seeds": [1000 * thread + 1, 1000 * thread + 2] if k == 0 else None}
        for k in range(CALLS)
    ]


def _instrument(policy: Pi05Policy) -> dict[str, int]:
    """Counts how many rollouts run at once (must never exceed 1)."""
    state = {"now": 0, "max": 0}
    guard = threading.Lock()
    rollout = policy.scheduler.rollout

    def counted(*args: Any, **kwargs: Any) -> Any:
        with guard:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
        try:
            return rollout(*args, **kwargs)
        finally:
            with guard:
                state["now"] -= 1

    policy.scheduler.rollout = counted  # type: ignore[method-assign]
    return state


def test_threaded_act_is_serialised_and_matches_sequential_replay(tokenizer_dir: Path) -> None:
    threaded = make_tiny_policy(tokenizer_dir, seed=3)
    sequential = make_tiny_policy(tokenizer_dir, seed=3)
    counts = _instrument(threaded)
    results: dict[int, list[dict[str, torch.Tensor]]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(THREADS)

    def worker(thread: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[thread] = [outputs_of(threaded.act(c["obs"], env_ids=c["env_ids"], seeds=c["seeds"]))
                               for c in _plan(thread)]  # fmt: skip
        except BaseException as err:  # noqa: BLE001  (re-raised below)
            errors.append(err)

    workers = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(THREADS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not any(w.is_alive() for w in workers), "a thread hung"
    assert not errors, errors
    assert counts["max"] == 1, f"{counts['max']} rollouts ran at once"

    for thread in range(THREADS):  # a different order than the threads ran in: streams are per env id
        replay = [outputs_of(sequential.act(c["obs"], env_ids=c["env_ids"], seeds=c["seeds"])) for c in _plan(thread)]
        for got, want in zip(results[thread], replay):
            assert_same_tensors(got, want)
    s1, c1 = threaded.streams.state()
    s2, c2 = sequential.streams.state()
    assert torch.equal(s1, s2) and torch.equal(c1, c2)
    for thread in range(THREADS):
        assert c1[10 * thread : 10 * thread + 2].tolist() == [CALLS, CALLS]


def test_act_while_weights_sync_in_another_thread(tokenizer_dir: Path) -> None:
    """Syncs of identical weights interleave with act(): versions only grow and outputs never change."""
    policy = make_tiny_policy(tokenizer_dir, seed=4)
    obs = make_obs(2, seed=7)
    reference = outputs_of(policy.act(obs, env_ids=[0, 1], seeds=[5, 6]))
    weights = {n: p.detach().clone() for n, p in policy.trainable_parameters()}
    versions: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def syncer() -> None:
        try:
            while not stop.is_set() and len(versions) < 20:
                versions.append(policy.sync_weights(weights).version)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=syncer, daemon=True)
    thread.start()
    try:
        for _ in range(4):
            out = policy.act(obs, env_ids=[0, 1], seeds=[5, 6])
            assert out.header.weight_version <= policy.weight_version
            assert_same_tensors(outputs_of(out), reference)
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive() and not errors, errors
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert not policy.weight_sync.in_progress
