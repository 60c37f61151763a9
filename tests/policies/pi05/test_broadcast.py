"""Weight broadcast across processes (DESIGN C6) over gloo: all ranks commit one version, or all abort and keep theirs.

Each test spawns a small process group (file:// rendezvous in tmp_path). Workers write one JSON result per
rank; the parent asserts on them, so a failing worker shows its traceback in the JSON rather than a hang.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import StandInProcessor

from policies.pi05.broadcast import broadcast_weights
from policies.pi05.config import Pi05Config
from policies.pi05.model import Pi05Model, randomize_parameters_
from policies.pi05.policy import Pi05Policy, RolloutConfig
from policies.pi05.rollout import RolloutTables
from policies.pi05.scheduler import SchedulerConfig
from policies.pi05.weight_sync import WeightSyncError

BUCKET = 1 << 20  # 1 MiB: many buckets, and tensors that span several of them
NAN_NAME = "expert.layers.1.mlp.up_proj.weight"


def make_model(seed: int, value_source: str = "suffix", dtype: torch.dtype = torch.float32) -> Pi05Model:
    model = Pi05Model(Pi05Config.tiny(value_source=value_source))
    randomize_parameters_(model, seed)
    return model.set_precision(dtype).eval()


def make_policy(seed: int = 0, value_source: str = "suffix", dtype: torch.dtype = torch.float32) -> Pi05Policy:
    sched = SchedulerConfig(max_batch_size=1, num_steps=(5,), camera_sets=((0, 1),), prompt_buckets=(16,))
    return Pi05Policy(make_model(seed, value_source, dtype), StandInProcessor(), RolloutConfig(num_steps=5), sched)


def state_equals(policy: Pi05Policy, model: Pi05Model, names: list[str] | None = None) -> bool:
    theirs = dict(model.named_parameters())
    return all(
        torch.equal(p, theirs[n].to(p.device, p.dtype)) for n, p in policy.model.named_parameters()
        if names is None or n in names
    )


def tables_fresh(policy: Pi05Policy) -> bool:
    fresh = RolloutTables(policy.model, (5,))[5]
    table = policy.scheduler.tables[5]
    return torch.equal(fresh.modulation, table.modulation) and torch.equal(fresh.step_table, table.step_table)


def attempt(fn) -> dict[str, Any]:
    try:
        report = fn()
        return {"ok": True, "version": report.version, "num_tensors": report.num_tensors}
    except WeightSyncError as err:
        return {"ok": False, "error": str(err)}


class FakeDTensor:
    """Duck-typed DTensor whose materialisation can fail (a trainer-side failure mid-stream) or kill the rank."""

    def __init__(self, full: torch.Tensor, fail: str = "") -> None:
        self.full, self.shape, self.dtype, self.fail = full, full.shape, full.dtype, fail

    def full_tensor(self) -> torch.Tensor:
        if self.fail == "raise":
            raise RuntimeError("NCCL timeout while gathering shards")
        if self.fail == "die":
            os._exit(3)  # the trainer process dies with the manifest sent and buckets on the wire
        return self.full.clone()


# ------------------------------------------------------------------------------------------- scenarios
def commit_then_abort(rank: int, world: int) -> dict[str, Any]:
    """Rank 0: trainer-only source; rank 1 an fp32 policy, rank 2 an fp16 one (it stages from the buckets, casting).
    1) commit all; 2) a value finite in fp32 but Inf in fp16: only rank 2 fails, every rank aborts; 3) rank 0
    also holds a policy, explicit version 5; 4) the source in reverse order."""
    policy = None if rank == 0 else make_policy(0, dtype=torch.float16 if rank == 2 else torch.float32)
    out: dict[str, Any] = {}
    trainer = make_model(7)
    out["first"] = attempt(
        lambda: broadcast_weights(policy and policy.weight_sync, trainer if rank == 0 else None, expected="all",
                                  bucket_bytes=BUCKET)
    )  # fmt: skip
    if policy is not None:
        out["first_weights"], out["first_tables"] = state_equals(policy, trainer), tables_fresh(policy)
        out["first_version"] = policy.weight_version

    trainer2 = make_model(8)
    with torch.no_grad():
        trainer2.get_parameter(NAN_NAME)[3, 2] = 1e5  # fp16 holds at most 65504
    out["second"] = attempt(
        lambda: broadcast_weights(policy and policy.weight_sync, trainer2 if rank == 0 else None, bucket_bytes=BUCKET)
    )
    if policy is not None:
        out["second_weights_kept"] = state_equals(policy, trainer) and tables_fresh(policy)
        out["second_version"] = policy.weight_version
        out["second_in_progress"] = policy.weight_sync.in_progress

    if rank == 0:
        policy = make_policy(0)
    assert policy is not None
    with torch.no_grad():
        trainer2.get_parameter(NAN_NAME)[3, 2] = 0.5
    out["third"] = attempt(lambda: policy.broadcast_weights(trainer2 if rank == 0 else None, version=5,
                                                            bucket_bytes=BUCKET))  # fmt: skip
    trainable = out["trainable"] = [n for n, _ in policy.trainable_parameters()]
    out["third_weights"] = state_equals(policy, trainer2, trainable)
    frozen = [n for n, _ in policy.model.named_parameters() if n not in trainable]
    out["third_frozen_kept"] = state_equals(policy, trainer, frozen) if rank > 0 else True
    out["third_tables"], out["third_version"] = tables_fresh(policy), policy.weight_version

    trainer3 = make_model(9)
    reversed_source = dict(reversed(list(trainer3.named_parameters())))
    out["fourth"] = attempt(
        lambda: policy.broadcast_weights(reversed_source if rank == 0 else None, bucket_bytes=BUCKET)
    )
    out["fourth_weights"] = state_equals(policy, trainer3, trainable) and tables_fresh(policy)
    return out


def refusals(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's model has a different value head (shape mismatch) -> abort; then the source's DTensor fails to
    materialise mid-stream -> abort; then a stale explicit version -> refused before any data; then a NaN from the
    source -> abort."""
    out: dict[str, Any] = {}
    policy = make_policy(0, value_source="prefix" if rank == 1 else "suffix")
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}

    def unchanged() -> bool:
        same = all(torch.equal(p, before[n]) for n, p in policy.model.named_parameters())
        return same and policy.weight_version == 0 and not policy.weight_sync.in_progress

    out["shape"] = attempt(
        lambda: policy.broadcast_weights(make_model(7) if rank == 0 else None, expected="all", bucket_bytes=BUCKET)
    )
    out["shape_unchanged"] = unchanged()

    source = None
    if rank == 0:
        params = list(make_model(7, value_source="prefix").named_parameters())
        source = [(n, FakeDTensor(p.detach(), "raise" if i == len(params) - 5 else "")) for i, (n, p) in
                  enumerate(params)]  # fmt: skip
    out["dtensor"] = attempt(
        lambda: broadcast_weights(policy.weight_sync if rank == 1 else None, source, expected="all",
                                  bucket_bytes=BUCKET)
    )  # fmt: skip
    out["dtensor_unchanged"] = unchanged()

    out["version"] = attempt(lambda: policy.broadcast_weights(policy.model if rank == 0 else None, version=0))
    out["version_unchanged"] = unchanged()

    poisoned = make_model(7, value_source="prefix")
    with torch.no_grad():
        poisoned.get_parameter(NAN_NAME)[3, 2] = float("nan")
    receiver = policy.weight_sync if rank == 1 else None
    out["nan"] = attempt(
        lambda: broadcast_weights(receiver, poisoned if rank == 0 else None, expected="all", bucket_bytes=BUCKET)
    )
    out["nan_unchanged"] = unchanged()
    return out


