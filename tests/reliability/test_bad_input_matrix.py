"""Bad-input matrix: every public boundary refuses bad arguments with a typed error whose message names the
argument, the expected and the received value -- and the refusal leaves the policy exactly as it was.

Each row is (id, bad call, exception type, substrings of the message). Every case runs between a reference
`act()` and a repeat of it (`conftest.Probe`): the stream table, the weight version and the outputs must be
bit-identical afterwards.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from reliability_support import check_message, make_obs, make_tiny_policy, run_case
from safetensors.torch import load_file, save_file

from phyai_gym import cli
from policies.baseline import GaussianPolicy
from policies.pi05.checkpoint import CheckpointError, load_config, load_weights
from policies.pi05.config import Pi05Config
from policies.pi05.policy import Pi05Policy, RolloutConfig
from policies.pi05.scheduler import SchedulerConfig
from policies.pi05.weight_sync import WeightSyncError, WeightSyncStateError
from wrappers import PolicyVectorEnv
from wrappers.adapters.scripted import make_scripted_env

Case = tuple[str, Callable[[Any], Any], type[BaseException], tuple[str, ...]]


def _obs(**changes: Any) -> dict[str, Any]:
    obs = make_obs(2)
    for key, value in changes.items():
        if key.startswith("image"):
            obs["images"] = {"image": value} if key == "image" else value
        else:
            obs[key] = value
    return obs


def _run(ctx: Any, fn: Callable[[Any], Any], exc: type[BaseException], needles: tuple[str, ...]) -> None:
    run_case(ctx, fn, exc, needles)


def _ids(cases: list[Case]) -> list[Any]:
    return [pytest.param(fn, exc, needles, id=name) for name, fn, exc, needles in cases]


# --------------------------------------------------------------------------------------------------- processor
PROCESSOR: list[Case] = [
    ("float_image", lambda c: c.policy.act(_obs(image=np.zeros((2, 8, 8, 3), np.float32))), TypeError,
     ("obs['images']['image']", "uint8", "float32")),
    ("channel_first_image", lambda c: c.policy.processor(_obs(image=np.zeros((2, 3, 8, 8), np.uint8))), ValueError,
     ("obs['images']['image']", "(N, H, W, 3)", "(2, 3, 8, 8)")),
    ("missing_camera", lambda c: c.policy.act(_obs(images={"wrist": np.zeros((2, 8, 8, 3), np.uint8)})), ValueError,
     ("obs['images']", "'image'", "['wrist']")),
    ("state_rows", lambda c: c.policy.act(_obs(state=np.zeros((3, 4), np.float32))), ValueError,
     ("obs['state']", "expected 2 rows", "obs['state'] 3")),
    ("state_width", lambda c: c.policy.act(_obs(state=np.zeros((2, 5), np.float32))), ValueError,
     ("obs['state']", "expected width 4", "got 5")),
    ("state_nan", lambda c: c.policy.act(_obs(state=np.full((2, 4), np.nan, np.float32))), ValueError,
     ("obs['state']", "expected finite", "NaN at row 0 (env 0), column 0")),
    ("state_int", lambda c: c.policy.act(_obs(state=np.zeros((2, 4), np.int64))), TypeError,
     ("obs['state']", "float", "int64")),
    ("task_is_str", lambda c: c.policy.act(_obs(task="push")), TypeError,
     ("obs['task']", "sequence of N strings", "str")),
    ("empty_task", lambda c: c.policy.act(_obs(task=["push", "  "])), ValueError,
     ("obs['task'][1]", "non-empty task", "'  '")),
    ("obs_not_mapping", lambda c: c.policy.act([1, 2]), TypeError, ("obs", "mapping", "list")),
    ("postprocess_chunk", lambda c: c.policy.processor.postprocess(torch.zeros(2, 10, 32), 11), ValueError,
     ("action_chunk", "1..H=10", "got 11")),
]


@pytest.mark.parametrize(("fn", "exc", "needles"), _ids(PROCESSOR))
def test_processor(ctx, fn, exc, needles) -> None:
    _run(ctx, fn, exc, needles)


# ------------------------------------------------------------------------------------------------------ policy
def _other_slots(c: Any) -> Any:
    """ModelInputs for a camera set the scheduler never declared: refused after the streams were looked up."""
    inputs = c.policy.processor(make_obs(2))
    images = inputs.images.repeat(1, 2, 1, 1, 1)
    bad = dataclasses.replace(inputs, images=images, image_mask=inputs.image_mask.repeat(1, 2), slots=(0, 1))
    return c.policy.act_inputs(bad, seeds=[5, 6], env_ids=[7, 9])


def _evaluate_header(c: Any) -> Any:
    out = c.policy.act(make_obs(2), env_ids=[30, 31])
    c.policy.streams.counters[[30, 31]] -= 1  # undo the helper's call: the probe compares the whole table
    return c.policy.evaluate(dataclasses.replace(out, header=dataclasses.replace(out.header, num_steps=7)))


def _evaluate_stripped(c: Any) -> Any:
    out = c.policy.act(make_obs(2), env_ids=[30, 31])
    c.policy.streams.counters[[30, 31]] -= 1
    return c.policy.evaluate(dataclasses.replace(out, chains=None))


def _from_config(**kwargs: Any) -> Callable[[Any], Any]:
    def build(c: Any) -> Any:
        return make_tiny_policy(c.tokenizer_dir, **kwargs)

    return build


POLICY: list[Case] = [
    ("seeds_len", lambda c: c.policy.act(make_obs(2), seeds=[1, 2, 3]), ValueError,
     ("seeds", "an int or 2 seeds", "(3,)")),
    ("env_ids_len", lambda c: c.policy.act(make_obs(2), env_ids=[0, 1, 2]), ValueError,
     ("env_ids", "expected 2 ids", "(3,)")),
    ("env_ids_negative", lambda c: c.policy.act(make_obs(2), env_ids=[-1, 0]), ValueError,
     ("env_ids", ">= 0", "[-1, 0]")),
    ("action_chunk_big", lambda c: c.policy.act(make_obs(2), action_chunk=11), ValueError,
     ("action_chunk", "1..10", "got 11")),
    ("action_chunk_zero", lambda c: c.policy.act(make_obs(2), action_chunk=0), ValueError,
     ("action_chunk", "1..10", "got 0")),
    ("undeclared_cameras", _other_slots, ValueError, ("camera set (0, 1)", "camera_sets=((0,),)")),
    ("value_bad_obs", lambda c: c.policy.value(_obs(state=np.full((2, 4), np.inf, np.float32))), ValueError,
     ("obs['state']", "finite", "Inf")),
    ("value_bad_env_ids", lambda c: c.policy.value(make_obs(2), env_ids=[1]), ValueError,
     ("env_ids", "expected 2 ids", "(1,)")),
    ("evaluate_header", _evaluate_header, ValueError, ("num_steps", "7", "5")),
    ("evaluate_stripped", _evaluate_stripped, ValueError, ("evaluate(batch)", "chains", "None")),
    ("evaluate_not_output", lambda c: c.policy.evaluate({"actions": 1}), TypeError,
     ("evaluate(batch)", "PolicyOutput", "dict")),
    ("from_config_action_dim", _from_config(action_dim=0), ValueError,
     ("action_dim", "1..model_action_dim (32)", "got 0")),
    ("from_config_chunk", _from_config(rollout=RolloutConfig(num_steps=5, action_chunk=20)), ValueError,
     ("rollout.action_chunk", "action_horizon (10)", "got 20")),
    ("from_config_dtype", _from_config(dtype="float17"), ValueError, ("dtype", "bfloat16", "'float17'")),
    ("from_config_num_steps", _from_config(rollout=RolloutConfig(num_steps=7), scheduler=SchedulerConfig(
        max_batch_size=2, num_steps=(5,))), ValueError,
     ("rollout.num_steps", "(5,)", "got 7")),
    ("rollout_method", lambda c: RolloutConfig(method="ddim"), ValueError, ("method", "'sde'", "'ddim'")),
    ("rollout_trainable", lambda c: RolloutConfig(trainable="lora"), ValueError,
     ("RolloutConfig.trainable", "('expert', 'all')", "'lora'")),
    ("config_type", lambda c: Pi05Config.from_dict({"type": "pi0"}), ValueError, ("'type'", "'pi05'", "'pi0'")),
]


@pytest.mark.parametrize(("fn", "exc", "needles"), _ids(POLICY))
def test_policy(ctx, fn, exc, needles) -> None:
    _run(ctx, fn, exc, needles)


# ----------------------------------------------------------------------------------------------------- wrapper
def _wrapper(c: Any, env: Any = None, **kwargs: Any) -> PolicyVectorEnv:
    env = make_scripted_env(2) if env is None else env
    try:
        return PolicyVectorEnv(env, c.policy, **kwargs)
    finally:
        if hasattr(env, "close"):
            env.close()


def _step_bad_actions(c: Any) -> Any:
    wrapper = PolicyVectorEnv(make_scripted_env(2), c.policy, action_chunk=4)
    try:
        wrapper.reset(seed=0)
        return wrapper.step(np.zeros((2, 5, 3), np.float32))
    finally:
        wrapper.close()


def _reset_bad_seeds(c: Any) -> Any:
    wrapper = PolicyVectorEnv(make_scripted_env(2), c.policy, action_chunk=4)
    try:
        return wrapper.reset(seed=[1, 2, 3])
    finally:
        wrapper.close()


def _step_before_reset(c: Any) -> Any:
    wrapper = PolicyVectorEnv(make_scripted_env(2), c.policy, action_chunk=4)
    try:
        return wrapper.step()
    finally:
        wrapper.close()


WRAPPER: list[Case] = [
    ("chunk_too_long", lambda c: _wrapper(c, action_chunk=11), ValueError,
     ("action_chunk", "policy.action_horizon=10", "got 11")),
    ("chunk_zero", lambda c: _wrapper(c, action_chunk=0), ValueError, ("action_chunk", "[1,", "got 0")),
    ("env_not_vector", lambda c: _wrapper(c, env="scripted"), TypeError,
     ("`env`", "gymnasium.vector.VectorEnv", "got str")),
    ("env_not_freezable", lambda c: _wrapper(c, env=gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")])),
     ValueError, ("`env`", "freeze", "got SyncVectorEnv")),
    ("action_dims", lambda c: _wrapper(c, env=make_scripted_env(2, action_dim=4)), ValueError,
     ("policy.action_dim=3", "action dims 4")),
    ("groups", lambda c: _wrapper(c, groups=2), ValueError, ("`groups`", "is 2", "1 vector env")),
    ("policy_type", lambda c: PolicyVectorEnv(make_scripted_env(2), object()), TypeError,
     ("`policy`", "policies.base.Policy", "got object")),
    ("step_actions_shape", _step_bad_actions, ValueError, ("`actions`", "(2, 4, 3)", "got (2, 5, 3)")),
    ("reset_seed_len", _reset_bad_seeds, ValueError, ("`seed`", "3 entries", "expected 2")),
    ("step_before_reset", _step_before_reset, RuntimeError, ("step", "reset()")),
]


@pytest.mark.parametrize(("fn", "exc", "needles"), _ids(WRAPPER))
def test_wrapper(ctx, fn, exc, needles) -> None:
    _run(ctx, fn, exc, needles)


# ---------------------------------------------------------------------------------------------------- adapters
def _mujoco(**kwargs: Any) -> Callable[[Any], Any]:
    def build(c: Any) -> Any:
        from wrappers.adapters.mujoco import make_mujoco_env

        return make_mujoco_env(**kwargs)

    return build


def _mujoco_render_mode(c: Any) -> Any:
    from wrappers.adapters.mujoco import MujocoCanonicalObservation

    env = gym.make("Pusher-v5")
    try:
        return MujocoCanonicalObservation(env, task="push")
    finally:
        env.close()


MUJOCO: list[Case] = [
    ("unknown_name", _mujoco(name="Pushr-v5"), ValueError, ("name", "Pusher-v5", "'Pushr-v5'")),
    ("num_envs", _mujoco(num_envs=0), ValueError, ("num_envs", ">= 1", "got 0")),
    ("image_size", _mujoco(image_size=-8), ValueError, ("image_size", ">= 1", "got -8")),
    ("shadow_size", _mujoco(shadow_size=-1), ValueError, ("shadow_size", ">= 0", "got -1", "Fix")),
    ("vectorization", _mujoco(num_envs=1, vectorization="threads"), ValueError,
     ("vectorization", "'sync' or 'async'", "'threads'")),
    ("render_mode", _mujoco_render_mode, ValueError, ("render_mode", "'rgb_array'", "None")),
]


@pytest.mark.parametrize(("fn", "exc", "needles"), _ids(MUJOCO))
def test_mujoco_adapter(ctx, fn, exc, needles) -> None:
    pytest.importorskip("mujoco", reason="gymnasium[mujoco] is not installed")
    _run(ctx, fn, exc, needles)


def _libero(needs_package: bool, **kwargs: Any) -> Callable[[Any], Any]:
    def build(c: Any) -> Any:
        from wrappers.adapters.libero import make_libero_env

        if needs_package:
            pytest.importorskip("libero", reason="LIBERO is not installed (pip install 'phyai-gym[libero]')")
        return make_libero_env(**kwargs)

    build.needs_package = needs_package  # type: ignore[attr-defined]
    return build


LIBERO: list[Case] = [
    ("preset", _libero(False, suite="libero_spatial", preset="bogus"), ValueError,
     ("preset", "'openpi'", "'bogus'")),
    ("vectorization", _libero(False, suite="libero_spatial", vectorization="threads"), ValueError,
     ("vectorization", "'sync' or 'async'", "'threads'")),
    ("group_size", _libero(False, suite="libero_spatial", group_size=0), ValueError, ("group_size", ">= 1", "got 0")),
    ("suite", _libero(True, suite="libero_spatail"), ValueError, ("suite", "libero_spatial", "'libero_spatail'")),
    ("task_id", _libero(True, suite="libero_spatial", task_ids=[99]), ValueError, ("task id 99", "(0..9)")),
    ("num_envs", _libero(True, suite="libero_spatial", task_ids=[0], group_size=2, num_envs=3), ValueError,
     ("num_envs (3)", "multiple of group_size (2)")),
    ("init_state_id", _libero(True, suite="libero_spatial", task_ids=[0], init_state_ids=[999]), ValueError,
     ("init state id 999", "(0..49)")),
]


@pytest.mark.parametrize(("fn", "exc", "needles"), _ids(LIBERO))
def test_libero_adapter(ctx, fn, exc, needles) -> None:
    _run(ctx, fn, exc, needles)


def _maniskill(needs_package: bool, **kwargs: Any) -> Callable[[Any], Any]:
    def build(c: Any) -> Any:
        from wrappers.adapters.maniskill import make_maniskill_env

        if needs_package:
            pytest.importorskip("mani_skill", reason="ManiSkill3 is not installed (pip install 'phyai-gym[maniskill]')")
        return make_maniskill_env(**kwargs)

    return build


MANISKILL: list[Case] = [
    ("sim_backend", _maniskill(False, task="PickCube-v1", sim_backend="tpu"), ValueError,
     ("sim_backend", "'gpu', 'cpu' or 'auto'", "'tpu'")),
    ("vectorization", _maniskill(False, task="PickCube-v1", sim_backend="cpu", vectorization="threads"), ValueError,
     ("vectorization", "'maniskill'", "'threads'")),
    ("cpu_batched", _maniskill(False, task="PickCube-v1", sim_backend="cpu", vectorization="maniskill", num_envs=2),
     ValueError, ("num_envs", "num_envs=1", "num_envs=2")),
    ("gpu_sync", _maniskill(False, task="PickCube-v1", sim_backend="gpu", vectorization="sync"), ValueError,
     ("vectorization", "'maniskill'", "'sync'")),
    ("num_envs", _maniskill(False, task="PickCube-v1", sim_backend="cpu", num_envs=0), ValueError,
     ("num_envs", ">= 1", "got 0")),
    ("unknown_task", _maniskill(True, task="PickCub-v1", sim_backend="cpu"), ValueError,
     ("task", "PickCube-v1", "'PickCub-v1'")),
]


@pytest.mark.parametrize(("fn", "exc", "needles"), _ids(MANISKILL))
def test_maniskill_adapter(ctx, fn, exc, needles) -> None:
    _run(ctx, fn, exc, needles)


# ------------------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def checkpoint(policy: Pi05Policy, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared policy saved with `save_pretrained` (config, weights, processor, rollout settings)."""
    return policy.save_pretrained(tmp_path_factory.mktemp("reliability_ckpt"))


