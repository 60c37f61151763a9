"""Cross-step prefetch of PolicyVectorEnv (``prefetch=True``): results equal ``groups=1`` / ``prefetch=False`` bit
for bit; a speculative call changes no random stream, and stale or cancelled ones are discarded (DESIGN C2, C3, C6).
"""

from __future__ import annotations

import re
import threading
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from policies.baseline import ConstantPolicy, GaussianPolicy
from policies.pi05.config import Pi05Config
from policies.pi05.policy import Pi05Policy
from wrappers.adapters.scripted import make_scripted_env
from wrappers.policy_vector_env import PolicyVectorEnv

A, C, N = 3, 4, 4
LENGTHS = [(2, 5), (3,), (7, 1), (4, 4)]  # episodes end inside chunks and at chunk boundaries


class CountingGaussian(GaussianPolicy):
    """GaussianPolicy that counts `act` calls, tells speculative ones (explicit `counters`) apart, can wait for
    them to finish, and can fail the speculative calls whose index (0, 1, ... in start order) is in `fail`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = self.failures = self.speculative = self.speculative_done = 0
        self.fail: set[int] = set()
        self._cond = threading.Condition()

    def act(self, obs: Any, **kwargs: Any) -> Any:
        speculative = kwargs.get("counters") is not None
        with self._cond:
            self.calls += 1
            index = self.speculative
            self.speculative += speculative
        try:
            out = super().act(obs, **kwargs)
            if speculative and index in self.fail:
                with self._cond:
                    self.failures += 1
                raise RuntimeError("injected prefetch failure")
            return out
        finally:
            with self._cond:
                self.speculative_done += speculative
                self._cond.notify_all()

    def wait_speculative(self, count: int) -> None:
        """Blocks until `count` speculative calls have finished (a synchronisation, not a timing)."""
        with self._cond:
            assert self._cond.wait_for(lambda: self.speculative_done >= count, timeout=60), self.speculative_done


def make_wrapper(policy: Any, groups: int = 2, prefetch: bool = True, **kwargs: Any) -> PolicyVectorEnv:
    per = N // groups
    envs = [make_scripted_env(per, episode_lengths=LENGTHS[g * per : (g + 1) * per]) for g in range(groups)]
    return PolicyVectorEnv(envs if groups > 1 else envs[0], policy, action_chunk=C, prefetch=prefetch, **kwargs)


def snapshot(result: tuple) -> dict[str, Any]:
    """Deep copies of what a step returned that must match across variants."""
    obs, rewards, terminated, truncated, info = result
    return {
        "state": np.array(obs["state"]),
        "image": np.array(obs["images"]["image"]),
        "task": tuple(obs["task"]),
        "rewards": np.array(rewards),
        "terminated": np.array(terminated),
        "truncated": np.array(truncated),
        "final_obs": np.array(info["final_obs"]["state"]),
        "substep_mask": np.array(info["substep_mask"]),
        "policy": {k: v.detach().clone() for k, v in info["policy"].items()},
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in a:
        if key == "policy":
            assert a[key].keys() == b[key].keys()
            for name in a[key]:
                torch.testing.assert_close(a[key][name], b[key][name], rtol=0, atol=0, msg=name)
        elif key == "task":
            assert a[key] == b[key]
        else:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def script(wrapper: PolicyVectorEnv, actions_rng: np.random.Generator) -> list[dict[str, Any]]:
    """reset(seed), policy steps mixed with explicit actions, weight syncs, masked and seeded resets."""
    records = []
    wrapper.reset(seed=11)
    for t in range(12):
        if t == 3:
            actions = actions_rng.uniform(-1, 1, (N, C, A)).astype(np.float32)
            records.append(snapshot(wrapper.step(actions)))
            continue
        if t == 5:
            wrapper.sync_weights({"mean": torch.full((A,), 0.5)})
        if t == 7:
            wrapper.reset(options={"reset_mask": np.array([False, True, False, True])})
        if t == 9:
            wrapper.reset(seed=40)
        records.append(snapshot(wrapper.step()))
    return records


def speculative_after(steps: int) -> int:
    """Speculative calls G=2 has started after `steps` policy steps: 1 at the end of the first step (the group
    that finished first), then 2 per step (the deferred one, once the first chunk started, and 1 at the end)."""
    return 2 * steps - 1


# ------------------------------------------------------------------------------------------------ equality
def test_prefetch_equals_one_group_and_no_prefetch_and_is_used() -> None:
    runs = {}
    for name, groups, prefetch in [("G1", 1, False), ("G2", 2, False), ("G2_prefetch", 2, True)]:
        policy = CountingGaussian(A, action_horizon=8, std=0.3)
        wrapper = make_wrapper(policy, groups, prefetch)
        wrapper.reset(seed=5)
        runs[name] = [snapshot(wrapper.step()) for _ in range(8)]
        if prefetch:  # the speculative call of the group that finished first is done but not used yet
            policy.wait_speculative(speculative_after(8))
            # every step after the first used speculative outputs: 2 plain calls, then only speculative ones
            assert (policy.calls, policy.speculative) == (2 + speculative_after(8), speculative_after(8))
        else:
            assert (policy.calls, policy.speculative) == (groups * 8, 0)
        runs[name + "_streams"] = policy.streams.state()  # with an unused speculative call in hand
        wrapper.close()
        assert runs[name + "_streams"][1].equal(policy.streams.state()[1])  # close() had nothing to undo
    assert any(r["terminated"].any() for r in runs["G1"])  # reset observations of finished envs are acted on
    for a, b, c in zip(runs["G1"], runs["G2"], runs["G2_prefetch"]):
        assert_same(a, b)
        assert_same(a, c)
    for x, y in zip(runs["G1_streams"], runs["G2_prefetch_streams"]):  # speculative calls changed no stream
        assert torch.equal(x, y)


def test_explicit_actions_syncs_and_resets_cancel_prefetch() -> None:
    runs, streams = {}, {}
    for name, groups, prefetch in [("G1", 1, False), ("G2_prefetch", 2, True)]:
        policy = GaussianPolicy(A, action_horizon=8, std=0.3)
        wrapper = make_wrapper(policy, groups, prefetch)
        runs[name] = script(wrapper, np.random.default_rng(3))
        wrapper.close()
        streams[name] = policy.streams.state()
    for a, b in zip(runs["G1"], runs["G2_prefetch"]):
        assert_same(a, b)
    for x, y in zip(streams["G1"], streams["G2_prefetch"]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("cancel", ["step_actions", "reset", "sync_weights", "close"])
def test_speculative_calls_change_no_stream_and_each_cancel_path_drops_them(cancel: str) -> None:
    plain, fetched = GaussianPolicy(A, 8, std=0.3), CountingGaussian(A, 8, std=0.3)
    ref, env = make_wrapper(plain, 1, False), make_wrapper(fetched, 2, True)
    for wrapper in (ref, env):
        wrapper.reset(seed=2)
        wrapper.step()
    fetched.wait_speculative(1)
    for x, y in zip(plain.streams.state(), fetched.streams.state()):  # a finished speculative call changed nothing
        assert torch.equal(x, y)
    for wrapper in (ref, env):
        if cancel == "step_actions":
            wrapper.step(np.zeros((N, C, A), np.float32))
        elif cancel == "reset":
            wrapper.reset()
        elif cancel == "sync_weights":
            wrapper.sync_weights({"std": torch.full((A,), 0.2)})
        else:
            wrapper.close()
    for x, y in zip(plain.streams.state(), fetched.streams.state()):
        assert torch.equal(x, y)
    if cancel != "close":
        calls = fetched.calls
        assert_same(snapshot(ref.step()), snapshot(env.step()))
        fetched.wait_speculative(2)
        assert fetched.calls - calls == 2 + 1  # the dropped call was not used: both groups called anew (+ 1 new)
    ref.close()
    env.close()


def test_weight_change_behind_the_wrapper_and_failed_prefetch_are_recomputed() -> None:
    """A sync straight on the policy (not through the wrapper) makes the prefetched version stale; a prefetch
    that raised is recomputed on the main thread; both leave results equal to prefetch=False."""
    runs = {}
    for name, groups, prefetch in [("G1", 1, False), ("G2_prefetch", 2, True)]:
        policy = CountingGaussian(A, action_horizon=8, std=0.3)
        wrapper = make_wrapper(policy, groups, prefetch)
        wrapper.reset(seed=9)
        policy.fail = {speculative_after(3), speculative_after(3) + 1}  # the two started in step 4 (t = 3)
        rec = []
        for t in range(6):
            if t == 2:
                policy.sync_weights({"mean": torch.full((A,), -0.25)})  # bypasses the wrapper
            rec.append(snapshot(wrapper.step()))
            if prefetch:  # let the speculative calls finish, so that the sync above lands between calls
                policy.wait_speculative(speculative_after(t + 1))
        wrapper.close()
        runs[name] = rec
        assert policy.failures == (2 if prefetch else 0)
    for a, b in zip(runs["G1"], runs["G2_prefetch"]):
        assert_same(a, b)


def test_callback_sees_no_pending_prefetch_and_results_equal() -> None:
    seen: dict[str, list] = {"G1": [], "G2_prefetch": []}
    runs = {}
    for name, groups, prefetch in [("G1", 1, False), ("G2_prefetch", 2, True)]:
        policy = CountingGaussian(A, action_horizon=8, std=0.3)

        def callback(env: PolicyVectorEnv, info: dict, name: str = name, policy: Any = policy) -> None:
            assert policy.speculative_done == policy.speculative  # no speculative call is running
            seen[name].append(policy.streams.counters[:N].clone())
            if len(seen[name]) == 2:
                env.sync_weights({"mean": torch.full((A,), 1.0)})

        wrapper = make_wrapper(policy, groups, prefetch, callback=callback)
        wrapper.reset(seed=1)
        runs[name] = [snapshot(wrapper.step()) for _ in range(4)]
        wrapper.close()
    for a, b in zip(runs["G1"], runs["G2_prefetch"]):
        assert_same(a, b)
    for x, y in zip(seen["G1"], seen["G2_prefetch"]):
        assert torch.equal(x, y)


def test_a_group_whose_prefetch_finished_starts_first() -> None:
    """Chunks start in the order the prefetched calls finish, not in group order (else the groups lock in step)."""

    class SlowGaussian(CountingGaussian):
        def act(self, obs: Any, **kwargs: Any) -> Any:
            time.sleep(0.1)
            return super().act(obs, **kwargs)

    wrapper = make_wrapper(SlowGaussian(A, action_horizon=8, std=0.3), groups=2, prefetch=True)
    starts: list[int] = []
    for runner in wrapper._pipeline.runners:  # private: what a user sees here is only the overlap (speed)

        def run(actions: Any, started: Any = None, inner: Any = runner.run, offset: int = runner.offset) -> Any:
            starts.append(offset)
            if offset == 0:
                time.sleep(0.2)  # group 0's envs are slow: group 1's prefetch starts (and finishes) first
            return inner(actions, started)

        runner.run = run
    wrapper.reset(seed=1)
    wrapper.step()  # no prefetch yet: group order
    wrapper.step()
    wrapper.close()
    assert starts == [0, 2, 2, 0]


def test_last_group_call_starts_once_the_first_chunk_is_with_its_envs() -> None:
    """The group that finished a step last gets its next call started by the next `step`, after the first chunk's
    actions were handed to its envs (its host work would otherwise delay that chunk), and while that chunk runs."""
    events: list[tuple[str, int, float]] = []
    slow = {0: 0.1, 2: 0.0}  # step 1: group 2 finishes first and group 0 last

    class Recording(CountingGaussian):
        def act(self, obs: Any, **kwargs: Any) -> Any:
            events.append(("act", int(kwargs["env_ids"][0]), time.perf_counter()))
            return super().act(obs, **kwargs)

    policy = Recording(A, action_horizon=8, std=0.3)
    wrapper = make_wrapper(policy, groups=2, prefetch=True)
    for runner in wrapper._pipeline.runners:  # an env with step_async / step_wait, like AsyncVectorEnv
        env, held = runner.env, []

        def step_async(actions: Any, held: list = held, offset: int = runner.offset) -> None:
            held.append(actions)
            events.append(("handed", offset, time.perf_counter()))

        def step_wait(inner: Any = env.step, held: list = held, offset: int = runner.offset) -> Any:
            time.sleep(slow[offset])
            out = inner(held.pop())
            events.append(("stepped", offset, time.perf_counter()))
            return out

        def step(actions: Any, step_async: Any = step_async, step_wait: Any = step_wait) -> Any:
            step_async(actions)
            return step_wait()

        env.step_async, env.step_wait, env.step = step_async, step_wait, step
    wrapper.reset(seed=1)
    wrapper.step()
    policy.wait_speculative(1)
    assert [e[1] for e in events if e[0] == "act"] == [0, 2, 2]  # only group 2 (first to finish) was called ahead
    slow[2] = 0.2
    events.clear()
    wrapper.step()
    wrapper.close()
    handed = next(e for e in events if e[0] == "handed")
    assert handed[1] == 2  # group 2's prefetched actions were ready: its chunk started first
    deferred_act = next(e for e in events if e[:2] == ("act", 0))
    first_done = next(e for e in events if e[:2] == ("stepped", 2))
    assert handed[2] < deferred_act[2] < first_done[2]


def _chunk_intervals(wrapper: PolicyVectorEnv, hold_s: float) -> list[tuple[float, float]]:
    """Wraps each group's `run` to hold its chunk for `hold_s` and record its (start, end)."""
    intervals: list[tuple[float, float]] = []
    for runner in wrapper._pipeline.runners:

        def run(actions: Any, started: Any = None, inner: Any = runner.run) -> Any:
            start = time.perf_counter()
            time.sleep(hold_s)
            try:
                return inner(actions, started)
            finally:
                intervals.append((start, time.perf_counter()))

        runner.run = run
    return intervals