def rank_dies(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 (the trainer) dies after the manifest, with buckets on the wire: rank 1 raises within the process
    group's timeout, its update aborted and its weights unchanged."""
    policy = make_policy(0) if rank == 1 else None
    source = None
    if rank == 0:
        params = list(make_model(7).named_parameters())
        source = [(n, FakeDTensor(p.detach(), "die" if i == 40 else "")) for i, (n, p) in enumerate(params)]
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()} if policy else {}
    out = {"result": attempt(lambda: broadcast_weights(policy and policy.weight_sync, source, expected="all",
                                                       bucket_bytes=BUCKET))}  # fmt: skip
    assert policy is not None  # rank 0 exited inside the call
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in policy.model.named_parameters())
    out["in_progress"], out["version"] = policy.weight_sync.in_progress, policy.weight_version
    return out


def act_while_waiting(rank: int, world: int) -> dict[str, Any]:
    """A receiver waiting for rank src's message (a trainer still busy) does not hold its policy's lock: `act()`
    runs meanwhile. Rank 0 sends only once rank 1 has acted (a file), or gives up after 30 s."""
    import threading
    import time

    from helpers import make_inputs

    tmp = WORKDIR[0]
    policy = make_policy(0) if rank == 1 else None
    trainers = [make_model(7), make_model(8)]
    out: dict[str, Any] = {}
    sync = policy.weight_sync if policy is not None else None
    for i, trainer in enumerate(trainers):
        if i == 1 and rank == 0:
            deadline = time.monotonic() + 30
            while not Path(tmp, "acted").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            out["saw_act"] = Path(tmp, "acted").exists()  # False: rank 1's act waited for this message
        if i == 1 and rank == 1:
            results: dict[str, Any] = {}

            def receive(results: dict[str, Any] = results) -> None:
                results["r"] = attempt(lambda: broadcast_weights(sync, None, expected="all"))

            thread = threading.Thread(target=receive)
            thread.start()
            time.sleep(0.2)  # the sync is waiting for the message now (it does not come before we act)
            acted = policy.act_inputs(make_inputs(1, slots=(0, 1)))
            out["act_version"] = acted.header.weight_version
            Path(tmp, "acted").write_text("1")
            thread.join()
            out["second"] = results["r"]
            continue
        out["first" if i == 0 else "second"] = attempt(
            lambda trainer=trainer: broadcast_weights(sync, trainer if rank == 0 else None, expected="all")
        )
    if policy is not None:
        out["weights"] = state_equals(policy, trainers[1])
    return out