def _copy_without(src: Path, dst: Path, drop: str | None = None, reshape: str | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "processor_config.json", "policy_config.json"):
        (dst / name).write_text((src / name).read_text())
    tensors = load_file(str(src / "model.safetensors"))
    if drop is not None:
        tensors.pop(drop)
    if reshape is not None:
        tensors[reshape] = torch.zeros(3, 3)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


EXPERT_KEY = "paligemma_with_expert.gemma_expert.model.layers.0.mlp.up_proj.weight"


def _pickle_folder(c: Any) -> Any:
    (c.tmp / "model.bin").write_bytes(b"\x80\x04not really a pickle")
    return load_weights(c.policy.model, c.tmp)


def _bad_json(c: Any) -> Any:
    (c.tmp / "config.json").write_text("{not json")
    return load_config(c.tmp)


def _unknown_config_key(c: Any, checkpoint: Path) -> Any:
    data = json.loads((checkpoint / "config.json").read_text())
    data["action_dims"] = 7
    (c.tmp / "config.json").write_text(json.dumps(data))
    return load_config(c.tmp)


CHECKPOINT: list[tuple[str, Callable[[Any, Path], Any], type[BaseException], tuple[str, ...]]] = [
    ("missing_path", lambda c, ck: load_weights(c.policy.model, c.tmp / "nope"), CheckpointError,
     ("nope", "does not exist", "model.safetensors")),
    ("pickle_only", lambda c, ck: _pickle_folder(c), CheckpointError, ("model.bin", "only safetensors", "pickle")),
    ("bad_json", lambda c, ck: _bad_json(c), CheckpointError, ("config.json", "not valid JSON")),
    ("unknown_config_key", _unknown_config_key, ValueError, ("action_dims",)),
    ("shape_mismatch_strict", lambda c, ck: load_weights(c.policy.model, _copy_without(ck, c.tmp, reshape=EXPERT_KEY)),
     CheckpointError, ("expert.layers.0.mlp.up_proj.weight", "model expects [72, 40]", "checkpoint has [3, 3]")),
    ("missing_key_strict", lambda c, ck: load_weights(c.policy.model, _copy_without(ck, c.tmp, drop=EXPERT_KEY)),
     CheckpointError, ("missing keys (1)", "expert.layers.0.mlp.up_proj.weight", "strict=True")),
    ("unknown_preset", lambda c, ck: Pi05Policy.from_pretrained(ck, preset="openpi_pi07"), ValueError,
     ("preset", "'openpi_pi07'", "openpi_pi05_libero")),
    ("from_pretrained_dtype", lambda c, ck: Pi05Policy.from_pretrained(ck, dtype="fp8"), ValueError,
     ("dtype", "'bfloat16'", "'fp8'")),
]


