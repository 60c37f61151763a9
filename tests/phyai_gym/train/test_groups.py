"""phyai_gym.train.groups: grouped reset seeds across processes; first-episode bookkeeping of a rollout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phyai_gym.train.groups import FirstEpisodes, grouped_reset_seeds


def test_two_processes_seed_what_one_process_of_their_envs_seeds():
    whole = grouped_reset_seeds(5, num_envs=8, group_size=4)
    parts = [grouped_reset_seeds(5, num_envs=4, group_size=4, env_offset=k * 4) for k in range(2)]
    assert whole["seed"] == parts[0]["seed"] + parts[1]["seed"] == [5, 5, 5, 5, 6, 6, 6, 6]
    streams = parts[0]["options"]["stream_seeds"] + parts[1]["options"]["stream_seeds"]
    assert streams == whole["options"]["stream_seeds"] == list(range(5, 13))  # every env its own noise


def test_only_the_first_episode_counts_and_an_unfinished_one_is_refused():
    first = FirstEpisodes(num_steps=3, num_envs=2)
    first.record(0, ended=np.array([True, False]), episode_returns=np.array([1.0, 9.0]))
    first.record(1, ended=np.array([True, False]), episode_returns=np.array([0.0, 9.0]))  # env 0's second episode
    with pytest.raises(ValueError, match=r"1 env\(s\) did not finish an episode in T x C = 15 env steps"):
        first.advantages(2, torch.device("cpu"), env_steps=15)
    first.record(2, ended=np.array([False, True]), episode_returns=np.array([0.0, 0.0]))
    assert first.outcomes.tolist() == [1.0, 0.0] and first.signal(2) == 1.0
    advantages = first.advantages(2, torch.device("cpu"), env_steps=15)
    assert advantages[:, 0].tolist() == pytest.approx([0.7071, 0.0, 0.0], abs=1e-4)  # one chunk, then 0
    assert advantages.sum().item() == pytest.approx(0.0, abs=1e-6)  # env 1's -0.7071 over its 3 chunks
