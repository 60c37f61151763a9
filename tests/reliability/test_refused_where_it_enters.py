"""Bad input refused where it enters (issue 21's classes), each case as a user would meet it.

Every case runs between a reference `act()` and a repeat of it (`reliability_support.Probe`): the refusal must
name the argument, what was expected and what came, and leave the policy bit-identical. The "silent" classes
(a LeRobot mode we ignored, STATE/ACTION modes mixed up, truncated float seeds, a negative noise level that
only failed later) have a test that fails on the old behaviour.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from reliability_support import make_obs, make_tiny_policy, run_case
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file, save_file

from phyai_gym import cli
from phyai_gym.make import make_policy
from policies.pi05.checkpoint import CheckpointError, load_config, load_weights
from policies.pi05.config import Pi05Config
from policies.pi05.normalize import NormStats
from policies.pi05.policy import Pi05Policy, RolloutConfig
from policies.pi05.processor import Pi05Processor, ProcessorConfig
from policies.pi05.scheduler import SchedulerConfig
from wrappers import PolicyVectorEnv
from wrappers.adapters.scripted import make_scripted_env

Case = tuple[str, Callable[[Any], Any], type[BaseException], tuple[str, ...]]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.fixture(scope="module")
def saved(policy: Pi05Policy, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared policy written by `save_pretrained`."""
    return policy.save_pretrained(tmp_path_factory.mktemp("issue21_ckpt"))


def params(cases: list[Case]) -> list[Any]:
    return [pytest.param(fn, exc, needles, id=name) for name, fn, exc, needles in cases]


# ------------------------------------------------------------------------------------- LeRobot normalisation
STATE = {"min": [-1.0, 0.0], "max": [1.0, 4.0], "mean": [0.0, 1.0], "std": [0.5, 2.0],
         "q01": [-0.9, 0.1], "q99": [0.9, 3.9], "q10": [-0.5, 0.5], "q90": [0.5, 3.5]}  # fmt: skip
ACTION = {"min": [0.0, -2.0, 0.0], "max": [1.0, 2.0, 10.0], "mean": [0.5, 0.0, 4.0], "std": [0.25, 1.0, 2.0],
          "q01": [0.1, -1.9, 1.0], "q99": [0.9, 1.9, 9.0], "q10": [0.2, -1.0, 2.0], "q90": [0.8, 1.0, 8.0]}  # fmt: skip


def lerobot_folder(
    root: Path,
    norm_map: dict[str, str],
    state: dict[str, list[float]] | None = None,
    action: dict[str, list[float]] | None = None,
    eps: float = 1e-8,
    extra_features: dict[str, Any] | None = None,
    extra_stats: dict[str, np.ndarray] | None = None,
) -> Path:
    """A folder holding LeRobot-layout processor files (pre: normalizer, post: unnormalizer) and sidecars."""
    state = STATE if state is None else state
    action = ACTION if action is None else action
    root.mkdir(parents=True, exist_ok=True)
    features = {"observation.state": {"type": "STATE", "shape": [len(next(iter(state.values())))]},
                **(extra_features or {})}  # fmt: skip
    outputs = {"action": {"type": "ACTION", "shape": [len(next(iter(action.values())))]}}
    tensors = {f"observation.state.{k}": np.asarray(v, np.float32) for k, v in state.items()}
    tensors.update({f"action.{k}": np.asarray(v, np.float32) for k, v in action.items()})
    tensors.update(extra_stats or {})
    for name, registry, feats in (("policy_preprocessor", "normalizer_processor", {**features, **outputs}),
                                  ("policy_postprocessor", "unnormalizer_processor", outputs)):  # fmt: skip
        sidecar = f"{name}_step_0_{registry}.safetensors"
        save_numpy(tensors, str(root / sidecar))
        step = {"registry_name": registry, "config": {"eps": eps, "features": feats, "norm_map": norm_map},
                "state_file": sidecar}  # fmt: skip
        (root / f"{name}.json").write_text(json.dumps({"name": name, "steps": [step]}, indent=2))
    return root


def lerobot_processor(c: Any, folder: Path) -> Pi05Processor:
    return Pi05Processor.from_pretrained(folder, preset="lerobot_pi05", tokenizer=c.policy.processor.tokenizer,
                                         camera_map={"image": "base_0_rgb"}, image_size=16, action_dim=3)  # fmt: skip


