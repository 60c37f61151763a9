"""phyai_gym.distributed: torchrun's environment read or refused with the fix; collectives on a one-rank gloo group."""

from __future__ import annotations

import socket

import pytest
import torch

from phyai_gym.distributed import GradientMean, Launch, ProcessGroup

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


def test_one_rank_group_collectives_and_gradient_mean():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
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