@pytest.mark.parametrize("prefetch", [False, True])
def test_env_concurrency_one_runs_chunks_one_at_a_time_with_equal_results(prefetch: bool) -> None:
    runs, overlapping = {}, {}
    for limit in (None, 1):
        wrapper = make_wrapper(CountingGaussian(A, action_horizon=8, std=0.3), 2, prefetch, env_concurrency=limit)
        intervals = _chunk_intervals(wrapper, 0.05)
        runs[limit] = script(wrapper, np.random.default_rng(3))
        wrapper.close()
        spans = sorted(intervals)
        overlapping[limit] = sum(b[0] < a[1] for a, b in zip(spans, spans[1:]))
    assert overlapping[None] > 0  # without the limit the two groups' chunks do run together
    assert overlapping[1] == 0
    for a, b in zip(runs[None], runs[1]):
        assert_same(a, b)


def test_env_concurrency_is_checked() -> None:
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match=rf"argument `env_concurrency` must be None or an int >= 1, got "
                                             rf"{re.escape(repr(bad))}\. Fix: pass 1"):  # fmt: skip
            make_wrapper(GaussianPolicy(A, action_horizon=8), 2, False, env_concurrency=bad)
    wrapper = make_wrapper(GaussianPolicy(A, action_horizon=8), 2, False, env_concurrency=5)  # more than G is fine
    wrapper.reset(seed=0)
    wrapper.step()
    wrapper.close()