def _mode_map(state: str, action: str) -> dict[str, str]:
    return {"VISUAL": "IDENTITY", "STATE": state, "ACTION": action}


def test_min_max_checkpoint_is_normalised_with_min_max(ctx) -> None:
    """Silent before: MIN_MAX fell back to the preset's quantile mode."""
    proc = lerobot_processor(ctx, lerobot_folder(ctx.tmp, _mode_map("MIN_MAX", "MIN_MAX")))
    obs = {"images": {"image": np.zeros((1, 8, 8, 3), np.uint8)}, "state": np.array([[0.0, 3.0]], np.float32),
           "task": ["push"]}  # fmt: skip
    # min_max: 2 * (x - min) / (max - min) - 1 -> [0, 0.5]; the quantile formula would give [0, 0.538..]
    torch.testing.assert_close(proc(obs).state, torch.tensor([[0.0, 0.5]]), atol=1e-6, rtol=0)
    y = torch.zeros(1, 1, 32)
    torch.testing.assert_close(proc.postprocess(y, 1)[0, 0], torch.tensor([0.5, 0.0, 5.0]), atol=1e-6, rtol=0)


def test_state_and_action_modes_are_independent(ctx) -> None:
    """Silent before: STATE=QUANTILES, ACTION=MEAN_STD un-normalised actions with the quantile formula."""
    proc = lerobot_processor(ctx, lerobot_folder(ctx.tmp, _mode_map("QUANTILES", "MEAN_STD")))
    y = torch.full((1, 1, 32), 0.5)
    expected = torch.tensor([0.5 + 0.5 * 0.25, 0.5, 4.0 + 0.5 * 2.0])  # mean + y * std
    torch.testing.assert_close(proc.postprocess(y, 1)[0, 0], expected, atol=1e-6, rtol=0)
    assert (proc.config.norm_mode, proc.config.action_mode) == ("quantile", "mean_std")


def test_norm_map_without_state_leaves_the_state_raw(ctx) -> None:
    """LeRobot applies IDENTITY to a feature type its norm_map lacks; the preset's mode must not step in."""
    folder = lerobot_folder(ctx.tmp, {"VISUAL": "IDENTITY", "ACTION": "QUANTILES"})
    proc = lerobot_processor(ctx, folder)
    assert proc.config.norm_mode == "identity" and proc.config.state_stats is None


def _lerobot(norm_map: dict[str, str], **kwargs: Any) -> Callable[[Any], Any]:
    return lambda c: lerobot_processor(c, lerobot_folder(c.tmp, norm_map, **kwargs))


def _edit_json(name: str, edit: Callable[[dict], Any]) -> Callable[[Any], Any]:
    def build(c: Any) -> Any:
        folder = lerobot_folder(c.tmp, _mode_map("QUANTILES", "QUANTILES"))
        data = json.loads((folder / name).read_text())
        edit(data)
        (folder / name).write_text(json.dumps(data))
        return lerobot_processor(c, folder)

    return build


def _sidecar_text(c: Any) -> Any:
    folder = lerobot_folder(c.tmp, _mode_map("QUANTILES", "QUANTILES"))
    (folder / "policy_postprocessor_step_0_unnormalizer_processor.safetensors").write_bytes(b"\x00\x01 truncated")
    return lerobot_processor(c, folder)


