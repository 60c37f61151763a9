from __future__ import annotations

import functools
import os

import gymnasium as gym
import numpy as np
import pytest

from policies.baseline import GaussianPolicy
from wrappers.adapters.mujoco import MujocoCanonicalObservation, make_mujoco_env
from wrappers.frame_recorder import FrameRecorder
from wrappers.freeze import READ_EVERY_KEY, THAW_OPTION, make_freezable_vector_env, set_read_every, start_freezing
from wrappers.policy_vector_env import PolicyVectorEnv

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco is imported (Mesa renders it on CPU)
pytest.importorskip("mujoco")


@pytest.mark.slow
def test_pusher_canonical_observation_and_determinism():
    env = make_mujoco_env("Pusher-v5", num_envs=2, image_size=32)
    obs, _ = env.reset(seed=3)
    assert obs["images"]["image"].shape == (2, 32, 32, 3) and obs["images"]["image"].dtype == np.uint8
    assert obs["state"].shape == (2, 23) and obs["state"].dtype == np.float32
    assert obs["task"] == ("push the puck to the goal",) * 2
    assert env.single_action_space.shape == (7,)
    again = make_mujoco_env("Pusher-v5", num_envs=2, image_size=32)
    obs2, _ = again.reset(seed=3)
    np.testing.assert_array_equal(obs["state"], obs2["state"])
    np.testing.assert_array_equal(obs["images"]["image"], obs2["images"]["image"])
    env.close(), again.close()


@pytest.mark.slow
def test_shadow_size_sets_the_shadow_map_before_the_first_render():
    """A smaller shadow map renders nearly the same frame (the context reads it once, at the first render)."""
    default = make_mujoco_env("Pusher-v5", num_envs=1, image_size=64)
    small = make_mujoco_env("Pusher-v5", num_envs=1, image_size=64, shadow_size=1024)
    try:
        assert small.envs[0].unwrapped.model.vis.quality.shadowsize == 1024
        assert default.envs[0].unwrapped.model.vis.quality.shadowsize == 4096
        a = default.reset(seed=0)[0]["images"]["image"].astype(int)
        b = small.reset(seed=0)[0]["images"]["image"].astype(int)
        assert a.shape == b.shape and (np.abs(a - b) > 8).mean() < 0.01
    finally:
        default.close()
        small.close()


def test_pusher_through_policy_vector_env_with_truncation():
    env = make_mujoco_env("Pusher-v5", num_envs=2, image_size=32, max_episode_steps=5)
    wrapper = PolicyVectorEnv(env, GaussianPolicy(7, action_horizon=4, std=0.1), action_chunk=4)
    obs, _ = wrapper.reset(seed=0)
    _, rewards, terms, truncs, info = wrapper.step()
    assert not truncs.any() and info["substep_mask"].all()
    obs, rewards, terms, truncs, info = wrapper.step()
    assert truncs.all() and not terms.any()
    assert info["substep_mask"].sum(1).tolist() == [1, 1]
    assert info["episode"]["l"].tolist() == [5, 5]
    assert info["final_obs"]["images"]["image"].shape == (2, 32, 32, 3)
    assert wrapper.observation_space["images"]["image"].shape == (2, 32, 32, 3)
    wrapper.close()


# -- render on demand (wrappers.freeze "Reading schedule") ---------------------------------------------------

CHUNK = 4
LIMITS = (3, 4, 6)
"""Episode limits per sub-env: one ends mid-chunk, one on the chunk's last sub-step, one mid the next chunk."""


def _pusher(limit: int) -> MujocoCanonicalObservation:
    env = gym.make("Pusher-v5", render_mode="rgb_array", width=32, height=32, max_episode_steps=limit)
    return MujocoCanonicalObservation(env, task="push")


def _pusher_envs(vectorization: str, autoreset_mode: str):
    fns = [functools.partial(_pusher, limit) for limit in LIMITS]
    return make_freezable_vector_env(fns, vectorization=vectorization, autoreset_mode=autoreset_mode)