def cuda_buffers(rank: int, world: int) -> dict[str, Any]:
    """Policies and sources on the GPU, gloo with CUDA communication buffers (one GPU serves both ranks): the
    CUDA stream paths (receive into staging, the flag on the device, the commit on the compute stream) commit, and
    an Inf still aborts every rank."""
    torch.cuda.set_device(0)
    policy = Pi05Policy(
        make_model(0).cuda(),
        StandInProcessor(),
        RolloutConfig(num_steps=5),
        SchedulerConfig(max_batch_size=1, num_steps=(5,), camera_sets=((0, 1),), prompt_buckets=(16,)),
    )
    out: dict[str, Any] = {}
    for key, seed in (("first", 7), ("nan", 8), ("third", 9)):
        trainer = make_model(seed).cuda()
        if key == "nan":
            with torch.no_grad():
                trainer.get_parameter(NAN_NAME)[0, 0] = float("inf")
        out[key] = attempt(lambda trainer=trainer: broadcast_weights(
            policy.weight_sync, trainer if rank == 0 else None, expected="all", bucket_bytes=BUCKET, device="cuda"
        ))  # fmt: skip
        out[f"{key}_weights"] = state_equals(policy, make_model(7 if key == "nan" else seed)) and tables_fresh(policy)
    return out


SCENARIOS = {
    "commit_then_abort": commit_then_abort,
    "refusals": refusals,
    "rank_dies": rank_dies,
    "act_while_waiting": act_while_waiting,
    "cuda_buffers": cuda_buffers,
}
WORKDIR: list[str] = []  # the worker's tmp directory


def _worker(rank: int, world: int, scenario: str, tmp: str) -> None:
    torch.set_num_threads(1)
    WORKDIR[:] = [tmp]
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timeout)  # fmt: skip
    try:
        result = SCENARIOS[scenario](rank, world)
    except BaseException:  # report instead of hanging the parent on a bare exit code
        result = {"crash": traceback.format_exc()}
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    if scenario != "rank_dies":
        dist.destroy_process_group()


