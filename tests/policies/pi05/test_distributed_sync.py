"""Weight sync across processes (DESIGN C6) over gloo: all ranks commit one version, or all abort and keep theirs.

Each test spawns a small process group (file:// rendezvous in tmp_path). Workers write one JSON result per
rank; the parent asserts on them, so a failing worker shows its traceback in the JSON rather than a hang.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import StandInProcessor

from policies.pi05.config import Pi05Config
from policies.pi05.distributed_sync import _build_entries, broadcast_weights
from policies.pi05.model import Pi05Model, randomize_parameters_
from policies.pi05.policy import Pi05Policy, RolloutConfig
from policies.pi05.rollout import RolloutTables
from policies.pi05.scheduler import SchedulerConfig
from policies.pi05.weight_sync import WeightSyncError

BUCKET = 1 << 20  # 1 MiB: many buckets, and tensors that span several of them



def make_model(seed: int, value_source: str = "suffix") -> Pi05Model:
    model = Pi05Model(Pi05Config.tiny(value_source=value_source))
    randomize_parameters_(model, seed)
    return model.set_precision(torch.float32).eval()


def make_policy(seed: int = 0, value_source: str = "suffix") -> Pi05Policy:
    sched = SchedulerConfig(max_batch_size=1, num_steps=(5,), camera_sets=((0, 1),), prompt_buckets=(16,))
    return Pi05Policy(make_model(seed, value_source), StandInProcessor(), RolloutConfig(num_steps=5), sched)


def state_equals(policy: Pi05Policy, model: Pi05Model, names: list[str] | None = None) -> bool:
    theirs = dict(model.named_parameters())
    return all(torch.equal(p, theirs[n]) for n, p in policy.model.named_parameters() if names is None or n in names)


def tables_fresh(policy: Pi05Policy) -> bool:
    fresh = RolloutTables(policy.model, (5,))
    return torch.equal(fresh[5].modulation, policy.scheduler.tables[5].modulation)


def attempt(fn) -> dict[str, Any]:
    try:
        report = fn()
        return {"ok": True, "version": report.version, "num_tensors": report.num_tensors}
    except WeightSyncError as err:
        return {"ok": False, "error": str(err)}


class FakeDTensor:
    """Duck-typed DTensor whose materialisation fails for one tensor (a trainer-side failure mid-stream)."""

    def __init__(self, full: torch.Tensor, fail: bool) -> None:
        self.full, self.shape, self.dtype, self.fail = full, full.shape, full.dtype, fail

    def full_tensor(self) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("NCCL timeout while gathering shards")
        return self.full.clone()


# ------------------------------------------------------------------------------------------- scenarios
def commit_then_nan(rank: int, world: int) -> dict[str, Any]:
    """Rank 0: trainer-only source. Ranks 1..: policies. 1) commit all; 2) NaN on the last rank -> abort;
    3) rank 0 also holds a policy, explicit version 5 -> commit."""
    policy = make_policy(0) if rank > 0 else None
    out: dict[str, Any] = {}
    trainer = make_model(7)
    out["first"] = attempt(
        lambda: broadcast_weights(policy, trainer if rank == 0 else None, expected="all", bucket_bytes=BUCKET)
    )
    if policy is not None:
        out["first_weights"] = state_equals(policy, trainer)
        out["first_tables"] = tables_fresh(policy)
        out["first_version"] = policy.weight_version

    trainer2 = make_model(8)
    if rank == world - 1:
        assert policy is not None
        original = policy.update_weights

        def poisoned(named):  # receiver-side corruption: NaN in one staged tensor
            named = [(n, t.clone().fill_(float("nan")) if n.endswith("mlp.down_proj.weight") else t) for n, t in named]
            return original(named)

        policy.update_weights = poisoned  # type: ignore[method-assign]
    out["second"] = attempt(
        lambda: broadcast_weights(policy, trainer2 if rank == 0 else None, expected="trainable", bucket_bytes=BUCKET)
    )
    if policy is not None:
        out["second_weights_kept"] = state_equals(policy, trainer)
        out["second_version"] = policy.weight_version
        out["second_in_progress"] = policy.weight_update_in_progress
        policy.__dict__.pop("update_weights", None)

    if rank == 0:
        policy = make_policy(0)
    assert policy is not None
    out["third"] = attempt(
        lambda: broadcast_weights(
            policy, trainer2 if rank == 0 else None, expected="trainable", version=5, bucket_bytes=BUCKET
        )
    )
    trainable = out["trainable"] = [n for n, _ in policy.trainable_parameters()]
    out["third_weights"] = state_equals(policy, trainer2, trainable)
    out["third_frozen_kept"] = (
        state_equals(policy, trainer, [n for n, _ in policy.model.named_parameters() if n not in trainable])
        if rank > 0
        else True
    )
    out["third_tables"] = tables_fresh(policy)
    out["third_version"] = policy.weight_version

    # 4) the source in reverse order: no receiver's staging layout matches, so windows are received into
    # temporary buffers and staged from them (tensors spanning windows assembled); rank 0 sends as a trainer
    # from its two send buffers; 5) the same with rank 0's own policy staging from what it sends
    trainer3 = make_model(9)
    reversed_source = dict(reversed(list(trainer3.named_parameters())))
    for key, receiver in (("fourth", policy if rank > 0 else None), ("fifth", policy)):
        out[key] = attempt(
            lambda receiver=receiver: broadcast_weights(
                receiver, reversed_source if rank == 0 else None, expected="trainable", bucket_bytes=BUCKET
            )
        )
        out[f"{key}_weights"] = state_equals(policy, trainer3, trainable) if receiver is not None else None
    return out


def refusals(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's model has a different value head (shape mismatch) -> refused before data moves; then the
    source's DTensor fails to materialise mid-stream -> abort; then a stale explicit version -> refused."""
    out: dict[str, Any] = {}
    policy = make_policy(0, value_source="prefix" if rank == 1 else "suffix")
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}

    def unchanged() -> bool:
        return all(torch.equal(p, before[n]) for n, p in policy.model.named_parameters())

    out["shape"] = attempt(
        lambda: broadcast_weights(policy, make_model(7) if rank == 0 else None, expected="all", bucket_bytes=BUCKET)
    )
    out["shape_unchanged"] = unchanged() and policy.weight_version == 0

    source = None
    if rank == 0:
        params = list(make_model(7, value_source="prefix").named_parameters())
        source = [(n, FakeDTensor(p.detach(), fail=(i == len(params) - 5))) for i, (n, p) in enumerate(params)]
    out["dtensor"] = attempt(
        lambda: broadcast_weights(policy if rank == 1 else None, source, expected="all", bucket_bytes=BUCKET)
    )
    out["dtensor_unchanged"] = unchanged() and policy.weight_version == 0

    out["version"] = attempt(
        lambda: broadcast_weights(policy, policy.model if rank == 0 else None, expected="trainable", version=0)
    )
    out["version_unchanged"] = unchanged() and policy.weight_version == 0

    # a NaN from the source in a region every receiver takes straight into its staging buffer (checked per window
    # on the receiving side, the flag and-ed into the vote on the device)
    poisoned = make_model(7, value_source="prefix")
    with torch.no_grad():
        dict(poisoned.named_parameters())["expert.layers.1.mlp.up_proj.weight"][3, 2] = float("nan")
    receiver = make_policy(0, value_source="prefix") if rank == 1 else None
    if receiver is not None:
        receiver.begin_weight_update("all")
        layout = receiver.staging_layout()
        receiver.abort_weight_update()
        entries = _build_entries(dict(poisoned.named_parameters()), "all")
        out["nan_direct_layout"] = len(_direct_regions_of(receiver, entries)) == len(layout)
    out["nan"] = attempt(
        lambda: broadcast_weights(receiver, poisoned if rank == 0 else None, expected="all", bucket_bytes=BUCKET)
    )
    out["nan_unchanged"] = receiver is None or (receiver.weight_version == 0 and not receiver.weight_update_in_progress)
    return out


