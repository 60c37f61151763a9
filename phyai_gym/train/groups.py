"""Group-relative rollouts (GRPO's setting): G envs start from one state, each env's first episode is its outcome.

Both PPO examples take ``--group-size G``: every rollout begins with a reset whose env seeds repeat G times
(`grouped_reset_seeds`) while every env keeps its own noise stream, and `FirstEpisodes` records, step by step, which
chunks acted in their env's first episode and that episode's return; `ppo_math.group_advantages` turns the two into
advantages (docs/rl.md section 5).
"""

from __future__ import annotations

import numpy as np
import torch

from phyai_gym.train.ppo_math import group_advantages


def check_group_size(group_size: int, num_envs: int) -> None:
    """Refuse a `--group-size` that does not split a process's `num_envs` into whole groups (1: no groups)."""
    if group_size < 1 or num_envs % group_size:
        raise ValueError(f"--group-size: expected G >= 1 dividing --num-envs {num_envs}, got {group_size!r}. Fix: pass "
                         "e.g. --group-size 8 with --num-envs 64.")  # fmt: skip


def grouped_reset_seeds(first_seed: int, num_envs: int, group_size: int, env_offset: int = 0) -> dict:
    """`PolicyVectorEnv.reset` keywords for a group-relative rollout of this process's `num_envs` envs.

    Env i of the whole run (``env_offset + i``, counting every process's envs) gets the env seed ``first_seed +
    (env_offset + i) // group_size``, shared by its group, and the noise stream ``first_seed + env_offset + i``, its
    own. Groups never straddle processes as long as `env_offset` and `num_envs` are multiples of `group_size`.

    Example:
        >>> grouped_reset_seeds(7, num_envs=4, group_size=2)
        {'seed': [7, 7, 8, 8], 'options': {'stream_seeds': [7, 8, 9, 10]}}
    """
    envs = env_offset + np.arange(num_envs)
    return {
        "seed": (first_seed + envs // group_size).tolist(),
        "options": {"stream_seeds": (first_seed + envs).tolist()},
    }


class FirstEpisodes:
    """Which chunks of a (T, N) rollout acted in their env's first episode, and that episode's return.

    Example:
        >>> first = FirstEpisodes(num_steps=2, num_envs=2)
        >>> first.record(0, ended=np.array([True, False]), episode_returns=np.array([1.0, 0.0]))
        >>> first.record(1, ended=np.array([True, True]), episode_returns=np.array([0.0, 0.0]))
        >>> first.outcomes.tolist(), first.mask.tolist(), first.signal(group_size=2)
        ([1.0, 0.0], [[1.0, 1.0], [0.0, 1.0]], 1.0)
    """

    def __init__(self, num_steps: int, num_envs: int) -> None:
        self.mask = np.ones((num_steps, num_envs), dtype=np.float32)
        """(T, N) 1.0 where the chunk acted in its env's first episode (every env's first chunk does)"""
        self.outcomes = np.full(num_envs, np.nan)
        """(N,) each env's first-episode return; NaN while that episode runs"""

    def record(self, step: int, ended: np.ndarray, episode_returns: np.ndarray) -> None:
        """Chunk `step` ended the episodes where `ended`, with `episode_returns` (both (N,), host arrays)."""
        first = ended & np.isnan(self.outcomes)
        self.outcomes[first] = episode_returns[first]
        self.mask[step + 1 :, first] = 0.0

    def advantages(self, group_size: int, device: torch.device, env_steps: int) -> torch.Tensor:
        """(T, N) `ppo_math.group_advantages`; refused while an env's first episode has not ended.

        `env_steps` (T x C) only names the rollout's length in the message.
        """
        unfinished = int(np.isnan(self.outcomes).sum())
        if unfinished:
            raise ValueError(
                f"--group-size: {unfinished} env(s) did not finish an episode in T x C = {env_steps} env steps, so "
                "their outcome is unknown. Fix: raise --num-steps until T x C covers the env's episode limit."
            )
        outcomes = torch.as_tensor(self.outcomes, dtype=torch.float32, device=device)
        return group_advantages(outcomes, torch.as_tensor(self.mask, device=device), group_size)

    def signal(self, group_size: int) -> float:
        """The share of groups whose envs' outcomes differ (the others give no gradient)."""
        return float(np.ptp(self.outcomes.reshape(-1, group_size), axis=1).astype(bool).mean())
