"""A tiny PI0.5 driven end to end by `PolicyVectorEnv` on each real simulator (MuJoCo, LIBERO, ManiSkill3).

For each simulator: ``step(None)`` returns the Gymnasium 5-tuple with the right shapes, ``infos["policy"]``
carries the policy's (N, ...) tensors, the policy's actions are exactly what the simulator executed (a replay of
the recorded actions through ``step(actions)`` reproduces the state), and an episode that hits its step limit
mid-chunk is frozen, reported (``episode``, ``final_obs``, ``final_value``) and reset at the chunk boundary.
The orientation tests check the pixels the MODEL receives (`ModelInputs.images`, slot ``base_0_rgb``, from
`PolicyOutput.inputs`) against the same scene properties as the adapter tests (`scene_orientation`).

Cost on 2 idle cores: one 2-env LIBERO vector env (~15-20 s to build and settle, shared by the module), one
1-env ManiSkill CPU env (~10 s, mostly imports), two 2-env MuJoCo Pusher envs (~1 s); the tiny policy takes
~0.1 s a call. Each simulator's tests skip only when that simulator is not installed.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import warnings
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

from scene_orientation import (  # noqa: E402
    assert_libero_agentview_upright,
    assert_libero_wrist_upright,
    assert_maniskill_upright,
)

from policies.pi05.config import Pi05Config  # noqa: E402
from policies.pi05.policy import Pi05Policy  # noqa: E402
from wrappers import PolicyVectorEnv  # noqa: E402
from wrappers.adapters.libero import make_libero_env  # noqa: E402
from wrappers.adapters.maniskill import make_maniskill_env  # noqa: E402
from wrappers.adapters.mujoco import make_mujoco_env  # noqa: E402

HAVE_MUJOCO = importlib.util.find_spec("mujoco") is not None
HAVE_LIBERO = importlib.util.find_spec("libero") is not None
HAVE_MANISKILL = importlib.util.find_spec("mani_skill") is not None
needs_mujoco = pytest.mark.skipif(not HAVE_MUJOCO, reason="MuJoCo is not installed (pip install gymnasium[mujoco])")
needs_libero = pytest.mark.skipif(not HAVE_LIBERO, reason="LIBERO is not installed (bash .ci/install_sims.sh libero)")
needs_maniskill = pytest.mark.skipif(
    not HAVE_MANISKILL, reason="ManiSkill3 is not installed (bash .ci/install_sims.sh maniskill)"
)

C = 5  # executed chunk
LIMIT = 7  # episode limit: chunk 1 runs 5 sub-steps, chunk 2 runs 2 and truncates, 3 are frozen
A = 7
K = Pi05Config.tiny().num_steps
H = Pi05Config.tiny().action_horizon
BASE = 0  # index of slot base_0_rgb in Pi05Config.camera_slots
WRIST = 1  # left_wrist_0_rgb


def _policy(**kwargs: Any) -> Pi05Policy:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stand-in tokenizer, no norm statistics: expected for a random policy
        return Pi05Policy.from_config(Pi05Config.tiny(), action_dim=A, seed=0, tokenizer="phyai-standin", **kwargs)


def _np(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _run(env: PolicyVectorEnv, chunks: int, seed: int = 0) -> dict[str, Any]:
    """reset(seed) and `chunks` policy steps; returns deep copies of everything (and the policy outputs)."""
    obs, info = env.reset(seed=seed)
    record: dict[str, Any] = {"obs0": copy.deepcopy(obs), "expected_inputs": env.policy.processor(obs), "steps": []}
    for _ in range(chunks):
        result = env.step(None)
        record["steps"].append((copy.deepcopy(result), env.last_output))
    return record


def _check_chunk(result: tuple, out: Any, n: int, state_dim: int) -> None:
    """The 5-tuple and the policy info of one `step(None)` (these numpy envs return numpy, the policy torch)."""
    obs, rewards, terminated, truncated, infos = result
    assert set(obs) == {"images", "state", "task"} and len(obs["task"]) == n
    assert tuple(obs["state"].shape) == (n, state_dim)
    for image in obs["images"].values():
        assert tuple(image.shape) == (n, 224, 224, 3) and _np(image).dtype == np.uint8
    for flag in (terminated, truncated):
        assert tuple(flag.shape) == (n,) and _np(flag).dtype == np.bool_
    assert tuple(rewards.shape) == (n,) and np.isfinite(_np(rewards)).all()
    assert all(isinstance(x, np.ndarray) for x in (rewards, terminated, truncated))
    assert tuple(infos["substep_mask"].shape) == (n, C) and tuple(infos["substep_rewards"].shape) == (n, C)
    assert np.allclose(_np(infos["substep_rewards"]).sum(1), _np(rewards), atol=1e-5)
    assert not _np(infos["substep_rewards"])[~_np(infos["substep_mask"])].any()  # frozen sub-steps: reward 0
    policy = infos["policy"]
    assert _np(infos["_policy"]).all()
    shapes = {
        "actions": (n, C, A),
        "log_prob": (n,),
        "log_prob_elements": (n, C, A),
        "values": (n,),
        "final_value": (n,),
        "chains": (n, K + 1, H, 32),
        "model_actions": (n, H, 32),
        "denoise_inds": (n, K),
    }
    for name, shape in shapes.items():
        assert isinstance(policy[name], torch.Tensor), name
        assert tuple(policy[name].shape) == shape, (name, tuple(policy[name].shape))
        assert torch.isfinite(policy[name].float()).all(), name
    assert torch.equal(policy["actions"], out.actions) and torch.equal(policy["log_prob"], out.log_prob)
    assert torch.allclose(policy["log_prob"], policy["log_prob_elements"].sum((1, 2)))
    assert torch.equal(policy["chains"][:, -1], policy["model_actions"])
    assert (policy["log_prob"] != 0).all()  # sde: one stochastic step per env
    assert (policy["values"] != 0).all()  # the tiny model has a value head
    assert out.header.action_chunk == C and out.header.action_dim == A and out.header.method == "sde"


def _check_episode_end(first: tuple, second: tuple, n: int, limit: int) -> None:
    """Chunk 2 ran `limit - C` sub-steps, truncated every env, reported the episode and reset the envs."""
    _, _, terminated1, truncated1, infos1 = first
    obs, _, terminated, truncated, infos = second
    assert _np(infos1["substep_mask"]).all() and not _np(terminated1 | truncated1).any()
    executed = limit - C
    mask = np.zeros((n, C), bool)
    mask[:, :executed] = True
    assert np.array_equal(_np(infos["substep_mask"]), mask)
    assert _np(truncated).all() and not _np(terminated).any()
    assert _np(infos["_final_obs"]).all() and _np(infos["_final_info"]).all()
    assert _np(infos["_episode"]).all() and np.array_equal(_np(infos["episode"]["l"]), np.full(n, limit))
    episode_return = _np(infos1["substep_rewards"]).sum(1) + _np(infos["substep_rewards"]).sum(1)
    assert np.allclose(_np(infos["episode"]["r"]), episode_return, atol=1e-4)
    # the returned observation is the reset one (SAME_STEP); the terminal one is in final_obs
    assert not np.allclose(_np(infos["final_obs"]["state"]), _np(obs["state"]))
    assert (infos["policy"]["final_value"] != 0).all()  # critic on the terminal observations


def _check_model_pixels(record: dict[str, Any], camera: str, slot: int) -> np.ndarray:
    """The pixels the model got for `slot` in chunk 1: (N, 3, 224, 224) uint8, equal to the adapter's image."""
    inputs = record["steps"][0][1].inputs
    expected = record["expected_inputs"]
    assert slot in inputs.slots
    assert inputs.images.dtype == torch.uint8 and tuple(inputs.images.shape[-3:]) == (3, 224, 224)
    assert torch.equal(inputs.images, expected.images)  # what policy.processor(obs) makes of the reset obs
    pixels = inputs.images[:, inputs.slots.index(slot)]
    # 224 -> 224 needs no resize: the model sees exactly the adapter's upright image, channel-first
    adapter = torch.as_tensor(_np(record["obs0"]["images"][camera])).permute(0, 3, 1, 2)
    assert torch.equal(pixels.cpu(), adapter)
    return pixels