LEROBOT: list[Case] = [
    ("unknown_mode", _lerobot(_mode_map("QUANTILES", "QUANTILE05")), ValueError,
     ("policy_preprocessor.json", "norm_map['ACTION']", "'QUANTILE05'", "MIN_MAX")),
    ("unknown_feature_type", _lerobot({"STATE": "QUANTILES", "ACTIONS": "QUANTILES"}), ValueError,
     ("policy_preprocessor.json", "norm_map key", "'ACTIONS'")),
    ("unknown_feature_kind", _lerobot(_mode_map("QUANTILES", "QUANTILES"),
                                      extra_features={"observation.state": {"type": "STATES", "shape": [2]}}),
     ValueError, ("features['observation.state'].type", "'STATE'", "'STATES'")),
    ("mode_without_its_stats", _lerobot(_mode_map("QUANTILE10", "QUANTILES"), state={"mean": [0.0], "std": [1.0]}),
     ValueError, ("observation.state", "['q10', 'q90']", "'QUANTILE10'", "only ['mean', 'std']")),
    ("nan_stat", _lerobot(_mode_map("MEAN_STD", "MEAN_STD"), action={**ACTION, "std": [1.0, float("nan"), 1.0]}),
     ValueError, ("unnormalizer_processor.safetensors: action", "std", "finite", "nan at index 1")),
    ("stats_width_vs_features", _lerobot(_mode_map("MEAN_STD", "MEAN_STD"),
                                         extra_features={"observation.state": {"type": "STATE", "shape": [5]}}),
     ValueError, ("observation.state", "5 values per statistic", "got 2")),
    ("stat_lengths", _lerobot(_mode_map("MEAN_STD", "MEAN_STD"), state={"mean": [0.0, 1.0], "std": [1.0]}),
     ValueError, ("normalizer_processor.safetensors: observation.state statistics", "one length",
                  "{'mean': 2, 'std': 1}")),
    ("visual_normalised", _lerobot({"VISUAL": "MEAN_STD", "STATE": "QUANTILES", "ACTION": "QUANTILES"},
                                   extra_features={"observation.images.top": {"type": "VISUAL", "shape": [3, 8, 8]}},
                                   extra_stats={"observation.images.top.mean": np.zeros(3, np.float32),
                                                "observation.images.top.std": np.ones(3, np.float32)}),
     ValueError, ("norm_map['VISUAL']", "'observation.images.top'", "'IDENTITY'", "'MEAN_STD'")),
    ("eps_zero", _lerobot(_mode_map("MEAN_STD", "MEAN_STD"), eps=0.0), ValueError,
     ("config.eps", "> 0.0", "got 0.0")),
    ("steps_not_list", _edit_json("policy_preprocessor.json", lambda d: d.update(steps={"a": 1})), ValueError,
     ("policy_preprocessor.json: steps", "a list of step objects", "{'a': 1}")),
    ("norm_map_not_object", _edit_json("policy_postprocessor.json",
                                       lambda d: d["steps"][0]["config"].update(norm_map=["ACTION"])), ValueError,
     ("policy_postprocessor.json: norm_map", "feature type -> mode", "['ACTION']")),
    ("state_file_escapes", _edit_json("policy_preprocessor.json",
                                      lambda d: d["steps"][0].update(state_file="../stats.safetensors")), ValueError,
     ("state_file", "in the same folder", "'../stats.safetensors'")),
    ("state_file_missing", _edit_json("policy_preprocessor.json",
                                      lambda d: d["steps"][0].update(state_file="gone.safetensors")), ValueError,
     ("state_file", "an existing file", "gone.safetensors")),
    ("sidecar_corrupt", _sidecar_text, ValueError, ("unnormalizer_processor.safetensors", "truncated or corrupt")),
]


@pytest.mark.parametrize(("fn", "exc", "needles"), params(LEROBOT))
def test_lerobot_processor_files(ctx, fn, exc, needles) -> None:
    run_case(ctx, fn, exc, needles)