@pytest.mark.parametrize(
    ("fn", "exc", "needles"), [pytest.param(f, e, n, id=i) for i, f, e, n in CHECKPOINT]
)
def test_checkpoint(ctx, checkpoint, fn, exc, needles) -> None:
    _run(ctx, lambda c: fn(c, checkpoint), exc, needles)


# ------------------------------------------------------------------------------------------------ weight sync
NAME = "expert.layers.0.mlp.up_proj.weight"
NAME2 = "expert.layers.1.mlp.up_proj.weight"


def _param(c: Any, name: str = NAME) -> torch.Tensor:
    return dict(c.policy.model.named_parameters())[name].detach().clone()


def _begin_twice(c: Any) -> Any:
    c.policy.begin_weight_update([NAME])
    try:
        c.policy.begin_weight_update([NAME])
    finally:
        c.policy.abort_weight_update()


def _stale_version(c: Any) -> Any:
    c.policy.begin_weight_update([NAME])
    c.policy.update_weights({NAME: _param(c)})
    return c.policy.finish_weight_update(version=c.policy.weight_version)


def _missing(c: Any) -> Any:
    c.policy.begin_weight_update([NAME, NAME2])
    c.policy.update_weights({NAME: _param(c)})
    return c.policy.finish_weight_update()


def _broadcast_without_source(c: Any) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{c.tmp}/rendezvous", rank=0, world_size=1)
    try:
        return c.policy.broadcast_weights(None, expected=[NAME])
    finally:
        dist.destroy_process_group()