def _hwc(pixels: torch.Tensor) -> torch.Tensor:
    return pixels.permute(1, 2, 0)


# ---------------------------------------------------------------------------------------------------------
# MuJoCo


@needs_mujoco
@pytest.mark.slow
def test_mujoco_pusher_end_to_end():
    policy = _policy(camera_map={"image": "base_0_rgb"}, prompt_format="text")
    limit = 8
    env = PolicyVectorEnv(make_mujoco_env("Pusher-v5", num_envs=2, max_episode_steps=limit), policy, action_chunk=C)
    try:
        record = _run(env, chunks=3)
        (first, out1), (second, _), (third, _) = record["steps"]
        for result, out in record["steps"]:
            _check_chunk(result, out, n=2, state_dim=23)
        _check_episode_end(first, second, n=2, limit=limit)
        assert _np(third[4]["substep_mask"]).all()  # the reset envs run a full chunk again
        assert "episode" not in third[4]
        # the actions reach the simulator: replaying chunk 1's actions reproduces its state exactly, and other
        # actions do not
        obs, _ = env.reset(seed=0)
        assert np.array_equal(obs["state"], record["obs0"]["state"])
        replay = env.step(out1.actions.clone())
        assert np.array_equal(replay[0]["state"], first[0]["state"])
        assert set(replay[4]["policy"]) == {"final_value"}  # explicit actions: no policy call
        env.reset(seed=0)
        other = env.step(-out1.actions)
        assert not np.allclose(other[0]["state"], first[0]["state"], atol=1e-3)
        assert not np.array_equal(first[0]["state"], record["obs0"]["state"])
        # same seed, same policy draws (C3)
        again = _run(env, chunks=1)
        assert torch.equal(again["steps"][0][1].actions, out1.actions)
    finally:
        env.close()