def _direct_regions_of(policy: Pi05Policy, entries: list) -> dict:
    from policies.pi05.distributed_sync import _direct_regions

    policy.begin_weight_update("all")
    try:
        return _direct_regions(policy.staging_layout(), entries, [True] * len(entries))[0]
    finally:
        policy.abort_weight_update()


def long_manifest(rank: int, world: int) -> dict[str, Any]:
    """A first message too small for the manifest: the rest goes in a second message (pi05_base's whole manifest
    takes ~11,000 of the 16,384 elements; a larger model would overflow)."""
    from policies.pi05 import distributed_sync

    distributed_sync._FIRST = 64
    policy = make_policy(0) if rank > 0 else None
    trainer = make_model(7)
    out = {"first": attempt(lambda: broadcast_weights(policy, trainer if rank == 0 else None, expected="all"))}
    out["weights"] = state_equals(policy, trainer) if policy is not None else None
    return out


def cuda_buffers(rank: int, world: int) -> dict[str, Any]:
    """Policies and sources on the GPU, gloo with CUDA communication buffers (one GPU serves both ranks): the
    CUDA stream paths (receive into staging, per-window reductions on the side stream, the vote on the device,
    tables prepared from the staged values) commit, a NaN still aborts every rank, and receives queued into the
    kept staging buffers before the update opens commit."""
    torch.cuda.set_device(0)
    policy = Pi05Policy(
        make_model(0).cuda(),
        StandInProcessor(),
        RolloutConfig(num_steps=5),
        SchedulerConfig(max_batch_size=1, num_steps=(5,), camera_sets=((0, 1),), prompt_buckets=(16,)),
    )
    trainer = make_model(7).cuda()
    out = {"first": attempt(lambda: broadcast_weights(policy, trainer if rank == 0 else None, expected="all",
                                                      bucket_bytes=BUCKET, device="cuda"))}  # fmt: skip
    out["weights"] = state_equals(policy, trainer)
    out["tables"] = torch.equal(RolloutTables(policy.model, (5,))[5].modulation, policy.scheduler.tables[5].modulation)
    poisoned = make_model(8).cuda()
    with torch.no_grad():
        dict(poisoned.named_parameters())["expert.layers.1.mlp.up_proj.weight"][0, 0] = float("inf")
    out["nan"] = attempt(lambda: broadcast_weights(policy, poisoned if rank == 0 else None, expected="all",
                                                   bucket_bytes=BUCKET, device="cuda"))  # fmt: skip
    out["kept"] = state_equals(policy, trainer) and policy.weight_version == 1
    # the kept staging buffers: receives queued before the update opens, then a commit
    trainer = make_model(9).cuda()
    out["third"] = attempt(lambda: broadcast_weights(policy, trainer if rank == 0 else None, expected="all",
                                                     bucket_bytes=BUCKET, device="cuda"))  # fmt: skip
    out["third_weights"] = state_equals(policy, trainer) and torch.equal(
        RolloutTables(policy.model, (5,))[5].modulation, policy.scheduler.tables[5].modulation
    )
    return out