# ------------------------------------------------------------------------------------------------ PI0.5
def _tiny_pi05(seed: int, device: str = "cpu") -> Pi05Policy:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stand-in tokenizer, no norm statistics: expected for a random policy
        return Pi05Policy.from_config(
            Pi05Config.tiny(),
            action_dim=A,
            seed=seed,
            device=device,
            tokenizer="phyai-standin",
            camera_map={"image": "base_0_rgb"},
            state_dim=4,
        )


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_suite.py)"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_tiny_pi05_prefetch_equals_one_group_across_weight_syncs(device: str) -> None:
    """Bit for bit vs prefetch=False with the same groups; vs groups=1 too except the critic values, whose float
    sums depend on the batch size in PI0.5 with or without prefetch (differences ~4e-9). On CUDA (graph replays)
    the prefetches' actions reach the numpy envs through pinned copies queued behind each call."""
    source, other = _tiny_pi05(seed=1, device=device), _tiny_pi05(seed=2, device=device)
    runs, versions = {}, {}
    for name, groups, prefetch in [("G1", 1, False), ("G2", 2, False), ("G2_prefetch", 2, True)]:
        policy = _tiny_pi05(seed=0, device=device)
        wrapper = make_wrapper(policy, groups, prefetch)
        wrapper.reset(seed=3)
        rec = [snapshot(wrapper.step()), snapshot(wrapper.step())]
        wrapper.sync_weights(source.model, expected="all")  # through the wrapper: cancels the prefetches
        rec.append(snapshot(wrapper.step()))
        policy.sync_weights(other.model, expected="all")  # behind it: the version check discards the prefetches
        rec.append(snapshot(wrapper.step()))
        rec.append(snapshot(wrapper.step()))
        versions[name] = [wrapper.last_output.header.weight_version, policy.weight_version]
        wrapper.close()
        runs[name] = (rec, policy.streams.state())
    assert versions["G1"] == versions["G2"] == versions["G2_prefetch"] == [2, 2]
    assert (runs["G1"][0][1]["policy"]["log_prob"] != 0).all()  # stochastic: the streams matter
    for a, b, c in zip(runs["G1"][0], runs["G2"][0], runs["G2_prefetch"][0]):
        assert_same(b, c)
        if device == "cuda":  # batch 4 and batch 2 replay different graphs: G1 is compared on CPU only
            continue
        for key in ("values", "final_value"):
            torch.testing.assert_close(a["policy"].pop(key), c["policy"].pop(key), rtol=0, atol=1e-6)
        assert_same(a, c)
    for x, y in zip(runs["G1"][1], runs["G2_prefetch"][1]):
        assert torch.equal(x, y)


# ------------------------------------------------------------------------------------------------ errors, threads
def test_prefetch_refuses_policy_without_stream_table() -> None:
    with pytest.raises(TypeError, match=r"argument `prefetch=True` needs a policy that implements policies\.base\."
                                        r"StreamPolicy .*got ConstantPolicy\. Fix: pass prefetch=False"):  # fmt: skip
        make_wrapper(ConstantPolicy([0.0] * A, action_horizon=C), 2, True)


def test_no_thread_leak_after_close() -> None:
    before = {t.ident for t in threading.enumerate()}
    for _ in range(3):
        wrapper = make_wrapper(GaussianPolicy(A, 8), 2, True)
        wrapper.reset(seed=0)
        wrapper.step()
        wrapper.step()
        wrapper.close()
    leaked = [t.name for t in threading.enumerate() if t.ident not in before]
    assert leaked == []
