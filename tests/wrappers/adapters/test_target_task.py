"""The target task's episode ends: success and the step limit terminate, nothing truncates.

The elapsed fraction is in the state, so the limit is part of the task: a PPO loop that bootstraps truncations
must not add the critic's value of the end state to a failed episode's return.
"""

from __future__ import annotations

import numpy as np
import pytest

from wrappers.adapters.target_task import TargetEnv, make_target_env


def wrong_action(obs) -> np.ndarray:
    """The position of the other target (k=2: -0.5 and 0.5)."""
    return np.array([-obs["state"][0]], np.float32)


@pytest.mark.parametrize("episode_length", [1, 3])
def test_failure_terminates_at_the_limit_without_truncation(episode_length):
    env = TargetEnv(num_targets=2, episode_length=episode_length)
    obs, _ = env.reset(seed=0)
    ends = []
    for step in range(1, episode_length + 1):
        obs, reward, terminated, truncated, info = env.step(wrong_action(obs))
        ends.append((terminated, truncated, info["is_success"]))
        assert reward == pytest.approx(-0.1), step  # |(-t) - t| = 1 for t = +-0.5
        assert obs["state"][1] == pytest.approx(step / episode_length)
    assert ends == [(False, False, False)] * (episode_length - 1) + [(True, False, False)]


def test_success_terminates_at_once():
    env = TargetEnv(num_targets=2, episode_length=3)
    obs, _ = env.reset(seed=1)
    _, reward, terminated, truncated, info = env.step(obs["state"][:1].copy())
    assert (reward, terminated, truncated, info["is_success"]) == (1.0, True, False, True)


def test_vector_env_never_truncates():
    venv = make_target_env(num_envs=4, episode_length=2)
    obs, _ = venv.reset(seed=0)
    for _ in range(6):
        obs, _, terminated, truncated, _ = venv.step(-obs["state"][:, :1])
        assert not truncated.any()
    assert terminated.any()
    venv.close()