# ------------------------------------------------------------------------------------- configs at construction
CONFIGS: list[Case] = [
    ("noise_level_negative", lambda c: RolloutConfig(noise_level=-0.5), ValueError,
     ("RolloutConfig.noise_level", ">= 0.0", "-0.5")),
    ("noise_level_nan", lambda c: RolloutConfig(noise_level=float("nan")), ValueError,
     ("RolloutConfig.noise_level", "finite", "nan")),
    ("noise_level_str", lambda c: RolloutConfig(noise_level="0.5"), TypeError, ("RolloutConfig.noise_level", "'0.5'")),
    ("rollout_num_steps_zero", lambda c: RolloutConfig(num_steps=0), ValueError,
     ("RolloutConfig.num_steps", ">= 1", "got 0")),
    ("rollout_num_steps_float", lambda c: RolloutConfig(num_steps=5.0), TypeError,
     ("RolloutConfig.num_steps", "an integer", "5.0")),
    ("rollout_chunk_zero", lambda c: RolloutConfig(action_chunk=0), ValueError,
     ("RolloutConfig.action_chunk", ">= 1", "got 0")),
    ("rollout_joint_not_bool", lambda c: RolloutConfig(joint="yes"), TypeError,
     ("RolloutConfig.joint", "True or False", "'yes'")),
    ("ignore_last_one_step", lambda c: RolloutConfig(num_steps=1, ignore_last=True), ValueError,
     ("RolloutConfig.ignore_last", "num_steps >= 2", "num_steps=1")),
    ("scheduler_num_steps_zero", lambda c: SchedulerConfig(num_steps=(0,)), ValueError,
     ("SchedulerConfig.num_steps[0]", ">= 1", "got 0")),
    ("scheduler_num_steps_empty", lambda c: SchedulerConfig(num_steps=()), ValueError,
     ("SchedulerConfig.num_steps", "non-empty", "()")),
    ("scheduler_num_steps_int", lambda c: SchedulerConfig(num_steps=10), TypeError,
     ("SchedulerConfig.num_steps", "sequence", "10")),
    ("scheduler_batch_zero", lambda c: SchedulerConfig(max_batch_size=0), ValueError,
     ("SchedulerConfig.max_batch_size", ">= 1", "got 0")),
    ("scheduler_bucket_too_big", lambda c: SchedulerConfig(max_batch_size=8, batch_buckets=(4, 16)), ValueError,
     ("SchedulerConfig.batch_buckets", "max_batch_size (8)", "(4, 16)")),
    ("scheduler_prompt_bucket_zero", lambda c: SchedulerConfig(prompt_buckets=(0, 16)), ValueError,
     ("SchedulerConfig.prompt_buckets[0]", ">= 1", "got 0")),
    ("scheduler_camera_sets_empty", lambda c: SchedulerConfig(camera_sets=()), TypeError,
     ("SchedulerConfig.camera_sets", "non-empty", "()")),
    ("scheduler_camera_duplicate", lambda c: SchedulerConfig(camera_sets=((0, 0),)), ValueError,
     ("SchedulerConfig.camera_sets[0]", "distinct", "(0, 0)")),
    ("scheduler_graphs_not_bool", lambda c: SchedulerConfig(cuda_graphs="no"), TypeError,
     ("SchedulerConfig.cuda_graphs", "True or False", "'no'")),
    ("processor_image_size_str", lambda c: ProcessorConfig(image_size="224"), TypeError,
     ("ProcessorConfig.image_size", "integer", "'224'")),
    ("processor_norm_mode", lambda c: ProcessorConfig(norm_mode="min-max"), ValueError,
     ("ProcessorConfig.norm_mode", "'min_max'", "'min-max'")),
    ("processor_action_norm_mode", lambda c: ProcessorConfig(action_norm_mode="zscore"), ValueError,
     ("ProcessorConfig.action_norm_mode", "'mean_std'", "'zscore'")),
    ("processor_norm_eps", lambda c: ProcessorConfig(norm_eps=0.0), ValueError,
     ("ProcessorConfig.norm_eps", "> 0.0", "0.0")),
    ("processor_gripper_index", lambda c: ProcessorConfig(action_dim=3, gripper_index=5), ValueError,
     ("ProcessorConfig.gripper_index", "[-3, 2]", "got 5")),
    ("processor_flag", lambda c: ProcessorConfig(rotate180="true"), TypeError,
     ("ProcessorConfig.rotate180", "True or False", "'true'")),
    ("processor_stats_type", lambda c: ProcessorConfig(state_stats=[0.0, 1.0]), TypeError,
     ("ProcessorConfig.state_stats", "NormStats", "[0.0, 1.0]")),
    ("processor_stats_nan", lambda c: ProcessorConfig(norm_mode="mean_std", state_stats={"mean": [0.0, np.inf],
                                                                                          "std": [1.0, 1.0]}),
     ValueError, ("ProcessorConfig.state_stats statistics", "NormStats.mean", "finite", "inf at index 1")),
    ("processor_mode_needs_stats", lambda c: ProcessorConfig(norm_mode="min_max", state_stats={"mean": [0.0]}),
     ValueError, ("state statistics lack ['min', 'max']", "norm_mode='min_max'")),
    ("model_num_steps_float", lambda c: Pi05Config.tiny(num_steps=2.5), TypeError,
     ("Pi05Config: num_steps", "integer", "2.5")),
    ("model_tower_str", lambda c: Pi05Config.tiny(vision={"width": "48"}), TypeError,
     ("Pi05Config: vision.width", "integer", "'48'")),
    ("model_noise_range", lambda c: Pi05Config.tiny(noise_std_range=(0.2, 0.1)), ValueError,
     ("Pi05Config: noise_std_range", "s_min <= s_max", "(0.2, 0.1)")),
    ("model_periods", lambda c: Pi05Config.tiny(min_period=4.0, max_period=1.0), ValueError,
     ("Pi05Config: max_period", "> min_period (4.0)", "1.0")),
    ("model_slots_empty", lambda c: Pi05Config.tiny(camera_slots=()), TypeError,
     ("Pi05Config: camera_slots", "non-empty", "()")),
    ("normstats_empty", lambda c: NormStats(mean=[]), ValueError, ("NormStats.mean", "at least one value", "empty")),
    ("normstats_matrix", lambda c: NormStats(mean=np.zeros((2, 3))), ValueError,
     ("NormStats.mean", "a vector", "(2, 3)")),
]


