"""examples/ppo_pi05.py --group-size: group-relative advantages from envs that start from one state."""

from __future__ import annotations

import math

import pytest

from examples import ppo_pi05 as ppo

TINY = dict(num_envs=4, num_steps=2, eval_episodes=0, quiet=True, csv=None)


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    monkeypatch.setattr("phyai_gym.train.curves.plot_curves", lambda *args, **kwargs: None)


def test_every_rollout_starts_groups_from_one_state_with_their_own_noise(monkeypatch):
    resets, real = [], ppo.PolicyVectorEnv.reset

    def spy(self, **kwargs):
        resets.append(kwargs)
        return real(self, **kwargs)

    monkeypatch.setattr(ppo.PolicyVectorEnv, "reset", spy)
    curve = ppo.train(ppo.Args(total_iterations=2, group_size=2, seed=7, **TINY))["curve"]
    assert [r["seed"] for r in resets] == [[7, 7, 8, 8], [11, 11, 12, 12]]  # a new state per group and iteration
    assert [r["options"]["stream_seeds"] for r in resets] == [[7, 8, 9, 10], [11, 12, 13, 14]]
    assert all(0.0 <= row["group_signal"] <= 1.0 for row in curve)
    plain = ppo.train(ppo.Args(total_iterations=1, **TINY))["curve"]
    assert math.isnan(plain[0]["group_signal"])


def test_group_size_must_divide_the_envs_and_the_rollout_must_cover_an_episode():
    with pytest.raises(ValueError, match=r"--group-size: expected G >= 1 dividing --num-envs 4, got 3"):
        ppo.Args(group_size=3, **TINY)
    with pytest.raises(ValueError, match=r"did not finish an episode in T x C = 2 env steps.*--num-steps"):
        ppo.train(ppo.Args(total_iterations=1, group_size=2, episode_length=3, **TINY))
