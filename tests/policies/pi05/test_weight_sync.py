"""Weight sync (DESIGN C6) on one process: commit equivalence, all-or-nothing failures, lifecycle, dtypes, names.

The core check is an equivalence test: after a sync, the scheduler path (static buffers, refreshed tables)
must equal a freshly built policy whose model holds the new weights, with the same inputs and seeds. Every
failure must leave every parameter (and the weight-derived tables) bit-identical and the policy serving.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from helpers import StandInProcessor

from policies.pi05 import geglu_gemm
from policies.pi05.checkpoint import DEAD_KEYS, TIED_EMBEDDING, to_external_name
from policies.pi05.config import Pi05Config
from policies.pi05.inputs import ModelInputs
from policies.pi05.model import Pi05Model, randomize_parameters_
from policies.pi05.policy import Pi05Policy, RolloutConfig
from policies.pi05.rollout import RolloutTables
from policies.pi05.scheduler import SchedulerConfig
from policies.pi05.weight_sync import WeightSyncError, WeightSyncStateError, WeightUpdateReport

SEEDS = [0, 1]



def make_model(seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32, **overrides: Any) -> Pi05Model:
    model = Pi05Model(Pi05Config.tiny(value_source="suffix", **overrides))
    randomize_parameters_(model, seed)
    return model.to(device).set_precision(dtype).eval()


def make_policy(model: Pi05Model, max_batch_size: int = 2) -> Pi05Policy:
    sched = SchedulerConfig(max_batch_size=max_batch_size, num_steps=(5,), camera_sets=((0, 1),), prompt_buckets=(16,))
    return Pi05Policy(model, StandInProcessor(), RolloutConfig(num_steps=5, action_chunk=4), sched)


def make_inputs(n: int, device: str = "cpu") -> ModelInputs:
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, 17, (n,), generator=gen).int()
    tokens = torch.randint(1, 1000, (n, 16), generator=gen).int() * (torch.arange(16)[None] < lengths[:, None]).int()
    return ModelInputs(
        images=torch.randint(0, 256, (n, 2, 3, 224, 224), generator=gen, dtype=torch.uint8).to(device),
        image_mask=torch.ones(n, 2, dtype=torch.bool, device=device),
        slots=(0, 1),
        tokens=tokens.to(device),
        lengths=lengths.to(device),
    )


def snapshot(policy: Pi05Policy) -> dict[str, torch.Tensor]:
    state = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    for k, table in policy.scheduler.tables.tables.items():
        state[f"table{k}"] = table.modulation.clone()
    return state


def assert_unchanged(policy: Pi05Policy, before: dict[str, torch.Tensor]) -> None:
    after = snapshot(policy)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert not changed, f"changed by a failed update: {changed[:5]}"
    for n, p in policy.model.named_parameters():
        assert p.dtype == before[n].dtype


def act(policy: Pi05Policy, inputs: ModelInputs):
    return policy.act_inputs(inputs, seeds=SEEDS[: inputs.batch_size])


def assert_same_outputs(a, b) -> None:
    for field in ("actions", "log_prob", "values", "chains"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


@pytest.fixture(scope="module")
def inputs() -> ModelInputs:
    return make_inputs(2)


@pytest.fixture(scope="module")
def new_model() -> Pi05Model:
    return make_model(seed=7)


@pytest.fixture(scope="module")
def shared(inputs: ModelInputs) -> tuple[Pi05Policy, Any]:
    """A policy that failure tests must leave untouched, and its output before any of them."""
    policy = make_policy(make_model(seed=0))
    return policy, act(policy, inputs)


# ------------------------------------------------------------------------------------------ commit path
def test_sync_equals_fresh_policy_with_new_weights(inputs: ModelInputs, new_model: Pi05Model) -> None:
    policy = make_policy(make_model(seed=0))
    old = act(policy, inputs)
    report = policy.sync_weights(new_model, expected="all")
    assert report.version == policy.weight_version == 1
    assert report.num_tensors == len(list(new_model.parameters())) and report.num_bytes == report.source_bytes
    assert report.names[0] == "vision.embeddings.patch_embedding.weight" and report.duration_s > 0
    for (n, p), q in zip(policy.model.named_parameters(), new_model.parameters()):
        assert torch.equal(p, q), n
    synced = act(policy, inputs)
    fresh = act(make_policy(make_model(seed=7)), inputs)
    assert_same_outputs(synced, fresh)
    assert not torch.equal(synced.actions, old.actions)
    assert synced.header.weight_version == 1 and old.header.weight_version == 0


def test_stale_tables_would_be_caught(inputs: ModelInputs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only expert-side weights change (the tables depend on them); without the refresh outputs go stale."""
    policy, reference = make_policy(make_model(seed=0)), make_policy(make_model(seed=0))
    trainer = make_model(seed=0)
    with torch.no_grad():
        for p in trainer.time_mlp_in.parameters():
            p.mul_(1.5)
    report = reference.sync_weights(trainer)  # trainable set, refresh on
    assert report.skipped and all(not n.startswith(("expert.", "time_mlp")) for n in report.skipped)
    monkeypatch.setattr(policy.scheduler, "refresh_tables", lambda names=None: None)
    policy.sync_weights(trainer)
    fresh_model = make_model(seed=0)
    fresh_model.load_state_dict(trainer.state_dict())
    fresh = act(make_policy(fresh_model), inputs)
    assert_same_outputs(act(reference, inputs), fresh)
    assert not torch.equal(act(policy, inputs).actions, fresh.actions)