@pytest.mark.parametrize(("fn", "exc", "needles"), params(CONFIGS))
def test_configs_refuse_at_construction(ctx, fn, exc, needles) -> None:
    run_case(ctx, fn, exc, needles)


def test_negative_noise_level_never_builds_a_policy(tokenizer_dir: Path) -> None:
    """Before: the policy was built and then refused every act()."""
    with pytest.raises(ValueError, match="noise_level"):
        make_tiny_policy(tokenizer_dir, rollout=RolloutConfig(num_steps=5, noise_level=-0.5))


def test_zero_steps_is_a_config_error_not_a_zero_division() -> None:
    for build in (lambda: RolloutConfig(num_steps=0), lambda: SchedulerConfig(num_steps=(0,))):
        with pytest.raises(ValueError, match=r"num_steps.*expected an integer >= 1"):
            build()


# ------------------------------------------------------------------------------------------------ act() seeds
def _act(**kwargs: Any) -> Callable[[Any], Any]:
    return lambda c: c.policy.act(make_obs(2), **kwargs)


SEEDS: list[Case] = [
    ("generator", _act(seeds=torch.Generator().manual_seed(0)), TypeError,
     ("seeds", "an int or 2 seeds", "a Generator")),
    ("floats", _act(seeds=[1.5, 2.5]), TypeError, ("seeds[0]", "an int", "1.5")),
    ("integral_floats", _act(seeds=[1.0, 2.0]), TypeError, ("seeds[0]", "an int", "1.0")),
    ("float_array", _act(seeds=np.array([1.5, 2.5])), TypeError, ("seeds", "integer", "float64")),
    ("float_tensor", _act(seeds=torch.tensor([1.0, 2.0])), TypeError, ("seeds", "integer", "float32")),
    ("float_scalar", _act(seeds=3.5), TypeError, ("seeds", "an int or 2 seeds", "3.5")),
    ("bool", _act(seeds=True), TypeError, ("seeds", "an int or 2 seeds", "True")),
    ("string", _act(seeds="7"), TypeError, ("seeds", "an int or 2 seeds", "'7'")),
    ("too_big", _act(seeds=[2**63, 0]), ValueError, ("seeds[0]", "int64", str(2**63))),
    ("matrix", _act(seeds=np.zeros((2, 1), np.int64)), ValueError, ("seeds", "shape (2,)", "shape (2, 1)")),
    ("env_ids_floats", _act(env_ids=[0.5, 1.0]), TypeError, ("env_ids[0]", "an int", "0.5")),
    ("deterministic_str", _act(deterministic="no"), TypeError, ("deterministic", "True or False", "'no'")),
    ("image_zero_height", lambda c: c.policy.act({**make_obs(2), "images": {"image": np.zeros((2, 0, 8, 3), "u1")}}),
     ValueError, ("obs['images']['image']", "at least 1 x 1 pixels", "(2, 0, 8, 3)")),
    ("chunk_float", _act(action_chunk=2.5), TypeError, ("action_chunk", "integer in [1, 10]", "2.5")),
]


@pytest.mark.parametrize(("fn", "exc", "needles"), params(SEEDS))
def test_act_seeds_and_ids(ctx, fn, exc, needles) -> None:
    run_case(ctx, fn, exc, needles)