def _read_observations(vectorization: str, autoreset_mode: str, every_step: bool, steps: int = 4) -> list:
    """Everything the policy reads: reset obs, then per step the obs, final_obs and their masks."""
    env = _pusher_envs(vectorization, autoreset_mode)
    wrapper = PolicyVectorEnv(env, GaussianPolicy(7, action_horizon=CHUNK, std=0.5), action_chunk=CHUNK)
    if every_step:
        assert set_read_every(env, 1)  # what an env without on-demand rendering does
    obs, _ = wrapper.reset(seed=0)
    read = [obs]
    for _ in range(steps):
        obs, _, terms, truncs, info = wrapper.step()
        read += [obs, info["final_obs"], info["_final_obs"], terms | truncs]
    wrapper.close()
    return read


def _assert_trees_equal(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_trees_equal(a[key], b[key])
    else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("vectorization", "autoreset_mode"), [("sync", "SameStep"), ("sync", "NextStep"), ("async", "SameStep")]
)
def test_on_demand_rendering_reads_what_rendering_every_step_reads(vectorization, autoreset_mode):
    reference = _read_observations(vectorization, autoreset_mode, every_step=True)
    on_demand = _read_observations(vectorization, autoreset_mode, every_step=False)
    ends = np.stack([d for d in reference[4::4]])
    assert ends.any(0).all() and (ends.sum(0) >= 2).any()  # every sub-env ended, some twice (mid-chunk too)
    assert len(reference) == len(on_demand)
    for expected, got in zip(reference, on_demand):
        _assert_trees_equal(expected, got)


@pytest.mark.slow
def test_on_demand_rendering_leaves_unread_frames_stale():
    env = _pusher_envs("sync", "SameStep")
    start_freezing(env)
    assert env.metadata[READ_EVERY_KEY] and set_read_every(env, 3)
    obs, _ = env.reset(seed=0, options={THAW_OPTION: True})
    actions = np.full((3, 7), 0.5, np.float32)
    images = [obs["images"]["image"]] + [env.step(actions)[0]["images"]["image"] for _ in range(3)]
    # sub-env 1 (limit 4) and 2 (limit 6) render at the reset and the 3rd step only; 0 (limit 3) ends at the 3rd
    np.testing.assert_array_equal(images[1][1:], images[0][1:])
    np.testing.assert_array_equal(images[2][1:], images[0][1:])
    assert (images[3] != images[0]).any(axis=(1, 2, 3)).all()
    env.close()


@pytest.mark.slow
def test_frame_recorder_under_policy_vector_env_gets_every_frame():
    env = _pusher_envs("sync", "SameStep")
    recorder = FrameRecorder(env)
    wrapper = PolicyVectorEnv(recorder, GaussianPolicy(7, action_horizon=CHUNK, std=0.5), action_chunk=CHUNK)
    recorder.arm(2, "clip")
    wrapper.reset(seed=0)
    actions = np.concatenate([wrapper.step()[4]["policy"]["actions"] for _ in range(2)], axis=1)
    frames = recorder.take("clip")
    wrapper.close()
    # the same actions on a plain vector env, which renders every step (NEXT_STEP: the terminal obs is the obs)
    plain = _pusher_envs("sync", "NextStep")
    obs, _ = plain.reset(seed=0)
    expected = [obs["images"]["image"][2]]
    for k in range(LIMITS[2]):
        expected.append(plain.step(np.asarray(actions[:, k]))[0]["images"]["image"][2])
    plain.close()
    assert len(frames) == len(expected) == 1 + LIMITS[2]
    for got, want in zip(frames, expected):
        np.testing.assert_array_equal(got, want)


def test_rendering_from_another_thread_is_refused_not_stale():
    """An in-process MuJoCo env renders through an OpenGL context bound to one thread; elsewhere frames go stale."""
    import threading

    env = make_mujoco_env("Pusher-v5", num_envs=1, image_size=16)
    env.reset(seed=0)
    errors = []

    def step() -> None:
        try:
            env.step(np.zeros((1, 7), np.float32))
        except RuntimeError as error:
            errors.append(str(error))

    worker = threading.Thread(target=step)
    worker.start()
    worker.join()
    env.close()
    assert len(errors) == 1 and "vectorization='async'" in errors[0]