def test_act_serves_old_weights_until_commit(inputs: ModelInputs, new_model: Pi05Model) -> None:
    policy = make_policy(make_model(seed=0))
    before = act(policy, inputs)
    policy.begin_weight_update("all")
    params = list(new_model.named_parameters())
    policy.update_weights(dict(params[: len(params) // 2]))
    policy.update_weights(params[len(params) // 2 :][::-1])  # any order, any number of calls
    during = act(policy, inputs)
    assert_same_outputs(during, before)
    assert during.header.weight_version == 0
    policy.finish_weight_update()
    after = act(policy, inputs)
    assert after.header.weight_version == 1 and not torch.equal(after.actions, before.actions)


def test_versions_increase_and_reach_the_header(shared, inputs: ModelInputs) -> None:
    policy = make_policy(make_model(seed=0))
    versions = [policy.sync_weights(policy.model).version for _ in range(3)]  # self-sync: a no-op commit
    assert versions == [1, 2, 3]
    assert act(policy, inputs).header.weight_version == 3
    with pytest.raises(WeightSyncError, match="version must increase"):
        policy.begin_weight_update()
        policy.update_weights(policy.trainable_parameters())
        policy.finish_weight_update(version=3)
    assert policy.weight_version == 3 and not policy.weight_sync.in_progress
    policy.begin_weight_update()
    policy.update_weights(policy.trainable_parameters())
    assert policy.finish_weight_update(version=10).version == 10


# ------------------------------------------------------------------------------------- failure modes
def _abort_midway(policy: Pi05Policy, source: Pi05Model) -> None:
    policy.begin_weight_update("all")
    policy.update_weights(list(source.named_parameters())[:40])
    policy.abort_weight_update()
    raise WeightSyncError("aborted on purpose")


def _iterator_raises(policy: Pi05Policy, source: Pi05Model) -> None:
    def pairs():
        for i, item in enumerate(source.named_parameters()):
            if i == 50:
                raise OSError("connection to the trainer lost")
            yield item

    policy.sync_weights(pairs(), expected="all")


def _nan(policy: Pi05Policy, source: Pi05Model) -> None:
    state = {n: p.detach().clone() for n, p in source.named_parameters()}
    state["expert.layers.1.mlp.down_proj.weight"][3, 4] = float("nan")
    policy.sync_weights(state, expected="all")


def _inf_after_cast(policy: Pi05Policy, source: Pi05Model) -> None:
    state = {n: p.detach().double() for n, p in source.named_parameters()}
    state["action_out_proj.weight"][0, 0] = 1e300  # finite in float64, inf in the float32 parameter
    policy.sync_weights(state, expected="all")


def _unknown(policy: Pi05Policy, source: Pi05Model) -> None:
    state = dict(source.named_parameters())
    state["expert.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(2, 2)
    policy.sync_weights(state, expected="all")


def _wrong_shape(policy: Pi05Policy, source: Pi05Model) -> None:
    state = {n: p.detach() for n, p in source.named_parameters()}
    state["action_in_proj.weight"] = state["action_in_proj.weight"][:, :-1]
    policy.sync_weights(state, expected="all")


def _duplicate_across_calls(policy: Pi05Policy, source: Pi05Model) -> None:
    params = list(source.named_parameters())
    policy.begin_weight_update("all")
    policy.update_weights(params)
    name, p = params[5]
    policy.update_weights([(to_external_name(name), p)])  # the same parameter under its LeRobot name


def _duplicate_in_one_call(policy: Pi05Policy, source: Pi05Model) -> None:
    params = list(source.named_parameters())
    policy.sync_weights(params + [params[0]], expected="all")


def _missing(policy: Pi05Policy, source: Pi05Model) -> None:
    policy.begin_weight_update("all")
    policy.update_weights(list(source.named_parameters())[:-1])
    policy.finish_weight_update()


def _integer_values(policy: Pi05Policy, source: Pi05Model) -> None:
    state = {n: p.detach() for n, p in source.named_parameters()}
    state["action_in_proj.bias"] = state["action_in_proj.bias"].long()
    policy.sync_weights(state, expected="all")


def _not_a_tensor(policy: Pi05Policy, source: Pi05Model) -> None:
    policy.sync_weights([("action_in_proj.bias", [0.0] * 32)], expected=["action_in_proj.bias"])


FAILURES = {
    "abort_midway": (_abort_midway, "aborted on purpose"),
    "iterator_raises": (_iterator_raises, "OSError: connection to the trainer lost"),
    "nan": (_nan, r"non-finite .*expert\.layers\.1\.mlp\.down_proj\.weight"),
    "inf_after_cast": (_inf_after_cast, r"non-finite .*action_out_proj\.weight"),
    "unknown_name": (_unknown, "names no parameter of this model"),
    "wrong_shape": (_wrong_shape, r"expected shape \[40, 32\], received \[40, 31\]"),
    "duplicate_across_calls": (_duplicate_across_calls, "already sent in this update"),
    "duplicate_in_one_call": (_duplicate_in_one_call, "already sent in this update"),
    "missing_at_finish": (_missing, "1 of the 103 expected parameters"),
    "integer_values": (_integer_values, "expected a floating-point tensor"),
    "not_a_tensor": (_not_a_tensor, "expected a torch.Tensor"),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_failure_leaves_weights_bit_identical(case: str, shared, inputs: ModelInputs, new_model: Pi05Model) -> None:
    policy, reference = shared
    before = snapshot(policy)
    version = policy.weight_version
    fn, message = FAILURES[case]
    with pytest.raises(WeightSyncError, match=message):
        fn(policy, new_model)
    assert not policy.weight_sync.in_progress, "a failure must end the update"
    assert policy.weight_version == version
    assert_unchanged(policy, before)
    if case in ("nan", "duplicate_across_calls"):  # still serving the same weights, same outputs
        assert_same_outputs(act(policy, inputs), reference)
    with pytest.raises(WeightSyncStateError, match="no weight update in progress"):
        policy.finish_weight_update()


def test_failed_commit_poisons_until_a_complete_update(monkeypatch: pytest.MonkeyPatch, inputs: ModelInputs) -> None:
    policy = make_policy(make_model(seed=0))

    def broken() -> None:
        raise RuntimeError("device fault")

    monkeypatch.setattr(policy.scheduler, "refresh_tables", broken)
    with pytest.raises(WeightSyncError, match="commit failed midway"):
        policy.sync_weights(make_model(seed=7))
    assert policy.weight_version == 0
    with pytest.raises(WeightSyncStateError, match="refuses to serve"):
        act(policy, inputs)
    monkeypatch.undo()
    policy.sync_weights(make_model(seed=0), expected="trainable")  # not complete: still refusing
    with pytest.raises(WeightSyncStateError, match="refuses to serve"):
        act(policy, inputs)
    policy.sync_weights(make_model(seed=7), expected="all")
    assert_same_outputs(act(policy, inputs), act(make_policy(make_model(seed=7)), inputs))


# ------------------------------------------------------------------------------------------ lifecycle
def test_lifecycle_errors(shared, new_model: Pi05Model) -> None:
    policy, _ = shared
    before = snapshot(policy)
    for call in (policy.finish_weight_update, policy.abort_weight_update, lambda: policy.update_weights({})):
        with pytest.raises(WeightSyncStateError, match="call begin_weight_update"):
            call()
    policy.begin_weight_update()
    with pytest.raises(WeightSyncStateError, match="already in progress"):
        policy.begin_weight_update("all")
    assert policy.weight_sync.in_progress  # begin twice does not end the first update
    policy.abort_weight_update()
    with pytest.raises(WeightSyncStateError, match="aborted by abort_weight_update"):
        policy.finish_weight_update()
    for bad in ("everything", [], ["nope.weight"], ["action_in_proj.bias", "model.action_in_proj.bias"]):
        with pytest.raises(WeightSyncError, match="begin_weight_update"):
            policy.begin_weight_update(bad)
    with pytest.raises(WeightSyncError, match="mapping name -> tensor"):
        policy.sync_weights(torch.zeros(3))
    assert_unchanged(policy, before)


def test_device_flag_and_checked_commit(shared, new_model: Pi05Model, inputs: ModelInputs) -> None:
    """`WeightSync.check` (the broadcast's vote flag): completeness checked at once, False on Inf, and a commit
    after a True flag equals a plain finish, tables included."""
    policy, _ = shared
    before = snapshot(policy)
    sync = policy.weight_sync
    params = dict(new_model.named_parameters())
    trainable = [n for n, _ in policy.trainable_parameters()]
    policy.begin_weight_update()
    policy.update_weights({n: params[n] for n in trainable[1:]})
    with pytest.raises(WeightSyncError, match=r"check: 1 of the .* expected parameters .* not sent"):
        sync.check()
    assert not sync.in_progress  # the failed check ended the update
    bad = params[trainable[0]].clone()
    bad.view(-1)[0] = float("inf")
    policy.begin_weight_update()
    policy.update_weights({**{n: params[n] for n in trainable[1:]}, trainable[0]: bad})
    flag = sync.check()
    assert flag.shape == () and flag.dtype == torch.bool and not bool(flag)
    with pytest.raises(WeightSyncError, match=rf"non-finite values .*{trainable[0]}"):
        policy.finish_weight_update()
    assert_unchanged(policy, before)

    outputs, tables = [], []
    for checked in (False, True):
        fresh = make_policy(make_model(seed=0))
        fresh.begin_weight_update()
        fresh.update_weights({n: params[n] for n in trainable})
        if checked:
            assert bool(fresh.weight_sync.check())
        report = fresh.weight_sync.commit(checked=checked)
        assert report.version == 1 and report.num_tensors == len(trainable)
        outputs.append(act(fresh, inputs))
        tables.append(fresh.scheduler.tables[5].modulation.clone())
    assert_same_outputs(*outputs)
    assert torch.equal(tables[0], tables[1])
    assert not torch.equal(tables[0], make_policy(make_model(seed=0)).scheduler.tables[5].modulation)


def test_close_aborts_an_update(new_model: Pi05Model, inputs: ModelInputs) -> None:
    policy = make_policy(make_model(seed=0))
    before = snapshot(policy)
    policy.begin_weight_update("all")
    policy.update_weights(list(new_model.named_parameters())[:10])
    policy.close()
    assert not policy.weight_sync.in_progress
    with pytest.raises(WeightSyncStateError, match="closed"):
        policy.update_weights(list(new_model.named_parameters())[10:])
    with pytest.raises(WeightSyncStateError, match="closed"):
        policy.finish_weight_update()
    with pytest.raises(WeightSyncStateError, match="closed"):
        policy.begin_weight_update()
    with pytest.raises(RuntimeError, match="closed"):
        act(policy, inputs)
    for n, p in policy.model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_close_while_a_source_is_streaming(new_model: Pi05Model) -> None:
    """close() on another thread while update_weights reads a slow source: the stream stops, nothing commits."""
    policy = make_policy(make_model(seed=0))
    before = snapshot(policy)
    reached, resume = threading.Event(), threading.Event()
    params = list(new_model.named_parameters())

    def slow_source():
        yield from params[:3]
        reached.set()
        resume.wait(10)
        yield from params[3:]

    errors: list[BaseException] = []

    def stream() -> None:
        try:
            policy.sync_weights(slow_source(), expected="all")
        except BaseException as err:  # noqa: BLE001 - collected for the assertion below
            errors.append(err)

    worker = threading.Thread(target=stream)
    worker.start()
    assert reached.wait(10)
    policy.close()  # takes the policy lock: never interleaves with a staging step or the commit
    resume.set()
    worker.join(10)
    assert len(errors) == 1 and isinstance(errors[0], WeightSyncStateError), errors
    assert "close()" in str(errors[0])
    assert policy.weight_version == 0
    for n, p in policy.model.named_parameters():
        assert torch.equal(p, before[n]), n


# -------------------------------------------------------------------------------- dtypes, names, sets
@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float64])
def test_dtypes_are_kept(source_dtype: torch.dtype) -> None:
    policy = make_policy(make_model(seed=0, dtype=torch.bfloat16))
    dtypes = {n: p.dtype for n, p in policy.model.named_parameters()}
    assert dtypes["action_in_proj.weight"] == torch.float32 and dtypes["expert.layers.0.mlp.up_proj.weight"] == (
        torch.bfloat16
    )
    source = {n: p.detach().to(source_dtype) for n, p in make_model(seed=7).named_parameters()}
    report = policy.sync_weights(source, expected="all")
    assert report.num_bytes == sum(p.numel() * p.element_size() for p in policy.model.parameters())
    for n, p in policy.model.named_parameters():
        assert p.dtype == dtypes[n], n
        assert torch.equal(p, source[n].to(dtypes[n])), n


def test_lerobot_names_dead_keys_and_tied_embedding() -> None:
    policy = make_policy(make_model(seed=0))
    ours = {n: p.detach() for n, p in make_model(seed=7).named_parameters()}
    lerobot = {"model." + to_external_name(n): t for n, t in ours.items()}
    lerobot["model." + TIED_EMBEDDING] = ours["llm.embed_tokens.weight"]  # LeRobot stores the tied copy too
    lerobot["model." + DEAD_KEYS[0]] = torch.zeros(3)
    report = policy.sync_weights(lerobot, expected="all")
    assert report.num_tensors == len(ours)
    assert report.skipped == ["model." + DEAD_KEYS[0]]
    for n, p in policy.model.named_parameters():
        assert torch.equal(p, ours[n]), n


def test_trainable_set_is_exact() -> None:
    policy = make_policy(make_model(seed=0))
    trainable = [n for n, _ in policy.trainable_parameters()]
    assert 0 < len(trainable) < len(list(policy.model.parameters()))
    source = dict(make_model(seed=7).named_parameters())
    frozen = next(n for n in source if n not in trainable)
    policy.begin_weight_update("trainable")
    with pytest.raises(WeightSyncError, match="not part of this update"):
        policy.update_weights({frozen: source[frozen]})
    policy.begin_weight_update("trainable")
    policy.update_weights({n: source[n] for n in trainable[1:]})
    with pytest.raises(WeightSyncError, match=f"1 of the {len(trainable)} expected .*{trainable[0]}"):
        policy.finish_weight_update()
    before = snapshot(policy)
    report = policy.sync_weights(make_model(seed=7))  # a full trainer module: the frozen part is skipped
    assert report.names == trainable and len(report.skipped) == len(source) - len(trainable)
    for n, p in policy.model.named_parameters():
        assert torch.equal(p, source[n] if n in trainable else before[n]), n
    listed = policy.sync_weights(source, expected=["model.action_in_proj.bias", "action_out_proj.bias"])
    assert listed.names == ["action_in_proj.bias", "action_out_proj.bias"] and listed.expected == "list"


def test_updates_follow_parameter_changes() -> None:
    """An update writes the parameters the model holds now: replaced, recast, swapped or added ones."""
    policy = make_policy(make_model(seed=0))
    model = policy.model
    source = make_model(seed=7)
    policy.sync_weights(source, expected="all")
    old = model.action_out_proj.bias
    model.action_out_proj.bias = torch.nn.Parameter(torch.zeros_like(old))  # rebound: a new object
    fresh = make_model(seed=9)
    policy.sync_weights(fresh, expected="all")
    assert torch.equal(model.action_out_proj.bias, fresh.action_out_proj.bias)
    assert not torch.equal(old, fresh.action_out_proj.bias)  # the replaced parameter was not written
    model.action_in_proj.bias.data = model.action_in_proj.bias.data.double()  # same object, new dtype
    policy.sync_weights(make_model(seed=11), expected="all")
    assert model.action_in_proj.bias.dtype == torch.float64
    assert torch.equal(model.action_in_proj.bias, make_model(seed=11).action_in_proj.bias.double())
    # a submodule replaced deep in the tree, and a parameter swapped in a module's dict without setattr
    path, linear = next((n, m) for n, m in model.named_modules() if n.startswith("expert.") and n.endswith("o_proj"))
    parent_path, _, child = path.rpartition(".")
    replacement = copy.deepcopy(linear)
    setattr(model.get_submodule(parent_path), child, replacement)
    swapped = torch.nn.Parameter(model.action_out_proj.weight.detach().clone())
    model.action_out_proj._parameters["weight"] = swapped
    fresh = make_model(seed=13)
    policy.sync_weights(fresh, expected="all")
    assert torch.equal(replacement.weight, fresh.get_submodule(path).weight.to(replacement.weight.dtype))
    assert not torch.equal(linear.weight, replacement.weight)  # the detached module was not written
    assert torch.equal(swapped, fresh.action_out_proj.weight)
    # a parameter added where there was none: expected="all" now needs it
    model.action_out_proj.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(WeightSyncError, match="parameters .* were not sent: .'action_out_proj.extra'"):
        policy.sync_weights(fresh, expected="all")


def fused_buffers(model: Pi05Model) -> list[torch.Tensor]:
    groups = (model.fused_expert, model.fused_prefix, model.fused_vision)
    return [t for group in groups for pair in group for t in pair]


def fused_matches(model: Pi05Model) -> bool:
    expert = all(
        torch.equal(qkv, layer.self_attn.fused_weight()) and torch.equal(mlp, layer.mlp.fused_weight())
        for (qkv, mlp), layer in zip(model.fused_expert, model.expert.layers, strict=True)
    )
    prefix = all(
        torch.equal(qkv, layer.self_attn.fused_weight())
        and torch.equal(mlp, geglu_gemm.stack_gate_up(layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight))
        for (qkv, mlp), layer in zip(model.fused_prefix, model.llm.layers, strict=True)
    )
    vision = all(
        torch.equal(w, want_w) and torch.equal(b, want_b)
        for (w, b), (want_w, want_b) in zip(
            model.fused_vision, (layer.self_attn.fused_weight() for layer in model.vision.encoder.layers)
        )
    )
    return expert and prefix and vision


def test_fused_buffers_are_a_copy_refreshed_at_commit_and_load(tmp_path) -> None:
    """The fused [q;k;v] / [gate;up] buffers (expert, LM, SigLIP) are a derived copy (no parameter shares their
    storage): a commit, a checkpoint load into the live model and `refresh_tables()` refresh them in place."""
    from policies.pi05.checkpoint import load_weights, save_weights

    policy = make_policy(make_model(seed=0))
    model = policy.model
    buffers = [t.data_ptr() for t in fused_buffers(model)]
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not storages & {t.untyped_storage().data_ptr() for t in fused_buffers(model)}
    policy.sync_weights(make_model(seed=7), expected="all")
    assert fused_matches(model)
    q = model.expert.layers[0].self_attn.q_proj.weight
    q.data = q.data.clone()  # new storage: still copied in by the next commit
    policy.sync_weights(make_model(seed=9), expected="all")
    assert fused_matches(model)
    save_weights(make_model(seed=11), tmp_path)
    load_weights(model, tmp_path)
    assert fused_matches(model)
    for weight in (model.expert.layers[1].mlp.up_proj.weight, model.llm.layers[0].self_attn.k_proj.weight,
                   model.llm.layers[1].mlp.gate_proj.weight,
                   model.vision.encoder.layers[0].self_attn.v_proj.bias):  # fmt: skip
        with torch.no_grad():
            weight.mul_(2.0)  # an optimizer step on a model that also rolls out
        assert not fused_matches(model)
        policy.scheduler.refresh_tables()
        assert fused_matches(model)
    assert [t.data_ptr() for t in fused_buffers(model)] == buffers  # storage kept: graphs valid


def test_an_expert_commit_refreshes_the_expert_copies_only() -> None:
    """A commit refreshes the fused copies of the stacks it wrote: the expert's here, not the LM's or SigLIP's (whose
    weights it did not touch, so their copies stay right)."""
    policy = make_policy(make_model(seed=0))
    model = policy.model
    fresh = make_model(seed=5)
    expert = {n: p for n, p in fresh.named_parameters() if n.startswith("expert.")}
    before = [t.clone() for pair in model.fused_prefix for t in pair]
    policy.sync_weights(expert, expected=list(expert))
    assert fused_matches(model)
    assert all(torch.equal(a, b) for a, b in zip((t for pair in model.fused_prefix for t in pair), before, strict=True))


def test_bf16_sync_refreshes_the_step_tables() -> None:
    """In bf16 the denoise loop reads a bf16 copy of the fp32 modulation table (in fp32 it is the same tensor):
    a sync must refresh both."""
    policy = make_policy(make_model(seed=0, dtype=torch.bfloat16))
    table = policy.scheduler.tables[5]
    assert table.step_table.dtype == torch.bfloat16 and table.step_table is not table.modulation
    policy.sync_weights(make_model(seed=7, dtype=torch.bfloat16))
    fresh = RolloutTables(policy.model, (5,))[5]
    assert torch.equal(table.modulation, fresh.modulation) and torch.equal(table.step_table, fresh.step_table)


def test_report_repr_is_one_line_of_counts() -> None:
    report = make_policy(make_model(seed=0)).sync_weights(make_model(seed=7), expected="all")
    text = repr(report)
    assert "\n" not in text and "expert." not in text and len(text) < 160
    assert text.startswith("WeightUpdateReport(version=1, expected='all', tensors=103, bytes=")
    assert len(report.names) == 103  # the names on demand
    assert isinstance(report, WeightUpdateReport)


def test_batched_tables_match_per_norm_modulation() -> None:
    policy = make_policy(make_model(seed=3))
    tables = policy.scheduler.tables
    assert tables is not None
    for table in tables.tables.values():
        with torch.no_grad():
            cond = policy.model.time_condition(table.steps.times[:-1])
            ref = torch.stack([torch.cat(m, dim=-1)[:, 0] for m in policy.model.modulations(cond)])
        torch.testing.assert_close(table.modulation, ref, rtol=1e-6, atol=1e-6)


class FakeDTensor:
    """Duck-typed DTensor: shape/dtype metadata and a `full_tensor()` that materialises the value."""

    def __init__(self, full: torch.Tensor) -> None:
        self.full, self.shape, self.dtype, self.calls = full, full.shape, full.dtype, 0

    def full_tensor(self) -> torch.Tensor:
        self.calls += 1
        return self.full.clone()


def test_dtensor_sources_and_wrapped_modules() -> None:
    policy = make_policy(make_model(seed=0))
    source = {n: FakeDTensor(p.detach()) for n, p in make_model(seed=7).named_parameters()}
    policy.sync_weights(source, expected="all")
    assert all(d.calls == 1 for d in source.values())
    for n, p in policy.model.named_parameters():
        assert torch.equal(p, source[n].full), n

    class Wrapper(torch.nn.Module):  # DDP / torch.compile style prefixes
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.module = torch.nn.Module()
            self.module._orig_mod = inner

    wrapped = Wrapper(make_model(seed=9))
    report = policy.sync_weights(wrapped)
    assert report.num_tensors == len(policy.trainable_parameters())


# ----------------------------------------------------------------------------------------------- CUDA
def busy_gpu(seconds: float = 0.1) -> None:
    """Queue about `seconds` of matmuls on the current stream (no host wait)."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(max(1, int(seconds / 2e-3))):  # fp32 4096^3: ~2 ms or more each on an H200
        a = torch.tanh(a @ a)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("host_source", [True, False])
def test_cuda_commit_is_stream_ordered_without_sync(host_source: bool) -> None:
    """Queue a batch-64 replay behind a long GPU sleep, commit new weights at once with no synchronize: the
    queued call still returns the old weights' result, the next call the new weights' result."""
    x = make_inputs(64, "cuda")
    seeds = list(range(64))
    old_ref = make_policy(make_model(seed=0, device="cuda"), 64).act_inputs(x, seeds=seeds)
    new_ref = make_policy(make_model(seed=7, device="cuda"), 64).act_inputs(x, seeds=seeds)
    policy = make_policy(make_model(seed=0, device="cuda"), 64)
    assert policy.scheduler.use_graphs
    source = make_model(seed=7, device="cuda" if not host_source else "cpu")
    state = {n: (p.detach().pin_memory() if host_source else p.detach()) for n, p in source.named_parameters()}
    policy.scheduler.warmup([(64, 16)])  # captured before the timed sequence (graphs are captured on first use)
    captures = policy.scheduler.stats.captures
    torch.cuda.synchronize()
    busy_gpu()  # ~0.1 s of GPU work ahead of the replay
    queued = policy.act_inputs(x, seeds=seeds)
    report = policy.sync_weights(state, expected="all")
    after = policy.act_inputs(x, seeds=seeds)
    torch.cuda.synchronize()
    assert report.version == 1 and after.header.weight_version == 1
    assert_same_outputs(queued, old_ref)
    assert_same_outputs(after, new_ref)
    assert policy.scheduler.stats.captures == captures  # nothing recaptured
    # back-to-back updates behind busy GPU work: the second stages (possibly into memory the allocator recycles
    # from the first's buffers) before the first commit has run, and each replay sees the weights committed before it
    back = {n: p.detach() for n, p in make_model(seed=0, device="cuda").named_parameters()}
    busy_gpu()
    policy.sync_weights(state, expected="all")  # the same weights again (version 2): its commit waits
    middle = policy.act_inputs(x, seeds=seeds)
    policy.sync_weights(back, expected="all")  # stages seed-0 weights into the same buffers at once
    last = policy.act_inputs(x, seeds=seeds)
    torch.cuda.synchronize()
    assert_same_outputs(middle, new_ref)
    assert_same_outputs(last, old_ref)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_sync_refreshes_the_modulation_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 graphs read the bf16 step table, a copy of the fp32 modulation table: after a sync of new expert-side
    weights the graph path must equal a fresh bf16 policy on those weights, and must not without the refresh."""
    x = make_inputs(2, "cuda")
    trainer = make_model(seed=0, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in [*trainer.time_mlp_in.parameters(), *trainer.expert.layers[0].input_layernorm.parameters()]:
            p.mul_(1.5)
    fresh_model = make_model(seed=0, device="cuda", dtype=torch.bfloat16)
    fresh_model.load_state_dict(trainer.state_dict())
    fresh = make_policy(fresh_model)
    policy = make_policy(make_model(seed=0, device="cuda", dtype=torch.bfloat16))
    assert policy.scheduler.use_graphs and policy.scheduler.tables[5].step_table.dtype == torch.bfloat16
    policy.sync_weights(trainer)
    assert torch.equal(policy.scheduler.tables[5].step_table, fresh.scheduler.tables[5].step_table)
    assert_same_outputs(act(policy, x), act(fresh, x))
    stale = make_policy(make_model(seed=0, device="cuda", dtype=torch.bfloat16))
    monkeypatch.setattr(stale.scheduler, "refresh_tables", lambda names=None: None)
    stale.sync_weights(trainer)
    assert not torch.equal(act(stale, x).actions, act(fresh, x).actions)


def test_sync_weights_errors_name_sync_weights() -> None:
    """A refused one-call sync speaks of `sync_weights`, not of the transaction step it failed in."""
    policy = make_policy(make_model(0))
    source = make_model(1)
    with torch.no_grad():
        source.expert.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    before = {n: p.clone() for n, p in policy.model.named_parameters()}
    with pytest.raises(WeightSyncError, match=r"^sync_weights: non-finite values"):
        policy.sync_weights(source)
    assert all(torch.equal(p, before[n]) for n, p in policy.model.named_parameters())