WEIGHT_SYNC: list[Case] = [
    ("shape", lambda c: c.policy.sync_weights({NAME: torch.zeros(3, 3)}, expected=[NAME]), WeightSyncError,
     (NAME, "expected shape [72, 40]", "received [3, 3]")),
    ("unknown_name", lambda c: c.policy.sync_weights({"expert.nope.weight": torch.zeros(3)}, expected=[NAME]),
     WeightSyncError, ("'expert.nope.weight'", "names no parameter", "expected our names")),
    ("expected_mode", lambda c: c.policy.begin_weight_update("some"), WeightSyncError,
     ("expected", "'all', 'trainable'", "'some'")),
    ("expected_unknown", lambda c: c.policy.begin_weight_update(["nope.weight"]), WeightSyncError,
     ("expected", "non-parameter", "'nope.weight'")),
    ("not_a_tensor", lambda c: c.policy.sync_weights({NAME: "zeros"}, expected=[NAME]), WeightSyncError,
     (NAME, "torch.Tensor", "str")),
    ("int_dtype", lambda c: c.policy.sync_weights({NAME: torch.zeros(72, 40, dtype=torch.int64)}, expected=[NAME]),
     WeightSyncError, (NAME, "floating-point", "torch.int64")),
    ("source_type", lambda c: c.policy.sync_weights(42, expected=[NAME]), WeightSyncError,
     ("sync_weights", "mapping name -> tensor", "got int")),
    ("duplicate", lambda c: c.policy.sync_weights([(NAME, _param(c)), (NAME, _param(c))], expected=[NAME]),
     WeightSyncError, (NAME, "already sent", "once per update")),
    ("missing", _missing, WeightSyncError, ("1 of the 2 expected", NAME2)),
    ("stale_version", _stale_version, WeightSyncError, ("version", "expected > 0", "received 0")),
    ("no_begin", lambda c: c.policy.update_weights({NAME: _param(c)}), WeightSyncStateError,
     ("update_weights", "no weight update in progress", "begin_weight_update()")),
    ("begin_twice", _begin_twice, WeightSyncStateError, ("begin_weight_update", "already in progress")),
    ("broadcast_no_source", _broadcast_without_source, WeightSyncError, ("source", "got None")),
]


