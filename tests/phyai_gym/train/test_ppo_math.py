"""PPO math: the log-ratio granularities, the loss over (B, G) ratios, and the reward normaliser against Gymnasium."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium.wrappers.utils import RunningMeanStd

from phyai_gym.train.ppo_math import LOGPROB_REDUCTIONS, RewardNormalizer, group_advantages, log_ratio, ppo_loss


def test_granularities_group_the_element_log_ratios():
    gen = torch.Generator().manual_seed(0)
    new, old = torch.randn(4, 3, 2, generator=gen), torch.randn(4, 3, 2, generator=gen)
    d = new - old
    torch.testing.assert_close(log_ratio(new, old, "sum")[:, 0], d.sum(dim=(1, 2)))
    torch.testing.assert_close(log_ratio(new, old, "mean")[:, 0], d.mean(dim=(1, 2)))
    torch.testing.assert_close(log_ratio(new, old, "action"), d.sum(dim=2))
    torch.testing.assert_close(log_ratio(new, old, "element"), d.reshape(4, 6))
    with pytest.raises(ValueError, match="reduction must be one of"):
        log_ratio(new, old, "token")
    with pytest.raises(ValueError, match=r"\(B, C, A\)"):
        log_ratio(new.sum(dim=2), old.sum(dim=2), "sum")


def test_one_ratio_per_sample_is_the_loss_of_b_ratios():
    gen = torch.Generator().manual_seed(1)
    new, old, adv = torch.randn(8, generator=gen) * 0.3, torch.zeros(8), torch.randn(8, generator=gen)
    zeros, ones = torch.zeros(8), torch.ones(8)
    flat = ppo_loss(new, zeros, zeros, old, zeros, adv, ones, clip_coef=0.2)
    grouped = ppo_loss(new[:, None], zeros, zeros, old[:, None], zeros, adv, ones, clip_coef=0.2)
    for key in flat:
        torch.testing.assert_close(flat[key], grouped[key])
    assert set(LOGPROB_REDUCTIONS) == {"sum", "action", "element", "mean"}


def test_reward_normalizer_matches_gymnasium_running_moments():
    rng = np.random.default_rng(0)
    norm, rms, gamma = RewardNormalizer(3, gamma=0.9), RunningMeanStd(shape=()), 0.9
    returns = np.zeros(3)
    for _ in range(20):
        reward, done = rng.normal(-3.0, 2.0, size=3), (rng.random(3) < 0.2).astype(np.float64)
        scaled = norm(torch.tensor(reward, dtype=torch.float32), torch.tensor(done, dtype=torch.float32))
        returns = returns * gamma + reward
        rms.update(returns)
        returns *= 1.0 - done
        np.testing.assert_allclose(scaled.numpy(), reward / np.sqrt(rms.var + 1e-8), rtol=1e-5)
    restored = RewardNormalizer(3, gamma=0.9)
    restored.load_state_dict(norm.state_dict())
    step = (torch.ones(3), torch.zeros(3))
    assert torch.equal(restored(*step), norm(*step))


def test_group_advantages_centre_each_group_share_it_over_the_episode_and_sum_to_zero():
    outcomes = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 0.0, 1.0, 1.0])  # G = 4: 3 groups
    first = torch.ones(3, 12)
    first[2:, 0] = 0.0  # env 0's first episode ended at chunk 1 (2 chunks); the others ran all 3
    adv = group_advantages(outcomes, first, 4)
    group = torch.tensor([1.0, 0.0, 0.0, 0.0])
    per_episode = (group - 0.25) / group.std()
    torch.testing.assert_close(adv[:2, 0], per_episode[:1].expand(2) / 2)  # shared by its 2 chunks
    assert adv[2, 0] == 0.0  # after the first episode: no advantage
    torch.testing.assert_close(adv[:, 1:4], per_episode[1:].expand(3, 3) / 3)
    torch.testing.assert_close(adv[:, :4].sum(), torch.tensor(0.0))  # failures do not outweigh the short success
    assert torch.equal(adv[:, 4:8], torch.zeros(3, 4))  # all alike: no gradient (not 0 / 0)
    torch.testing.assert_close(adv[:, 8:].sum(), torch.tensor(0.0))
    assert adv[0, 8] > adv[0, 10] > adv[0, 9]
    with pytest.raises(RuntimeError):
        group_advantages(outcomes, first, 5)  # N not a multiple of G (the example refuses it first)
