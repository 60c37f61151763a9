from __future__ import annotations

import numpy as np
import torch

from policies.baseline import ConstantPolicy
from wrappers.adapters.scripted import make_scripted_env
from wrappers.episode_statistics import EpisodeStatistics
from wrappers.policy_vector_env import PolicyVectorEnv


def test_masked_updates_and_reset():
    stats = EpisodeStatistics(3)
    done = torch.tensor([False, True, False])
    out = stats.update(
        torch.ones(3),
        torch.tensor([2, 2, 2]),
        done,
        torch.tensor([True, False, True]),
        torch.tensor([True, False, False]),
    )
    assert out["r"].tolist() == [0.0, 1.0, 0.0] and out["l"].tolist() == [0, 2, 0]
    assert stats.lengths.tolist() == [2, 0, 2] and stats.success_once.tolist() == [True, False, True]
    out = stats.update(torch.ones(3), torch.tensor([1, 1, 1]), torch.tensor([True, True, True]))
    assert out["r"].tolist() == [2.0, 1.0, 2.0] and out["l"].tolist() == [3, 1, 3]
    assert out["success_once"].tolist() == [True, False, True]
    assert out["success_at_end"].tolist() == [False, False, False]
    assert int(stats.episodes) == 4


def test_wrapper_reports_return_length_and_success_flags():
    # env 0: success only at step 1 of a 3-step episode; env 1: success at its last step
    env = make_scripted_env(2, episode_lengths=[(3,), (6,)], success_steps=(1, 6))
    wrapper = PolicyVectorEnv(env, ConstantPolicy([0.0, 0.0, 0.0], action_horizon=4), action_chunk=4)
    wrapper.reset(seed=0)
    _, rewards, terms, _, info = wrapper.step()
    assert info["_episode"].tolist() == [True, False]
    assert info["episode"]["r"][0] == 3.0 and info["episode"]["l"][0] == 3
    assert info["episode"]["success_once"].tolist() == [True, False]
    assert info["episode"]["success_at_end"].tolist() == [False, False]
    _, _, _, _, info = wrapper.step()
    assert info["_episode"].tolist() == [True, True]
    assert info["episode"]["l"].tolist() == [3, 6]
    assert info["episode"]["success_at_end"].tolist() == [False, True]
    assert isinstance(info["episode"]["r"], np.ndarray)
    wrapper.close()