def early_receives(rank: int, world: int) -> dict[str, Any]:
    """A receiver that kept its staging buffers from the last update queues its receives into them before it
    opens the next update. 1) nothing kept yet; 2) kept: receives first; 3) a parameter replaced on the receiver
    (its plan and staging rebuilt): the bytes land in the old buffers and are staged from them; 4) a stale version
    refused after the receives were queued: every rank aborts and keeps its weights; 5) the next one commits."""
    from policies.pi05 import distributed_sync

    policy = make_policy(0) if rank > 0 else None
    marks: list[str] = []
    distributed_sync.phase_hook = marks.append
    out: dict[str, Any] = {}
    trainers = [make_model(seed) for seed in (7, 8, 9, 10)]
    names = [n for n, p in make_policy(0).trainable_parameters()]

    def broadcast(key: str, trainer: Pi05Model, **kwargs: Any) -> None:
        marks.clear()
        source = {n: p for n, p in trainer.named_parameters() if n in names}  # what the receivers stage, in order
        out[key] = attempt(
            lambda: broadcast_weights(policy, source if rank == 0 else None, expected="trainable",
                                      bucket_bytes=BUCKET, **kwargs)
        )  # fmt: skip
        out[f"{key}_receives_first"] = marks.index("queued") < marks.index("begin")
        if policy is not None:
            out[f"{key}_weights"] = [i for i, t in enumerate(trainers) if state_equals(policy, t, names)]
            out[f"{key}_tables"] = tables_fresh(policy)
            out[f"{key}_in_progress"] = policy.weight_update_in_progress

    broadcast("first", trainers[0])
    broadcast("second", trainers[1])
    if policy is not None:
        module = policy.model.get_submodule("action_out_proj")
        module.weight = torch.nn.Parameter(module.weight.detach().clone())
    broadcast("third", trainers[2])
    broadcast("fourth", trainers[3], version=1)
    broadcast("fifth", trainers[3])
    distributed_sync.phase_hook = None
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
    for i, trainer in enumerate(trainers):
        if i == 1 and rank == 0:
            deadline = time.monotonic() + 30
            while not Path(tmp, "acted").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            out["saw_act"] = Path(tmp, "acted").exists()  # False: rank 1's act waited for this message
        if i == 1 and rank == 1:
            results: dict[str, Any] = {}

            def sync(results: dict[str, Any] = results) -> None:
                results["r"] = attempt(lambda: broadcast_weights(policy, None, expected="all"))

            thread = threading.Thread(target=sync)
            thread.start()
            time.sleep(0.2)  # the sync is waiting for the message now (it does not come before we act)
            acted = policy.act_inputs(make_inputs(1, slots=(0, 1)))
            out["act_version"] = acted.header.weight_version
            Path(tmp, "acted").write_text("1")
            thread.join()
            out["second"] = results["r"]
            continue
        out["first" if i == 0 else "second"] = attempt(
            lambda trainer=trainer: broadcast_weights(policy, trainer if rank == 0 else None, expected="all")
        )
    if policy is not None:
        out["weights"] = state_equals(policy, trainers[1])
    return out


