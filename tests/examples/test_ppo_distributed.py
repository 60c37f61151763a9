"""examples/ppo_pi05.py under torch.distributed (gloo, CPU): G ranks of N envs equal one process of G*N envs.

Ranks are started the way torchrun starts them -- one process each, with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/
LOCAL_RANK in its environment -- through multiprocessing's "spawn" context (no shell, no argv). Each rank writes its
curve, final success rates and trainer weights to a folder (JSON + safetensors); the test compares them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_ppo import _ppo_module

EXACT = ("iteration", "global_step", "episodes", "weight_version", "success_rate", "clipfrac")
TIMED = ("sps", "time_rollout", "time_train", "time_sync")
KILLED_EXIT = 17


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(ppo, **overrides):
    settings = dict(num_envs=2, num_steps=2, total_iterations=2, num_minibatches=1, update_epochs=2, quiet=True)
    return ppo.Args(**{**settings, **overrides})


def _save(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    weights = {n: p.detach().float().cpu().contiguous() for n, p in result["trainer"].trainable_parameters()}
    save_file(weights, str(out / "weights.safetensors"))
    (out / "result.json").write_text(json.dumps({"curve": result["curve"], "final": result["final"]}))


def _rank(rank: int, world: int, port: int, settings: dict, out: str, die_at_step: int | None) -> None:
    """One rank, as torchrun would start it; `die_at_step`: this rank os._exit()s inside that optimizer step."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    ppo = _ppo_module()
    if die_at_step is not None:
        real_step, calls = torch.optim.Adam.step, {"n": 0}

        def step_then_die(self, *a, **kw):
            calls["n"] += 1
            if calls["n"] == die_at_step:
                Path(out, "died").write_text(str(time.time()))
                os._exit(KILLED_EXIT)  # mid-iteration: after the gradient all-reduce, before the weight sync
            return real_step(self, *a, **kw)

        torch.optim.Adam.step = step_then_die
    try:
        result = ppo.train(ppo.Args(**settings))
    except Exception as error:  # the survivors: keep the message for the test, exit non-zero
        Path(out, f"error{rank}.txt").write_text(f"{type(error).__name__}: {error}")
        raise SystemExit(1) from None
    _save(result, Path(out, f"rank{rank}"))


