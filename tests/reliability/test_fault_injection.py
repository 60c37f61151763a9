"""Fault injection: failures in the middle of a weight sync, an env step, an evaluation run or a checkpoint read
end with a clear error, never hang, and leave what survives usable (weights bit-identical, wrapper closeable,
evaluation files consistent and resumable).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from reliability_support import Probe, make_obs
from safetensors.torch import load_file, save_file

from phyai_gym import cli
from policies.baseline import GaussianPolicy
from policies.pi05.checkpoint import CheckpointError, load_weights
from policies.pi05.policy import Pi05Policy
from policies.pi05.weight_sync import WeightSyncError
from wrappers import PolicyVectorEnv
from wrappers.adapters.scripted import ScriptedEnv, make_scripted_env
from wrappers.freeze import make_freezable_vector_env

GUARD_S = 60.0
"""Upper bound for any call that must fail rather than hang."""


def call_with_timeout(fn: Callable[[], Any], timeout: float = GUARD_S) -> tuple[Any, BaseException | None]:
    """(result, exception) of fn() run in a daemon thread; fails the test if it is still running after `timeout`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as err:  # noqa: BLE001  (reported to the caller)
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"call did not return within {timeout} s (hang)"
    return box.get("result"), box.get("error")


def _params(policy: Pi05Policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def _assert_params_equal(policy: Pi05Policy, before: dict[str, torch.Tensor]) -> None:
    now = dict(policy.model.named_parameters())
    for name, value in before.items():
        assert torch.equal(now[name].detach(), value), f"{name} changed"


# ------------------------------------------------------------------------------------------------ weight sync
def test_weight_sync_source_raising_midway_leaves_weights_unchanged(policy: Pi05Policy) -> None:
    probe = Probe(policy)
    before = _params(policy)
    names = list(before)

    def source() -> Iterator[tuple[str, torch.Tensor]]:
        for i, name in enumerate(names):
            if i == len(names) // 2:
                raise ConnectionError("trainer went away")
            yield name, before[name] + 1.0

    with pytest.raises(WeightSyncError, match="source raised ConnectionError: trainer went away") as info:
        policy.sync_weights(source())
    assert "weights are unchanged" in str(info.value)
    assert not policy.weight_sync.in_progress
    _assert_params_equal(policy, before)
    probe.check()
    # the policy still takes a good update afterwards (and it changes the outputs)
    report = policy.sync_weights({n: v for n, v in before.items()})
    assert report.version == probe.version + 1
    probe.version = report.version
    probe.check()  # same weights re-sent: the outputs stay bit-identical


def test_weight_sync_nan_is_refused(policy: Pi05Policy) -> None:
    probe = Probe(policy)
    before = _params(policy)
    poisoned = {n: v.clone() for n, v in before.items()}
    victim = next(iter(poisoned))
    poisoned[victim].view(-1)[3] = float("nan")
    with pytest.raises(WeightSyncError, match="non-finite") as info:
        policy.sync_weights(poisoned)
    assert victim in str(info.value)
    inf_source = {n: v.clone() for n, v in before.items()}
    inf_source[victim].view(-1)[0] = float("inf")
    policy.begin_weight_update()
    policy.update_weights(inf_source)
    with pytest.raises(WeightSyncError, match="non-finite"):
        policy.finish_weight_update()
    _assert_params_equal(policy, before)
    probe.check()


# ----------------------------------------------------------------------------------------------- vector envs
class _FailingEnv(ScriptedEnv):
    """A scripted env whose step raises at the `fail_at`-th step of its life."""

    def __init__(self, fail_at: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_at, self.calls = fail_at, 0

    def step(self, action: np.ndarray) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"simulator exploded at step {self.calls}")
        return super().step(action)


def _failing_vector_env(vectorization: str) -> Any:
    fns = [lambda: ScriptedEnv(episode_lengths=(50,)), lambda: _FailingEnv(6, episode_lengths=(50,))]
    return make_freezable_vector_env(fns, vectorization=vectorization)


@pytest.mark.parametrize("vectorization", ["sync", "async"])
def test_sub_env_raising_in_step_propagates_and_wrapper_closes(vectorization: str) -> None:
    env = PolicyVectorEnv(_failing_vector_env(vectorization), GaussianPolicy(3, action_horizon=4), action_chunk=4)
    try:
        env.reset(seed=0)
        _, error = call_with_timeout(env.step)
        assert error is None  # sub-steps 1..4
        _, error = call_with_timeout(env.step)  # sub-step 6 of env 1 raises
        assert isinstance(error, RuntimeError), repr(error)
        assert "simulator exploded at step 6" in str(error)
    finally:
        _, error = call_with_timeout(env.close)
    assert error is None, repr(error)
    assert env.closed


def test_async_worker_killed_mid_episode_gives_clear_error_and_closes() -> None:
    venv = make_scripted_env(2, episode_lengths=(50,), vectorization="async")
    env = PolicyVectorEnv(venv, GaussianPolicy(3, action_horizon=4), action_chunk=4)
    try:
        env.reset(seed=0)
        env.step()
        victim = venv.processes[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(GUARD_S)
        _, error = call_with_timeout(env.step)
        assert isinstance(error, RuntimeError), repr(error)
        message = str(error)
        for needle in ("worker process", "died", f"sub-env 1 (pid {victim.pid}, exit code -9)", "close()"):
            assert needle in message, message
    finally:
        _, close_error = call_with_timeout(env.close)
    assert close_error is None, repr(close_error)
    assert env.closed and not any(p.is_alive() for p in venv.processes)
    with pytest.raises(Exception, match="closed"):
        env.step()


def test_async_worker_killed_while_waiting_for_step() -> None:
    """The kill lands while the wrapper waits on the worker's reply (EOF on the pipe), not before the send."""

    class _Slow(ScriptedEnv):
        def step(self, action: np.ndarray) -> Any:
            import time

            time.sleep(0.5)
            return super().step(action)

    venv = make_freezable_vector_env([lambda: ScriptedEnv(episode_lengths=(50,)), _Slow], vectorization="async")
    env = PolicyVectorEnv(venv, GaussianPolicy(3, action_horizon=2), action_chunk=2)
    try:
        env.reset(seed=0)
        timer = threading.Timer(0.2, os.kill, (venv.processes[1].pid, signal.SIGKILL))
        timer.start()
        _, error = call_with_timeout(env.step)
        timer.join()
        assert isinstance(error, RuntimeError) and "died" in str(error), repr(error)
    finally:
        _, close_error = call_with_timeout(env.close)
    assert close_error is None, repr(close_error)


# ------------------------------------------------------------------------------------------------- evaluation
def _has_eval() -> bool:
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    return "eval" in sub.choices


def test_keyboard_interrupt_during_eval_leaves_consistent_resumable_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    if not _has_eval():
        pytest.skip("`phyai-gym eval` does not exist yet")
    out = tmp_path / "eval"
    argv = ["eval", "--env", "scripted", "--policy", "gaussian", "--num-envs", "2", "--episodes", "6",
            "--action-chunk", "3", "--out", str(out)]  # fmt: skip
    real_step = PolicyVectorEnv.step
    calls = {"n": 0}

    def interrupted_step(self: PolicyVectorEnv, actions: Any = None) -> Any:
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt
        return real_step(self, actions)

    monkeypatch.setattr(PolicyVectorEnv, "step", interrupted_step)
    assert cli.main(argv) == 130
    assert "interrupted" in capsys.readouterr().out
    lines = (out / "episodes.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # every line is whole JSON
    assert rows[0]["type"] == "header"
    done = [r for r in rows[1:] if r["type"] == "episode"]
    assert 0 < len(done) < 6
    assert len({r["episode_id"] for r in done}) == len(done)
    if (out / "results.csv").exists():  # written only by a finished run; if present it must agree with the JSONL
        with open(out / "results.csv") as handle:
            overall = list(csv.DictReader(handle))[-1]
        assert int(overall["episodes"]) <= len(done)

    # a crash mid-write leaves a torn last line: the resume ignores it
    with open(out / "episodes.jsonl", "a") as handle:
        handle.write('{"type": "episode", "episode_id": 99, "succ')
    monkeypatch.setattr(PolicyVectorEnv, "step", real_step)
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "episodes: complete" in text
    final = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines() if line.endswith("}")]
    episodes = [r for r in final if r["type"] == "episode"]
    assert sorted(r["episode_id"] for r in episodes) == list(range(6))  # no repeats, no losses
    assert all(r in episodes for r in done)  # the interrupted run's rows were kept as they were
    with open(out / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert table[-1]["task"] == "overall" and int(table[-1]["episodes"]) == 6


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def saved(policy: Pi05Policy, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return policy.save_pretrained(tmp_path_factory.mktemp("fault_ckpt"))


def _folder_with(saved: Path, dst: Path, data: bytes | None = None, tensors: dict | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "processor_config.json", "policy_config.json"):
        (dst / name).write_text((saved / name).read_text())
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"))
    else:
        (dst / "model.safetensors").write_bytes(data or b"")
    return dst


@pytest.mark.parametrize("damage", ["random_bytes", "truncated_half", "truncated_header", "empty"])
def test_corrupt_safetensors_is_refused_and_weights_stay(
    policy: Pi05Policy, saved: Path, tmp_path: Path, damage: str
) -> None:
    probe = Probe(policy)
    raw = (saved / "model.safetensors").read_bytes()
    data = {
        "random_bytes": np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "truncated_half": raw[: len(raw) // 2],
        "truncated_header": raw[:20],
        "empty": b"",
    }[damage]
    folder = _folder_with(saved, tmp_path / damage, data)
    for load in (lambda: load_weights(policy.model, folder), lambda: Pi05Policy.from_pretrained(folder)):
        with pytest.raises(CheckpointError) as info:
            load()
        assert "model.safetensors" in str(info.value) and "truncated or corrupt" in str(info.value)
    probe.check()


def test_checkpoint_extra_and_missing_keys_strict_and_not(policy: Pi05Policy, saved: Path, tmp_path: Path) -> None:
    probe = Probe(policy)
    tensors = load_file(str(saved / "model.safetensors"))
    dropped = "paligemma_with_expert.gemma_expert.model.layers.1.mlp.down_proj.weight"
    tensors.pop(dropped)
    tensors["paligemma_with_expert.gemma_expert.model.layers.9.mlp.down_proj.weight"] = torch.zeros(2, 2)
    head = next(k for k in tensors if k.startswith("value_head."))
    tensors.pop(head)
    folder = _folder_with(saved, tmp_path / "keys", tensors=tensors)

    with pytest.raises(CheckpointError) as info:
        load_weights(policy.model, folder, strict=True)
    message = str(info.value)
    assert "missing keys (1)" in message and "expert.layers.1.mlp.down_proj.weight" in message
    assert "unexpected keys (1)" in message and "layers.9.mlp.down_proj.weight" in message
    assert head not in message  # an RL head absent from the file is initialised, not missing
    probe.check()

    loaded = Pi05Policy.from_pretrained(folder, strict=False)
    report = loaded.load_report
    assert report is not None and not report.ok
    assert report.missing == ["expert.layers.1.mlp.down_proj.weight"]
    assert report.unexpected == ["paligemma_with_expert.gemma_expert.model.layers.9.mlp.down_proj.weight"]
    assert head in report.initialized
    ours = dict(loaded.model.named_parameters())
    theirs = dict(policy.model.named_parameters())
    assert torch.equal(ours["expert.layers.0.mlp.down_proj.weight"], theirs["expert.layers.0.mlp.down_proj.weight"])
    obs = make_obs(2)
    assert loaded.act(obs, seeds=[1, 2]).actions.shape == (2, 5, 3)
    loaded.close()
    probe.check()