def run(scenario: str, world: int, tmp_path: Path, dies: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, scenario, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [3 if r in dies else 0 for r in range(world)], codes
    results = [{} if r in dies else json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r}:\n{res['crash']}"
    return results


# ------------------------------------------------------------------------------------------------ tests
def test_commit_everywhere_then_abort_everywhere(tmp_path: Path) -> None:
    results = run("commit_then_abort", 3, tmp_path)
    for r, res in enumerate(results):
        assert res["first"] == {"ok": True, "version": 1, "num_tensors": 103}, (r, res["first"])
        assert not res["second"]["ok"]
        assert "aborted on every rank; rank 2 failed while sending, receiving or validating" in res["second"]["error"]
        assert res["third"] == {"ok": True, "version": 5, "num_tensors": len(res["trainable"])}, (r, res["third"])
        assert res["third_weights"] and res["third_tables"] and res["third_version"] == 5 and res["third_frozen_kept"]
        assert res["fourth"] == {"ok": True, "version": 6, "num_tensors": len(res["trainable"])}, (r, res["fourth"])
        assert res["fourth_weights"]
        if r > 0:
            assert res["first_weights"] and res["first_tables"] and res["first_version"] == 1
            assert res["second_weights_kept"] and res["second_version"] == 1 and not res["second_in_progress"]
    assert "non-finite" in results[2]["second"]["error"] and NAN_NAME in results[2]["second"]["error"]


def test_refusals_abort_every_rank(tmp_path: Path) -> None:
    results = run("refusals", 2, tmp_path)
    for res in results:
        assert not res["shape"]["ok"] and "rank 1 failed while sending, receiving or" in res["shape"]["error"]
        assert not res["dtensor"]["ok"] and "rank 0 failed while sending" in res["dtensor"]["error"]
        assert not res["version"]["ok"] and "rank 0 refused the update" in res["version"]["error"]
        assert "version must increase" in res["version"]["error"]
        assert not res["nan"]["ok"] and "rank 1 failed while sending, receiving or validating" in res["nan"]["error"]
        assert all(res[f"{key}_unchanged"] for key in ("shape", "dtensor", "version", "nan"))
    assert "non-finite" in results[1]["nan"]["error"] and NAN_NAME in results[1]["nan"]["error"]
    assert "expected shape" in results[1]["shape"]["error"]
    assert "NCCL timeout while gathering shards" in results[0]["dtensor"]["error"]


def test_a_rank_that_dies_mid_broadcast_fails_the_others(tmp_path: Path) -> None:
    results = run("rank_dies", 2, tmp_path, dies=(0,))
    res = results[1]
    assert not res["result"]["ok"] and "a collective failed on rank 1" in res["result"]["error"], res
    assert res["unchanged"] and not res["in_progress"] and res["version"] == 0


def test_act_runs_while_a_receiver_waits_for_the_message(tmp_path: Path) -> None:
    results = run("act_while_waiting", 2, tmp_path)
    for r, res in enumerate(results):
        assert res["first"]["ok"] and res["second"] == {"ok": True, "version": 2, "num_tensors": 103}, (r, res)
    assert results[0]["saw_act"]  # rank 1 acted while its sync waited for rank 0's message
    assert results[1]["act_version"] == 1 and results[1]["weights"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_suite.py)")
def test_cuda_buffers_commit_and_abort(tmp_path: Path) -> None:
    results = run("cuda_buffers", 2, tmp_path)
    for r, res in enumerate(results):
        assert res["first"] == {"ok": True, "version": 1, "num_tensors": 103} and res["first_weights"], (r, res)
        assert not res["nan"]["ok"] and "failed while sending, receiving or validating" in res["nan"]["error"]
        assert res["nan_weights"], (r, res)
        assert res["third"] == {"ok": True, "version": 2, "num_tensors": 103} and res["third_weights"], (r, res)
    assert NAN_NAME in results[1]["nan"]["error"]
