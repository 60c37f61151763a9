"""Checkpoint I/O: round trips, LeRobot key layouts, tied embedding, RL heads, strict errors, bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from policies.pi05.checkpoint import (
    CheckpointError,
    load_config,
    load_weights,
    save_weights,
    to_internal_name,
)
from policies.pi05.config import Pi05Config
from policies.pi05.model import Pi05Model, randomize_parameters_

SMALL_VOCAB = 1024  # keeps files small; the vocabulary size is irrelevant to the key layout
LM_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"
EMBED_TOKENS = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
EXPERT_LM_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"


def randn(*shape: int, seed: int = 99) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def make_model(seed: int, **overrides) -> Pi05Model:
    overrides.setdefault("vocab_size", SMALL_VOCAB)
    return randomize_parameters_(Pi05Model(Pi05Config.tiny(**overrides)), seed)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_params_equal(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    assert params.keys() == expected.keys()
    for name, p in params.items():
        assert p.dtype == expected[name].dtype, name
        assert torch.equal(p, expected[name]), name


def lerobot_key(internal: str) -> str:
    """Our name -> the name in lerobot/pi05_base/model.safetensors (written out here, independently)."""
    if internal == "llm.embed_tokens.weight":
        return LM_HEAD  # safetensors de-duplicates the tied pair; the published file keeps lm_head
    for ours, theirs in (
        ("vision.", "paligemma_with_expert.paligemma.model.vision_tower.vision_model."),
        ("projector.", "paligemma_with_expert.paligemma.model.multi_modal_projector.linear."),
        ("llm.", "paligemma_with_expert.paligemma.model.language_model."),
        ("expert.", "paligemma_with_expert.gemma_expert.model."),
    ):
        if internal.startswith(ours):
            return theirs + internal[len(ours) :]
    return internal  # action_in_proj, action_out_proj, time_mlp_in/out


def lerobot_state_dict(model: Pi05Model, prefix: str = "", rl_heads: bool = False) -> dict[str, torch.Tensor]:
    """A LeRobot-layout file: no RL heads, tied embedding under lm_head, the dead expert lm_head present."""
    out = {
        prefix + lerobot_key(n): p.detach().clone()
        for n, p in model.named_parameters()
        if rl_heads or not n.startswith(("value_head.", "noise_head."))
    }
    out[prefix + EXPERT_LM_HEAD] = randn(model.config.vocab_size, model.config.expert.width)
    return out


def write(folder: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / name))
    return folder


# ------------------------------------------------------------------------------------------- round trips
def test_round_trip_fp32_bit_identical(tmp_path) -> None:
    source = randomize_parameters_(Pi05Model(Pi05Config.tiny()), 1)  # full 257,152-row vocabulary
    file = save_weights(source, tmp_path)
    assert file == tmp_path / "model.safetensors" and not (tmp_path / "model.safetensors.tmp").exists()
    target = randomize_parameters_(Pi05Model(Pi05Config.tiny()), 2)
    report = load_weights(target, tmp_path)
    assert report.ok and not report.initialized and not report.dropped
    assert len(report.loaded) == len(list(source.parameters()))
    assert_params_equal(target, snapshot(source))


def test_round_trip_bf16_bit_identical(tmp_path) -> None:
    source = make_model(1, dtype="bfloat16").set_precision(torch.bfloat16)
    dtypes = {p.dtype for p in source.parameters()}
    assert dtypes == {torch.bfloat16, torch.float32}  # bf16 blocks with float32 islands
    save_weights(source, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        stored = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert stored[LM_HEAD.replace("lm_head", "model.language_model.embed_tokens")] == "BF16"
    target = make_model(2, dtype="bfloat16").set_precision(torch.bfloat16)
    assert load_weights(target, tmp_path).ok
    assert_params_equal(target, snapshot(source))


def test_saved_names_are_lerobot_names(tmp_path) -> None:
    model = make_model(1)
    save_weights(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    for name in dict(model.named_parameters()):
        if name == "llm.embed_tokens.weight":
            assert EMBED_TOKENS in keys
        else:
            assert lerobot_key(name) in keys, name


# ----------------------------------------------------------------------------------------- LeRobot layout
@pytest.mark.parametrize("prefix", ["", "model."], ids=["published", "lerobot-training"])
def test_loads_lerobot_names(tmp_path, prefix: str) -> None:
    source = make_model(1)
    write(tmp_path, lerobot_state_dict(source, prefix))
    target = make_model(2)
    rl_before = {n: p.clone() for n, p in target.named_parameters() if n.startswith(("value_head", "noise_head"))}
    report = load_weights(target, tmp_path, strict=True)

    assert report.ok
    assert report.embedding_source == prefix + LM_HEAD
    assert report.dropped == [prefix + EXPERT_LM_HEAD]  # the dead expert head, explicitly
    # RL heads are absent from SFT checkpoints: initialised, not missing, and left untouched
    assert sorted(report.initialized) == sorted(rl_before)
    assert report.initialized and not report.missing
    for name, param in target.named_parameters():
        if name in rl_before:
            assert torch.equal(param, rl_before[name]), name
        else:
            assert torch.equal(param, dict(source.named_parameters())[name]), name


@pytest.mark.parametrize("prefix", ["", "model."])
def test_to_internal_name(prefix: str) -> None:
    p = prefix
    assert to_internal_name(p + LM_HEAD) == "llm.embed_tokens.weight"
    assert to_internal_name(p + EMBED_TOKENS) == "llm.embed_tokens.weight"
    assert to_internal_name(p + EXPERT_LM_HEAD) is None
    v = "paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder.layers.3.mlp.fc1.bias"
    assert to_internal_name(p + v) == "vision.encoder.layers.3.mlp.fc1.bias"
    e = "paligemma_with_expert.gemma_expert.model.norm.dense.weight"
    assert to_internal_name(p + e) == "expert.norm.dense.weight"
    assert to_internal_name(p + "time_mlp_in.bias") == "time_mlp_in.bias"
    assert to_internal_name("value_head.mlp.0.weight") == "value_head.mlp.0.weight"


def test_embedding_from_embed_tokens_when_both_present(tmp_path) -> None:
    source = make_model(1)
    tensors = lerobot_state_dict(source)
    stale = randn(*tensors[LM_HEAD].shape)
    tensors[EMBED_TOKENS] = tensors[LM_HEAD]
    tensors[LM_HEAD] = stale  # if the loader took lm_head the embedding would differ
    write(tmp_path, tensors)
    target = make_model(2)
    report = load_weights(target, tmp_path)
    assert report.ok
    assert report.embedding_source == EMBED_TOKENS
    assert sorted(report.dropped) == sorted([LM_HEAD, EXPERT_LM_HEAD])
    assert torch.equal(target.llm.embed_tokens.weight, source.llm.embed_tokens.weight)


def test_embedding_from_embed_tokens_when_it_is_read_first(tmp_path) -> None:
    """Shards are read in order: embed_tokens in the first shard, the stale lm_head in the second."""
    source = make_model(1)
    tensors = lerobot_state_dict(source)
    first = {k: v for k, v in tensors.items() if k != LM_HEAD}
    first[EMBED_TOKENS] = tensors[LM_HEAD]
    second = {LM_HEAD: randn(*tensors[LM_HEAD].shape)}
    write(tmp_path, first, "model-00001-of-00002.safetensors")
    write(tmp_path, second, "model-00002-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map[LM_HEAD] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    target = make_model(2)
    report = load_weights(target, tmp_path)
    assert report.ok and report.embedding_source == EMBED_TOKENS
    assert LM_HEAD in report.dropped
    assert torch.equal(target.llm.embed_tokens.weight, source.llm.embed_tokens.weight)


def test_sharded_index_loads(tmp_path) -> None:
    source = make_model(1)
    tensors = lerobot_state_dict(source, rl_heads=True)
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for shard, names in shards.items():
        write(tmp_path, {k: tensors[k] for k in names}, shard)
        weight_map.update({k: shard for k in names})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    target = make_model(2)
    report = load_weights(target, tmp_path)
    assert report.ok and not report.initialized
    assert_params_equal(target, snapshot(source))


def test_sharded_index_with_missing_shard(tmp_path) -> None:
    write(tmp_path, {"action_in_proj.bias": torch.zeros(40)}, "model-00001-of-00002.safetensors")
    weight_map = {"action_in_proj.bias": "model-00001-of-00002.safetensors", "x": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        load_weights(make_model(2), tmp_path)


# ------------------------------------------------------------------------------------------ strict errors
def _broken(kind: str, source: Pi05Model) -> tuple[dict[str, torch.Tensor], list[str]]:
    tensors = lerobot_state_dict(source)
    if kind == "missing":
        key = lerobot_key("expert.layers.1.mlp.down_proj.weight")
        del tensors[key]
        return tensors, ["missing", "expert.layers.1.mlp.down_proj.weight"]
    if kind == "shape":
        key = lerobot_key("llm.layers.0.self_attn.k_proj.weight")
        tensors[key] = torch.zeros(48, 64)
        return tensors, ["shape mismatch", "llm.layers.0.self_attn.k_proj.weight", "[24, 64]", "[48, 64]"]
    tensors["paligemma_with_expert.gemma_expert.model.layers.0.extra_norm.weight"] = torch.zeros(40)
    return tensors, ["unexpected", "extra_norm.weight"]


@pytest.mark.parametrize("kind", ["missing", "shape", "unexpected"])
def test_strict_errors_list_keys_and_leave_model_unchanged(tmp_path, kind: str) -> None:
    tensors, expected = _broken(kind, make_model(1))
    write(tmp_path, tensors)
    target = make_model(2)
    before = snapshot(target)
    with pytest.raises(CheckpointError) as err:
        load_weights(target, tmp_path, strict=True)
    for fragment in expected:
        assert fragment in str(err.value)
    assert_params_equal(target, before)


@pytest.mark.parametrize("kind", ["missing", "shape", "unexpected"])
def test_non_strict_returns_report(tmp_path, kind: str) -> None:
    source = make_model(1)
    tensors, _ = _broken(kind, source)
    write(tmp_path, tensors)
    target = make_model(2)
    before = snapshot(target)
    report = load_weights(target, tmp_path, strict=False)
    assert not report.ok
    problem = {
        "missing": report.missing == ["expert.layers.1.mlp.down_proj.weight"],
        "shape": report.mismatched == [("llm.layers.0.self_attn.k_proj.weight", (24, 64), (48, 64))],
        "unexpected": report.unexpected == ["paligemma_with_expert.gemma_expert.model.layers.0.extra_norm.weight"],
    }[kind]
    assert problem, report
    # everything else was loaded; the problem parameter kept its value
    src = dict(source.named_parameters())
    for name, param in target.named_parameters():
        if name in report.loaded:
            assert torch.equal(param, src[name]), name
        else:
            assert torch.equal(param, before[name]), name
    assert len(report.loaded) >= len(src) - len(report.initialized) - 1


# ------------------------------------------------------------------------------------------------ bad files
@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt"])
def test_pickle_is_refused_with_reason_and_fix(tmp_path, name: str) -> None:
    (tmp_path / name).write_bytes(b"\x80\x04not really a pickle")  # never unpickled
    for path in (tmp_path, tmp_path / name):
        with pytest.raises(CheckpointError) as err:
            load_weights(make_model(2), path)
        msg = str(err.value)
        assert name in msg
        assert "pickle" in msg and "execute code" in msg  # why
        assert "safetensors" in msg and "save_file" in msg  # how to convert


def test_missing_path_and_empty_folder(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(make_model(2), tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_weights(make_model(2), tmp_path)


@pytest.mark.parametrize("cut", ["half", "header"])
def test_truncated_file_is_reported(tmp_path, cut: str) -> None:
    save_weights(make_model(1), tmp_path)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if cut == "half" else data[:20])
    target = make_model(2)
    before = snapshot(target)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_weights(target, tmp_path)
    assert_params_equal(target, before)


# ------------------------------------------------------------------------------------------------ config.json
def test_load_config_requires_config_json(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_config(tmp_path)


def test_load_config_variants(tmp_path) -> None:
    cfg = Pi05Config.tiny(action_horizon=7)
    cfg.save(tmp_path / "config.json")
    assert load_config(tmp_path) == cfg
    (tmp_path / "config.json").write_text(json.dumps({"type": "pi05", "chunk_size": 16, "dtype": "float32"}))
    assert load_config(tmp_path).action_horizon == 16
    openpi = {
        "action_dim": 32,
        "action_horizon": 10,
        "paligemma_variant": "gemma_2b",
        "action_expert_variant": "gemma_300m",
        "precision": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(openpi))
    loaded = load_config(tmp_path)
    assert loaded.action_horizon == 10 and loaded.llm == Pi05Config.pi05_base().llm