SCENARIOS = {
    "commit_then_nan": commit_then_nan,
    "refusals": refusals,
    "long_manifest": long_manifest,
    "cuda_buffers": cuda_buffers,
    "early_receives": early_receives,
    "act_while_waiting": act_while_waiting,
}
WORKDIR: list[str] = []  # the worker's tmp directory


def _worker(rank: int, world: int, scenario: str, tmp: str) -> None:
    torch.set_num_threads(1)
    WORKDIR[:] = [tmp]
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        result = SCENARIOS[scenario](rank, world)
    except BaseException:  # report instead of hanging the parent on a bare exit code
        result = {"crash": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))


def run(scenario: str, world: int, tmp_path: Path) -> list[dict[str, Any]]:
    mp.spawn(_worker, args=(world, scenario, str(tmp_path)), nprocs=world, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r}:\n{res['crash']}"
    return results


# ------------------------------------------------------------------------------------------------ tests
def test_commit_everywhere_then_abort_everywhere(tmp_path: Path) -> None:
    results = run("commit_then_nan", 3, tmp_path)
    for r, res in enumerate(results):
        assert res["first"] == {"ok": True, "version": 1, "num_tensors": 103}, (r, res["first"])
        assert not res["second"]["ok"]
        assert "aborted on every rank; rank 2 failed while sending, receiving or validating" in res["second"]["error"]
        assert res["third"]["ok"] and res["third"]["version"] == 5, (r, res["third"])
        assert res["third_weights"] and res["third_tables"] and res["third_version"] == 5
        assert res["third_frozen_kept"]
        sent = 103 if r == 0 else len(res["trainable"])  # a rank without a policy reports the whole manifest
        assert res["fourth"] == {"ok": True, "version": 6, "num_tensors": sent}, (r, res["fourth"])
        assert res["fourth_weights"] is (True if r > 0 else None)
        assert res["fifth"] == {"ok": True, "version": 7, "num_tensors": len(res["trainable"])}, (r, res["fifth"])
        assert res["fifth_weights"]
        if r > 0:
            assert res["first_weights"] and res["first_tables"] and res["first_version"] == 1
            assert res["second_weights_kept"] and res["second_version"] == 1 and not res["second_in_progress"]
    assert "non-finite" in results[2]["second"]["error"] and "down_proj" in results[2]["second"]["error"]