# ---------------------------------------------------------------------------------------------------------
# LIBERO: one 2-env vector env for the module


@pytest.fixture(scope="module")
def libero_env():
    policy = _policy(preset="rlinf_pi05_libero")
    assert dict(policy.processor.config.camera_map) == {"image": "base_0_rgb", "wrist_image": "left_wrist_0_rgb"}
    # hard_reset=False: later resets reuse the loaded model (seconds, not a rebuild); 3 settle no-ops instead
    # of 10 (each step renders both cameras in software)
    venv = make_libero_env("libero_spatial", num_envs=2, max_episode_steps=LIMIT, hard_reset=False, settle_steps=3)
    env = PolicyVectorEnv(venv, policy, action_chunk=C)
    yield env
    env.close()


@pytest.fixture(scope="module")
def libero_run(libero_env):
    return _run(libero_env, chunks=2)


@needs_libero
@pytest.mark.slow
def test_libero_end_to_end(libero_run):
    obs0 = libero_run["obs0"]
    assert set(obs0["images"]) == {"image", "wrist_image"}  # the preset's camera map matches the adapter
    assert obs0["task"][0] != obs0["task"][1]  # tasks 0 and 1 of the suite
    (first, out1), (second, out2) = libero_run["steps"]
    for result, out in libero_run["steps"]:
        _check_chunk(result, out, n=2, state_dim=8)
    assert out1.inputs.slots == (BASE, WRIST) and tuple(out1.inputs.images.shape) == (2, 2, 3, 224, 224)
    _check_episode_end(first, second, n=2, limit=LIMIT)
    assert list(second[4]["final_info"]["elapsed_steps"]) == [LIMIT, LIMIT]
    assert list(second[4]["elapsed_steps"]) == [0, 0]  # reset at the chunk boundary
    assert not second[4]["success"].any() and not second[4]["episode"]["success_once"].any()
    # the arm moved under the policy's actions (eef position, metres)
    moved = np.linalg.norm(first[0]["state"][:, :3] - obs0["state"][:, :3], axis=1)
    assert (moved > 5e-3).all(), moved
    # chunk 2 acted on chunk 1's observation
    assert not torch.equal(out2.inputs.images, out1.inputs.images)
    # the stored chunk-1 inputs were not overwritten by later steps (lossless storage for evaluate(), C5)
    assert torch.equal(out1.inputs.images, libero_run["expected_inputs"].images)