def test_float_seeds_are_not_truncated_into_another_envs_stream(policy: Pi05Policy) -> None:
    """Before: seeds=[1.5, 2.5] silently acted as [1, 2]; integer seeds still work, numpy and tensors too."""
    obs = make_obs(2)
    with pytest.raises(TypeError):
        policy.act(obs, seeds=[1.5, 2.5], env_ids=[40, 41])
    a = policy.act(obs, seeds=[1, 2], env_ids=[40, 41]).actions
    b = policy.act(obs, seeds=np.array([1, 2]), env_ids=[40, 41]).actions
    c = policy.act(obs, seeds=torch.tensor([1, 2]), env_ids=[40, 41]).actions
    d = policy.act(obs, seeds=1, env_ids=[40, 41]).actions  # an int s gives row i the seed s + i
    assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)


# ------------------------------------------------------------------------------------- checkpoints, devices, CLI
def _folder_with(c: Any, **files: bytes | str) -> Path:
    for name, content in files.items():
        path = c.tmp / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return c.tmp


def _copy(c: Any, saved: Path, drop: tuple[str, ...] = (), **edits: Any) -> Path:
    dst = c.tmp / "ckpt"
    shutil.copytree(saved, dst)
    for name in drop:
        (dst / name).unlink()
    for name, content in edits.items():
        (dst / name.replace("__", ".")).write_text(content if isinstance(content, str) else json.dumps(content))
    return dst


def _config_with(saved: Path, **changes: Any) -> dict[str, Any]:
    data = json.loads((saved / "config.json").read_text())
    data.update(changes)
    return data


