"""phyai_gym.train.distributed: torchrun's environment read or refused with the fix; collectives on a one-rank gloo
group."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from phyai_gym.train.distributed import DistributedError, GradientMean, Launch, ProcessGroup

FULL = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_a_torchrun_environment_is_read_and_a_plain_one_is_none():
    assert Launch.from_env(FULL) == Launch(rank=3, local_rank=1, world_size=4)
    assert Launch.from_env({}) is None
    assert Launch.from_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}) is None  # exported, no launch


def test_a_half_set_environment_is_refused_naming_what_is_missing():
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    with pytest.raises(ValueError) as error:
        Launch.from_env(env)
    assert str(error.value) == (
        "torchrun environment: expected all of RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun sets "
        "them) or none of RANK, LOCAL_RANK, WORLD_SIZE (a single-process run), got WORLD_SIZE=2, "
        "MASTER_ADDR=127.0.0.1 with RANK, LOCAL_RANK, MASTER_PORT unset. Fix: launch with `torchrun "
        "--nproc_per_node G ...`, or unset WORLD_SIZE for a single-process run."
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"RANK": "one"}, "torchrun environment: RANK must be an integer, got 'one'."),
        ({"RANK": "4"}, "got RANK=4, LOCAL_RANK=1, WORLD_SIZE=4."),
        ({"LOCAL_RANK": "-1"}, "got RANK=3, LOCAL_RANK=-1, WORLD_SIZE=4."),
    ],
)
def test_bad_values_are_refused(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Launch.from_env({**FULL, **change})


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError, match=r"--dist-timeout: expected seconds > 0, got 0. Fix: pass e.g. 300."):
        ProcessGroup(Launch(0, 0, 1), "cpu", timeout_s=0)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_one_rank_group_collectives_and_gradient_mean():
    port = _free_port()
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    with ProcessGroup(Launch.from_env(env), "cpu", timeout_s=30, environ=env) as group:
        assert (group.backend, group.device, group.rank, group.world_size) == ("gloo", torch.device("cpu"), 0, 1)
        assert group.all_gather(torch.tensor([1.0, 2.0]), "a gather").tolist() == [[1.0, 2.0]]
        a, b = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
        (a.sum() * 2 + (b * torch.arange(3.0)).sum()).backward()
        GradientMean(group)([a, b, torch.zeros(1, requires_grad=True)], "a gradient mean")  # no grad: skipped
        assert (a.grad.tolist(), b.grad.tolist()) == ([2.0, 2.0], [0.0, 1.0, 2.0])
        with pytest.raises(RuntimeError, match="already initialised"):
            ProcessGroup(Launch.from_env(env), "cpu", timeout_s=30, environ=env)


def _hanging_pair(rank: int, port: str, out: str) -> None:
    """Rank 1 hangs for 30 s before the all-reduce; rank 0 waits at most 5 s for it."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = port
    group = ProcessGroup(Launch.from_env(env), "cpu", timeout_s=5, environ=env)  # 5 s: slack for the rendezvous
    if rank == 1:
        time.sleep(30)
    try:
        group.all_reduce_sum(torch.ones(1), "the test all-reduce")
    except DistributedError as error:
        Path(out, f"error{rank}.txt").write_text(str(error))
    os._exit(0)  # leave without the group's shutdown handshake (the peer may be gone)


def test_a_hung_rank_fails_the_collective_after_the_timeout_naming_it(tmp_path):
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [context.Process(target=_hanging_pair, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(timeout=60)
    for p in procs:
        p.kill()
    error = (tmp_path / "error0.txt").read_text()
    assert error.startswith("rank 0 of 2: the test all-reduce did not complete (gloo: "), error
    assert "Timed out waiting 5000ms" in error
    assert "(a collective waits at most 5 s, --dist-timeout). Fix: find the rank that failed first" in error