@needs_libero
@pytest.mark.slow
def test_libero_model_pixels_are_upright(libero_run):
    base = _check_model_pixels(libero_run, "image", BASE)
    wrist = _check_model_pixels(libero_run, "wrist_image", WRIST)
    for i in range(base.shape[0]):
        assert_libero_agentview_upright(_hwc(base[i]))
        assert_libero_wrist_upright(_hwc(wrist[i]))
    # and a flipped image fails the same check (the check can tell)
    with pytest.raises(AssertionError):
        assert_libero_agentview_upright(_hwc(base[0]).flip(0, 1))


@needs_libero
@pytest.mark.slow
def test_libero_actions_reach_the_simulator(libero_env, libero_run):
    """Replaying chunk 1's policy actions through step(actions) from the same seeded reset lands on the same
    state; the actions are what the simulator executed."""
    (first, out1), _ = libero_run["steps"]
    obs, _ = libero_env.reset(seed=0)
    assert np.allclose(obs["state"], libero_run["obs0"]["state"], atol=1e-4)
    replay = libero_env.step(out1.actions.clone())
    np.testing.assert_allclose(replay[0]["state"], first[0]["state"], rtol=0, atol=1e-6)  # exact here


# ---------------------------------------------------------------------------------------------------------
# ManiSkill3 (CPU simulator)


@pytest.fixture(scope="module")
def maniskill_env():
    policy = _policy(preset="rlinf_pi05_maniskill")
    assert dict(policy.processor.config.camera_map) == {"image": "base_0_rgb"}
    venv = make_maniskill_env("PickCube-v1", num_envs=1, sim_backend="cpu", max_episode_steps=LIMIT)
    env = PolicyVectorEnv(venv, policy, action_chunk=C)
    yield env
    env.close()


@needs_maniskill
@pytest.mark.slow
def test_maniskill_end_to_end_and_model_pixels_upright(maniskill_env):
    env = maniskill_env
    record = _run(env, chunks=2)
    (first, out1), (second, _) = record["steps"]
    for result, out in record["steps"]:
        _check_chunk(result, out, n=1, state_dim=19)  # qpos 9, tcp pose 7, hidden goal 3
    _check_episode_end(first, second, n=1, limit=LIMIT)
    assert int(second[4]["final_info"]["elapsed_steps"][0]) == LIMIT
    # model pixels: the wooden table at the bottom
    base = _check_model_pixels(record, "image", BASE)
    assert out1.inputs.slots == (BASE,)
    assert_maniskill_upright(_hwc(base[0]))
    with pytest.raises(AssertionError):
        assert_maniskill_upright(_hwc(base[0]).flip(0, 1))
    # the actions reach the simulator: a replay of chunk 1 reproduces its state
    obs, _ = env.reset(seed=0)
    assert np.allclose(obs["state"], record["obs0"]["state"], atol=1e-5)
    replay = env.step(out1.actions.clone())
    np.testing.assert_allclose(replay[0]["state"], first[0]["state"], rtol=0, atol=1e-6)  # exact here
    moved = np.linalg.norm(first[0]["state"][:, 9:12] - record["obs0"]["state"][:, 9:12], axis=1)  # tcp, metres
    assert (moved > 5e-3).all(), moved