@pytest.mark.parametrize(("fn", "exc", "needles"), _ids(WEIGHT_SYNC))
def test_weight_sync(ctx, fn, exc, needles) -> None:
    _run(ctx, fn, exc, needles)


# --------------------------------------------------------------------------------------------------------- CLI
def _has_command(name: str) -> bool:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return name in sub.choices


def _cli(*argv: str) -> Callable[[Any], Any]:
    def call(c: Any) -> Any:
        if not _has_command(argv[0]):
            pytest.skip(f"`phyai-gym {argv[0]}` does not exist yet")
        return cli.main(list(argv))

    return call


CLI: list[Case] = [
    ("run_num_envs", _cli("run", "--env", "scripted", "--num-envs", "0"), SystemExit, ("--num-envs", ">= 1", "got 0")),
    ("run_unknown_env", _cli("run", "--env", "Pushr-v5"), SystemExit, ("unknown env", "'Pushr-v5'", "Pusher-v5")),
    ("run_conflict", _cli("run", "--env", "scripted", "--checkpoint", "/nowhere", "--policy", "tiny"), SystemExit,
     ("--checkpoint", "'/nowhere'", "--policy", "'tiny'")),
    ("run_int_flag", _cli("run", "--action-chunk", "five"), SystemExit, ("--action-chunk", "int", "'five'")),
    ("run_policy_choice", _cli("run", "--policy", "huge"), SystemExit, ("--policy", "'huge'", "'tiny'")),
    ("eval_episodes", _cli("eval", "--env", "scripted", "--policy", "gaussian", "--episodes", "0"), SystemExit,
     ("--episodes", ">= 1", "got 0")),
    ("eval_no_policy", _cli("eval", "--env", "scripted", "--episodes", "1"), SystemExit,
     ("--checkpoint", "--policy")),
    ("eval_video_without_out", _cli("eval", "--env", "scripted", "--policy", "gaussian", "--episodes", "1",
                                    "--video", "2"), SystemExit, ("--video", "--out")),
    ("eval_task_ids", _cli("eval", "--env", "scripted", "--policy", "gaussian", "--episodes", "1", "--task-ids", "1"),
     SystemExit, ("--task-ids", "LIBERO", "'scripted'")),
]


@pytest.mark.parametrize(("fn", "exc", "needles"), _ids(CLI))
def test_cli(ctx, fn, exc, needles) -> None:
    _run(ctx, fn, exc, needles)


def test_cli_errors_exit_with_status_2(ctx) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--env", "scripted", "--num-envs", "0"])
    assert info.value.code == 2


def test_every_component_has_three_cases() -> None:
    for name, table in [("processor", PROCESSOR), ("policy", POLICY), ("wrapper", WRAPPER), ("mujoco", MUJOCO),
                        ("libero", LIBERO), ("maniskill", MANISKILL), ("checkpoint", CHECKPOINT),
                        ("weight_sync", WEIGHT_SYNC), ("cli", CLI)]:  # fmt: skip
        assert len(table) >= 3, name


def test_gaussian_baseline_refuses_bad_seeds() -> None:
    """The baseline follows the same protocol: a refused call changes no stream."""
    policy = GaussianPolicy(3, action_horizon=4)
    obs = make_obs(2)
    before = policy.streams.state()
    with pytest.raises(ValueError) as info:
        policy.act(obs, seeds=[1, 2, 3])
    check_message(str(info.value), "seeds", "2 seeds", "(3,)")
    after = policy.streams.state()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
