from __future__ import annotations

import numpy as np
import pytest

from policies.baseline import GaussianPolicy
from wrappers.adapters.mujoco import make_mujoco_env
from wrappers.policy_vector_env import PolicyVectorEnv

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