def _sharded(c: Any, saved: Path, index: Any) -> Path:
    dst = _copy(c, saved, drop=("model.safetensors",))
    save_file(load_file(str(saved / "model.safetensors")), str(dst / "model-00001-of-00001.safetensors"))
    (dst / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    return dst


FRONT_DOOR: list[tuple[str, Callable[[Any, Path], Any], type[BaseException], tuple[str, ...]]] = [
    ("hub_id_make_policy", lambda c, s: make_policy(checkpoint="lerobot/pi05_libero"), CheckpointError,
     ("checkpoint:", "local checkpoint folder", "'lerobot/pi05_libero'", "hub ids are not fetched",
      "huggingface-cli download lerobot/pi05_libero")),
    ("hub_id_from_pretrained", lambda c, s: Pi05Policy.from_pretrained("lerobot/pi05_libero"), CheckpointError,
     ("path:", "hub id", "download it first")),
    ("file_not_folder", lambda c, s: make_policy(checkpoint=s / "model.safetensors"), CheckpointError,
     ("checkpoint:", "the checkpoint folder, not a file in it", "model.safetensors'", "Fix: pass its folder '")),
    ("pickle_only_make_policy", lambda c, s: make_policy(checkpoint=_folder_with(c, **{"pytorch_model.bin": b"x"})),
     CheckpointError, ("checkpoint:", "pytorch_model.bin", "pickle", "save_file(torch.load('pytorch_model.bin'")),
    ("missing_folder_library_words", lambda c, s: make_policy(checkpoint=c.tmp / "nope"), CheckpointError,
     ("checkpoint:", "no such folder", "config.json and model.safetensors")),
    ("no_config_json", lambda c, s: Pi05Policy.from_pretrained(_copy(c, s, drop=("config.json",))), CheckpointError,
     ("has no config.json", "Pi05Config.save(folder / 'config.json')")),
    ("config_json_list", lambda c, s: load_config(_folder_with(c, **{"config.json": "[1, 2]"})), CheckpointError,
     ("config.json", "a JSON object of Pi05Config fields", "[1, 2]")),
    ("config_json_wrong_type", lambda c, s: load_config(_copy(c, s, config__json=_config_with(s, action_horizon="10"))),
     TypeError, ("config.json", "Pi05Config: action_horizon", "'10'")),
    ("config_json_bad_tower", lambda c, s: load_config(_copy(c, s, config__json=_config_with(
        s, llm={**_config_with(s)["llm"], "rope_theta": -1.0}))), ValueError,
     ("config.json", "llm.rope_theta", "> 0.0", "-1.0")),
    ("lerobot_config_zero_chunk", lambda c, s: load_config(_folder_with(
        c, **{"config.json": json.dumps({"type": "pi05", "chunk_size": 0})})), ValueError,
     ("config.json (LeRobot): chunk_size", ">= 1", "got 0")),
    ("index_not_json", lambda c, s: load_weights(c.policy.model, _sharded(c, s, "{oops")), CheckpointError,
     ("model.safetensors.index.json", "not valid JSON")),
    ("index_no_weight_map", lambda c, s: load_weights(c.policy.model, _sharded(c, s, {"metadata": {}})),
     CheckpointError, ("weight_map", "non-empty object", "None")),
    ("index_shard_outside", lambda c, s: load_weights(c.policy.model, _sharded(
        c, s, {"weight_map": {"a": "../model-00001-of-00001.safetensors"}})), CheckpointError,
     ("weight_map shard", "same folder", "'../model-00001-of-00001.safetensors'")),
    ("norm_stats_nan", lambda c, s: Pi05Processor.from_pretrained(_copy(c, s, norm_stats__json={
        "norm_stats": {"state": {"mean": [0.0, float("nan")], "std": [1.0, 1.0]}}})), ValueError,
     ("norm_stats.json: state statistics", "NormStats.mean", "finite", "nan at index 1")),
    ("norm_stats_lengths", lambda c, s: Pi05Processor.from_pretrained(_copy(c, s, norm_stats__json={
        "norm_stats": {"actions": {"mean": [0.0, 1.0, 2.0], "std": [1.0]}}})), ValueError,
     ("norm_stats.json: actions statistics", "one length", "{'mean': 3, 'std': 1}")),
    ("norm_stats_not_dict", lambda c, s: Pi05Processor.from_pretrained(_copy(c, s, norm_stats__json={
        "norm_stats": {"state": [0.0, 1.0]}})), ValueError,
     ("norm_stats.json: state", "a dict of statistics", "[0.0, 1.0]")),
    ("norm_stats_not_json", lambda c, s: Pi05Processor.from_pretrained(_copy(c, s, norm_stats__json="{nan")),
     ValueError, ("norm_stats.json", "not valid JSON")),
    ("processor_json_wrong_type", lambda c, s: Pi05Processor.from_pretrained(_copy(
        c, s, processor_config__json={**json.loads((s / "processor_config.json").read_text()), "image_size": "big"})),
     TypeError, ("processor_config.json", "ProcessorConfig.image_size", "'big'")),
    ("processor_json_unknown_key", lambda c, s: Pi05Processor.from_pretrained(_copy(
        c, s, processor_config__json={**json.loads((s / "processor_config.json").read_text()), "colour": 1})),
     ValueError, ("processor_config.json", "unknown ProcessorConfig keys ['colour']")),
    ("processor_json_not_object", lambda c, s: Pi05Processor.from_pretrained(_copy(
        c, s, processor_config__json="[]")), ValueError, ("processor_config.json", "an object", "[]")),
    ("policy_json_bad_rollout", lambda c, s: Pi05Policy.from_pretrained(_copy(
        c, s, policy_config__json={"rollout": {"num_steps": 5, "noise_level": -1.0}})), ValueError,
     ("RolloutConfig.noise_level", ">= 0.0", "-1.0")),
]


@pytest.mark.parametrize(("fn", "exc", "needles"), [pytest.param(f, e, n, id=i) for i, f, e, n in FRONT_DOOR])
def test_checkpoint_front_door(ctx, saved, fn, exc, needles) -> None:
    message = run_case(ctx, lambda c: fn(c, saved), exc, needles)
    if "make_policy" in message or "checkpoint:" in message:
        assert "--checkpoint" not in message, "a library call must not speak of the CLI flag"


def _cli(*argv: str) -> Callable[[Any], Any]:
    return lambda c: cli.main(list(argv))


DEVICES: list[Case] = [
    ("make_policy_cuda", lambda c: make_policy(device="cuda"), ValueError,
     ("device:", "a device this machine has", "'cuda'", "device='cpu'", "CUDA is not available")),
    ("from_config_cuda", lambda c: make_tiny_policy(c.tokenizer_dir, device="cuda"), ValueError,
     ("device:", "'cuda'", "device='cpu'")),
    ("cli_run_cuda", _cli("run", "--env", "scripted", "--device", "cuda"), SystemExit,
     ("--device:", "'cuda'", "--device cpu", "CUDA is not available")),
    ("cli_eval_cuda", _cli("eval", "--env", "scripted", "--policy", "tiny", "--episodes", "1", "--device", "cuda"),
     SystemExit, ("--device:", "'cuda'", "--device cpu")),
]


@NO_CUDA
@pytest.mark.parametrize(("fn", "exc", "needles"), params(DEVICES))
def test_cuda_refused_up_front(ctx, fn, exc, needles) -> None:
    run_case(ctx, fn, exc, needles)


OTHER: list[Case] = [
    ("make_policy_seed_float", lambda c: make_policy(seed=1.5), TypeError, ("seed", "an integer", "1.5")),
    ("make_policy_rollout_dict", lambda c: make_policy(rollout={"num_steps": 5}), TypeError,
     ("rollout", "a RolloutConfig or None", "{'num_steps': 5}")),
    ("from_config_scheduler_dict", lambda c: make_tiny_policy(c.tokenizer_dir, scheduler={"max_batch_size": 2}),
     TypeError, ("scheduler", "a SchedulerConfig", "{'max_batch_size': 2}")),
    ("device_name", lambda c: make_policy(device="tpu"), ValueError, ("device:", "'cpu', 'cuda'", "'tpu'")),
    ("cli_device_name", _cli("run", "--env", "scripted", "--device", "gpu0"), SystemExit, ("--device:", "'gpu0'")),
    ("cli_hub_id", _cli("run", "--env", "scripted", "--checkpoint", "lerobot/pi05_libero"), SystemExit,
     ("--checkpoint:", "hub ids are not fetched", "--local-dir")),
    ("cli_pickle_only", lambda c: cli.main(["eval", "--env", "scripted", "--episodes", "1", "--checkpoint",
                                            str(_folder_with(c, **{"pytorch_model.bin": b"x"}))]), SystemExit,
     ("--checkpoint:", "pytorch_model.bin", "save_file(torch.load")),
    ("cli_action_chunk_zero", _cli("run", "--env", "scripted", "--action-chunk", "0"), SystemExit,
     ("--action-chunk", ">= 1", "got 0")),
    ("cli_std_negative", _cli("run", "--env", "scripted", "--policy", "gaussian", "--std", "-1"), SystemExit,
     ("--std", "> 0.0", "-1.0")),
    ("cli_image_size_zero", _cli("run", "--env", "scripted", "--image-size", "0"), SystemExit,
     ("--image-size", ">= 1", "got 0")),
    ("cli_video_negative", _cli("eval", "--env", "scripted", "--policy", "gaussian", "--episodes", "1", "--video",
                                "-1"), SystemExit, ("--video", ">= 0", "got -1")),
    ("cli_max_episodes_zero", _cli("eval", "--env", "scripted", "--policy", "gaussian", "--episodes", "1",
                                   "--max-episodes-this-run", "0"), SystemExit,
     ("--max-episodes-this-run", ">= 1", "got 0")),
    ("wrapper_chunk_zero", lambda c: PolicyVectorEnv(make_scripted_env(2), c.policy, action_chunk=0), ValueError,
     ("action_chunk", "[1, 10]", "got 0", "1 <= action_chunk <= 10")),
    ("wrapper_chunk_float", lambda c: PolicyVectorEnv(make_scripted_env(2), c.policy, action_chunk=2.5), TypeError,
     ("action_chunk", "[1, 10]", "2.5")),
    ("obs_long_task_list", lambda c: c.policy.act({**make_obs(2), "task": ["a", "b", "c"]}), ValueError,
     ("obs['task']: expected 2 rows", "obs['task'] 3", "obs['images']['image'] 2")),
    ("obs_inf_where", lambda c: c.policy.act({**make_obs(3), "state": np.where(np.eye(3, 4) * [0, 0, 1, 0] > 0,
                                                                                 np.inf, 0).astype(np.float32)}),
     ValueError, ("obs['state']", "Inf at row 2 (env 2), column 2")),
]


@pytest.mark.parametrize(("fn", "exc", "needles"), params(OTHER))
def test_other_boundaries(ctx, fn, exc, needles) -> None:
    message = run_case(ctx, fn, exc, needles)
    assert "action_chunk<=" not in message, "the old message named only the upper bound"