def _launch(world: int, settings: dict, out: Path, die: tuple[int, int] | None = None) -> list:
    """Starts `world` ranks and waits for them; returns the processes (exit codes) after they ended."""
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    dies = [die[1] if die and die[0] == r else None for r in range(world)]
    procs = [context.Process(target=_rank, args=(r, world, port, settings, str(out), dies[r])) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    return procs


def _load(folder: Path) -> tuple[dict, dict]:
    result = json.loads((folder / "result.json").read_text())
    result["untimed"] = [{k: v for k, v in row.items() if k not in TIMED} for row in result["curve"]]
    return result, load_file(str(folder / "weights.safetensors"))


def _assert_same_run(result: dict, weights: dict, reference: dict, ref_weights: dict) -> None:
    assert len(result["curve"]) == len(reference["curve"]) == 2
    for row, ref in zip(result["curve"], reference["curve"], strict=True):
        assert row.keys() == ref.keys()
        for key in row.keys() - set(TIMED):
            tolerance = {} if key in EXACT else {"rel": 1e-5, "abs": 1e-6}  # float summation order
            assert row[key] == pytest.approx(ref[key], nan_ok=True, **tolerance), key
    assert result["final"] == reference["final"]  # the same episodes, split over the ranks
    assert weights.keys() == ref_weights.keys()
    for name, w in weights.items():
        torch.testing.assert_close(w, ref_weights[name], rtol=1e-5, atol=1e-6, msg=name)  # measured: <= 5e-8


@pytest.mark.parametrize(
    ("world", "group_size"),
    [(2, 1), pytest.param(3, 1, marks=pytest.mark.slow), (2, 2)],  # 3 ranks on 2 cores: slow
    ids=["2-ranks", "3-ranks", "2-ranks-groups"],
)
def test_ranks_equal_one_process_over_the_concatenated_envs(world, group_size, tmp_path):
    ppo = _ppo_module()
    n = 2
    eval_episodes = 2 * world * n  # two rounds of every env (the target task ends every episode after one step)
    common = dict(eval_episodes=eval_episodes, csv=None, group_size=group_size)  # groups: within a rank's envs
    if group_size > 1:
        common["seed"] = 2  # iteration 1: one rank's group ends alike, the other's not (group_signal 0.5)
    reference = ppo.train(_args(ppo, num_envs=world * n, **common))
    ref_weights = {n: p.detach().float().clone() for n, p in reference["trainer"].trainable_parameters()}
    if group_size > 1:  # so the ranks must pool their groups' signal to match the one process
        assert reference["curve"][0]["group_signal"] == 0.5

    settings = {**vars(_args(ppo, num_envs=n, **common))}  # no plot: the CSV is below
    settings = {k: v for k, v in settings.items() if k not in ("batch_size", "minibatch_size")}  # derived fields
    procs = _launch(world, settings, tmp_path)
    assert [p.exitcode for p in procs] == [0] * world

    results = [_load(tmp_path / f"rank{r}") for r in range(world)]
    for result, weights in results[1:]:  # every rank ends with the same weights and the same row, bit for bit
        assert (result["untimed"], result["final"]) == (results[0][0]["untimed"], results[0][0]["final"])
        assert all(torch.equal(w, results[0][1][k]) for k, w in weights.items())
    _assert_same_run(*results[0], reference, ref_weights)


def test_world_size_one_under_torchrun_equals_the_plain_run(tmp_path, monkeypatch):
    ppo = _ppo_module()
    kwargs = dict(num_envs=4, eval_episodes=8, num_minibatches=2)  # M = 2: one rank shuffles as the plain run
    plain = ppo.train(_args(ppo, csv=str(tmp_path / "plain.csv"), **kwargs))
    plain_weights = {n: p.detach().float().clone() for n, p in plain["trainer"].trainable_parameters()}
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    ranked = ppo.train(_args(ppo, csv=str(tmp_path / "ranked.csv"), **kwargs))
    weights = {n: p.detach().float() for n, p in ranked["trainer"].trainable_parameters()}
    _assert_same_run({"curve": ranked["curve"], "final": ranked["final"]}, weights, plain, plain_weights)


def test_a_dead_rank_ends_the_others_with_an_error_and_the_csv_keeps_whole_rows(tmp_path, capsys):
    ppo = _ppo_module()
    csv = tmp_path / "curve.csv"
    settings = dict(num_envs=2, num_steps=2, total_iterations=4, num_minibatches=1, update_epochs=1, eval_episodes=4,
                    csv=str(csv), quiet=True, dist_timeout=30.0)  # fmt: skip
    procs = _launch(2, settings, tmp_path, die=(1, 2))  # rank 1 dies in iteration 2's optimizer step
    ended = time.time()
    assert [p.exitcode for p in procs] == [1, KILLED_EXIT]
    assert ended - float((tmp_path / "died").read_text()) < 60  # bounded: gloo sees the closed connection
    error = (tmp_path / "error0.txt").read_text()
    assert error.startswith(
        "DistributedError: rank 0 of 2: the metrics all-reduce (iteration 2) did not complete (gloo: "
    ), error
    assert error.endswith(
        "Another rank has most likely died or hung (a collective waits at most 30 s, --dist-timeout). Fix: find the "
        "rank that failed first (torchrun's summary names it and its exit code; its own error is above), fix that, "
        "and rerun the same command."
    ), error
    first = csv.read_text()
    assert [r.split(",")[0] for r in first.splitlines()] == ["iteration", "1"]  # iteration 1 only, whole
    assert sorted(f.name for f in tmp_path.glob("*.csv")) == ["curve.csv"]  # one CSV: rank 0's

    # Restart = the same command again: from iteration 1 in a fresh CSV; the failed run's curve is kept aside.
    ppo.train(ppo.Args(**{**settings, "total_iterations": 2, "quiet": False}))
    assert (tmp_path / "curve.1.csv").read_text() == first
    assert [r.split(",")[0] for r in csv.read_text().splitlines()] == ["iteration", "1", "2"]
    assert f"(the earlier curve is kept as {tmp_path / 'curve.1.csv'})" in capsys.readouterr().out


def test_a_non_positive_timeout_is_refused_when_parsed():
    ppo = _ppo_module()
    with pytest.raises(ValueError, match=r"^--dist-timeout: expected seconds > 0, got 0.0. Fix: pass e.g. 300.$"):
        ppo.parse_args(["--dist-timeout", "0"])