def test_refusals_abort_every_rank(tmp_path: Path) -> None:
    results = run("refusals", 2, tmp_path)
    for res in results:
        assert not res["shape"]["ok"] and "rank 1 refused the manifest" in res["shape"]["error"]
        assert res["shape_unchanged"]
        assert not res["dtensor"]["ok"] and "rank 0 failed while sending" in res["dtensor"]["error"]
        assert res["dtensor_unchanged"]
        assert not res["version"]["ok"] and "rank 0 refused the manifest" in res["version"]["error"]
        assert "version must increase" in res["version"]["error"]
        assert res["version_unchanged"]
        assert not res["nan"]["ok"] and "rank 1 failed while sending, receiving or validating" in res["nan"]["error"]
        assert res["nan_unchanged"]
    assert results[1]["nan_direct_layout"]
    nan_error = results[1]["nan"]["error"]
    assert "non-finite" in nan_error and "expert.layers.1.mlp.up_proj.weight" in nan_error
    assert "expected shape" in results[1]["shape"]["error"]
    assert "NCCL timeout while gathering shards" in results[0]["dtensor"]["error"]


def test_receivers_queue_their_receives_before_opening_the_update(tmp_path: Path) -> None:
    results = run("early_receives", 2, tmp_path)
    for r, res in enumerate(results):
        for key, version in (("first", 1), ("second", 2), ("third", 3), ("fifth", 4)):
            assert res[key]["ok"] and res[key]["version"] == version, (r, key, res[key])
        assert not res["fourth"]["ok"] and "rank 1 refused the manifest" in res["fourth"]["error"], (r, res["fourth"])
    receiver = results[1]
    assert "version must increase" in receiver["fourth"]["error"]
    assert not receiver["first_receives_first"]  # nothing kept yet: the update opens first
    assert all(receiver[f"{k}_receives_first"] for k in ("second", "third", "fourth", "fifth"))
    # the weights of trainer i after each step (fourth: refused, the third's stay), the tables refreshed
    expected = {"first": [0], "second": [1], "third": [2], "fourth": [2], "fifth": [3]}
    for key, weights in expected.items():
        assert receiver[f"{key}_weights"] == weights, (key, receiver[f"{key}_weights"])
        assert receiver[f"{key}_tables"] and not receiver[f"{key}_in_progress"], key


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
        assert res["first"] == {"ok": True, "version": 1, "num_tensors": 103}, (r, res["first"])
        assert res["weights"] and res["tables"] and res["kept"], (r, res)
        assert not res["nan"]["ok"] and "failed while sending, receiving or validating" in res["nan"]["error"]
        assert res["third"] == {"ok": True, "version": 2, "num_tensors": 103} and res["third_weights"], (r, res)
    assert "expert.layers.1.mlp.up_proj.weight" in results[1]["nan"]["error"]


def test_manifest_longer_than_the_first_message(tmp_path: Path) -> None:
    results = run("long_manifest", 2, tmp_path)
    for r, res in enumerate(results):
        assert res["first"] == {"ok": True, "version": 1, "num_tensors": 103}, (r, res["first"])
    assert results[1]["weights"]


@pytest.mark.parametrize("bucket", [16, 1000, 64 << 20])
def test_manifest_round_trip(bucket: int) -> None:
    """Packing and unpacking without a process group: every tensor's bytes land where the manifest says."""
    from policies.pi05.distributed_sync import _build_entries, _decode_meta, _encode_meta, _Packer, _windows

    tensors = {
        "a": torch.arange(7, dtype=torch.float32),
        "b": torch.ones(3, 5, dtype=torch.bfloat16) * 2.5,
        "c": torch.tensor(3.0, dtype=torch.float64),
        "d": torch.zeros(0, 4),
    }
    entries = _build_entries(tensors, "all")
    entries[0].name = "a_é"  # non-ASCII, and a names blob whose length is no multiple of 8
    names = b"".join(e.name.encode() for e in entries)
    meta = _encode_meta(entries, names)
    decoded = _decode_meta(meta, len(entries), sum(len(e.shape) for e in entries), len(names))
    entries[0].name = decoded[0].name = "a"
    assert [(e.name, e.shape, e.dtype, e.offset, e.nbytes) for e in decoded] == [
        (e.name, e.shape, e.dtype, e.offset, e.nbytes) for e in entries
    ]
    # one region per dtype, in first-appearance order, 16-byte aligned; tensors back to back inside a region
    assert [e.name for e in entries] == ["a", "d", "b", "c"]
    assert [e.offset for e in entries] == [0, 28, 32, 64]
    total = entries[-1].end
    payload = torch.full((total,), 255, dtype=torch.uint8)
    bucket = max(16, bucket // 16 * 16)
    windows = _windows(entries, bucket)
    packer = _Packer(entries, windows, torch.device("cpu"))
    assert all(hi - lo <= bucket for lo, hi, _ in windows)
    assert {start for _, _, start in windows} == {0, 32, 64}  # windows never cross a region
    for j, (lo, hi, _) in enumerate(windows):
        payload[lo:hi] = packer.window(j)
    for e in decoded:
        got = payload[e.offset : e.end].view(e.dtype).view(e.shape)
        assert torch.equal(got, tensors[e.name]), e.name


def test_windows_end_at_tensor_boundaries_and_pack_the_source_bytes() -> None:
    """Windows hold whole tensors (as many as fit) or one piece of a tensor larger than a bucket, never cross a
    region, and cover the payload; packing gives the source's bytes for plain, strided and DTensor sources."""
    from policies.pi05.distributed_sync import _build_entries, _Packer, _windows

    g = torch.Generator().manual_seed(0)
    sizes = [3, 40, 5, 5, 100, 2, 0, 7, 64, 1]  # float32 elements; the bucket below holds 32
    tensors: dict[str, Any] = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    tensors["t4"] = torch.randn(10, 10, generator=g).t()  # not contiguous, larger than a bucket
    tensors["t8"] = FakeDTensor(torch.randn(8, 8, generator=g), fail=False)  # materialised once for its pieces
    tensors["h"] = torch.randn(9, generator=g).to(torch.bfloat16)
    entries = _build_entries(tensors, "all")
    bucket = 32 * 4
    windows = _windows(entries, bucket)
    assert windows == [  # (lo, hi, region start)
        (0, 12, 0), (12, 140, 0), (140, 172, 0),  # t0 | t1 (160 B) in pieces, the last alone
        (172, 212, 0), (212, 340, 0), (340, 468, 0), (468, 596, 0), (596, 612, 0),  # t2, t3 | t4 (400 B) in pieces
        (612, 648, 0), (648, 776, 0), (776, 904, 0), (904, 908, 0),  # t5, t6 (empty), t7 | t8 in pieces | t9
        (912, 930, 912),  # the bfloat16 region, 16-byte aligned
    ]  # fmt: skip
    boundaries = {e.offset for e in entries} | {e.end for e in entries}
    for lo, hi, region in windows:
        assert hi - lo <= bucket
        inside = [e for e in entries if e.nbytes and e.offset < hi and e.end > lo]
        assert len({e.dtype for e in inside}) == 1
        assert region == min(e.offset for e in entries if e.dtype == inside[0].dtype)
        assert (lo in boundaries and hi in boundaries) or len(inside) == 1  # only a piece cuts a tensor
    covered = sorted((lo, hi) for lo, hi, _ in windows)
    assert all(a[1] == b[0] or (a[1], b[0]) == (908, 912) for a, b in zip(covered, covered[1:]))  # no gaps
    payload = torch.zeros(entries[-1].end, dtype=torch.uint8)
    packer = _Packer(entries, windows, torch.device("cpu"))
    for j, (lo, hi, _) in enumerate(windows):
        payload[lo:hi] = packer.window(j)
    for e in entries:
        source = tensors[e.name]
        expected = source.full if isinstance(source, FakeDTensor) else source
        assert torch.equal(payload[e.offset : e.end].view(e.dtype).view(e.shape), expected), e.name


def test_direct_regions_receive_into_the_staging_buffers() -> None:
    """A region lands straight in the staging buffer only when the buffer holds exactly its tensors in order."""
    from policies.pi05.distributed_sync import _build_entries, _direct_regions, _Packer, _windows

    policy, sender = make_policy(0), make_model(1)
    policy.set_trainable("expert")
    for p in sender.parameters():
        p.requires_grad_(False)
    source = {n: p for n, p in sender.named_parameters() if n in dict(policy.trainable_parameters())}
    entries = _build_entries(source, "trainable")
    keep = [True] * len(entries)
    policy.begin_weight_update("trainable")
    direct, names = _direct_regions(policy.staging_layout(), entries, keep)
    assert len(direct) == len(policy.staging_layout()) and sorted(names) == sorted(source)
    windows = _windows(entries, 4096)
    packer = _Packer(entries, windows, torch.device("cpu"))
    for j, (lo, hi, region) in enumerate(windows):
        direct[region][0][lo - region : hi - region] = packer.window(j)
    policy.mark_staged(names)
    policy.finish_weight_update()
    assert state_equals(policy, sender, list(source)) and tables_fresh(policy)

    # another order in a region, or a tensor the receiver skips: that region goes through the staging copies
    shuffled = dict(reversed(list(source.items())))
    policy.begin_weight_update("trainable")
    direct, names = _direct_regions(policy.staging_layout(), _build_entries(shuffled, "trainable"), keep)
    assert direct == {} and names == []
    direct, _ = _direct_regions(policy.staging_layout(), entries, [False] + keep[1:])
    assert len(direct) == len(policy.staging_layout()) - 1
    policy.abort_weight_update()


def test_source_manifest_is_reused_only_for_the_same_tensors() -> None:
    """Rank src reuses its manifest while the source holds the same tensor objects, names, shapes and dtypes, and
    keeps no reference to the tensors between calls."""
    import gc
    import weakref

    from policies.pi05.distributed_sync import _SENT, _manifest, _release_values

    model = make_model(3)
    source = {n: p for n, p in model.named_parameters()}
    entries, meta, _ = _manifest(source, "all")
    assert _manifest(source, "all")[1] is meta  # reused
    assert _manifest(dict(source), "all")[1] is meta  # another dict, the same tensors
    assert _manifest(source, "trainable")[1] is not meta  # another expected set
    entries, meta, _ = _manifest(source, "all")
    name = "expert.layers.0.mlp.up_proj.weight"
    replaced = {**source, name: source[name].detach().clone()}  # same shape and dtype, another object
    entries2, meta2, _ = _manifest(replaced, "all")
    assert meta2 is not meta and torch.equal(meta2, meta)
    assert next(e for e in entries2 if e.name == name).value is replaced[name]
    _release_values(entries2)
    probe = weakref.ref(replaced[name])
    del replaced, entries2
    gc.collect()
    assert probe() is None  # the cache did not keep it alive
    assert _manifest(source, "all")[1] is not meta2  # its weak reference is dead: rebuilt
    _release_values(_SENT["entries"])

    # a module source: its parameter table is cached; a replaced parameter, a new shape or another trainable set
    # rebuilds the manifest
    entries, meta, _ = _manifest(model, "trainable")
    assert _manifest(model, "trainable")[1] is meta and len(entries) == len(source)
    model.action_out_proj.bias.requires_grad_(False)
    entries, meta, _ = _manifest(model, "trainable")
    assert len(entries) == len(source) - 1 and "action_out_proj.bias" not in {e.name for e in entries}
    model.action_out_proj.bias = torch.nn.Parameter(torch.zeros(model.action_out_proj.bias.shape))
    entries, meta2, _ = _manifest(model, "trainable")
    assert meta2 is not meta and next(e for e in entries if e.name == "action_out_proj.bias").value is (
        model.action_out_proj.bias
    )
    model.action_out_proj.bias.data = torch.zeros(3)  # same object, another shape
    entries, meta3, _ = _manifest(model, "trainable")
    assert meta3 is not meta2 and next(e for e in entries if e.name == "action_out_proj.bias").shape == (3,)
    _release_values(_SENT["entries"])
