"""Episode statistics kept on the device, updated with masks (cleanrl's RecordEpisodeStatisticsTorch).

`PolicyVectorEnv` owns one `EpisodeStatistics` (on by default) and reports finished episodes the
Gymnasium way: ``infos["episode"] = {"r", "l", "success_once", "success_at_end"}`` with
``infos["_episode"]`` marking the envs whose episode ended in this step.
Lengths count env steps (executed sub-steps), not chunks.
"""

from __future__ import annotations

import torch


class EpisodeStatistics:
    """Running return, length and success flags per env, as tensors on one device.

    Args:
        num_envs: N.
        device: where the statistics live (the env's device; CPU for numpy envs).

    Example:
        >>> stats = EpisodeStatistics(2)
        >>> stats.reset()
        >>> _ = stats.update(torch.tensor([1.0, 2.0]), torch.tensor([4, 4]), torch.tensor([False, False]))
        >>> flags = dict(success_any=torch.tensor([True, False]), success_end=torch.tensor([False, False]))
        >>> done = torch.tensor([True, False])
        >>> out = stats.update(torch.tensor([1.0, 1.0]), torch.tensor([2, 4]), done, **flags)
        >>> out["r"].tolist(), out["l"].tolist(), out["success_once"].tolist()
        ([2.0, 0.0], [6, 0], [True, False])
        >>> stats.returns.tolist(), stats.lengths.tolist()
        ([0.0, 3.0], [0, 8])
    """

    def __init__(self, num_envs: int, device: str | torch.device = "cpu") -> None:
        self.num_envs = int(num_envs)
        self.device = torch.device(device)
        self.returns = torch.zeros(self.num_envs, dtype=torch.float64, device=self.device)
        self.lengths = torch.zeros(self.num_envs, dtype=torch.int64, device=self.device)
        self.success_once = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        self.episodes = torch.zeros((), dtype=torch.int64, device=self.device)
        """Number of finished episodes since construction."""

    def to(self, device: str | torch.device) -> EpisodeStatistics:
        """Moves the statistics to `device` (in place); returns self."""
        self.device = torch.device(device)
        for name in ("returns", "lengths", "success_once", "episodes"):
            setattr(self, name, getattr(self, name).to(self.device))
        return self

    def reset(self, mask: torch.Tensor | None = None) -> None:
        """Zeroes the statistics of the envs in `mask` (all when None)."""
        if mask is None:
            self.returns.zero_()
            self.lengths.zero_()
            self.success_once.zero_()
            return
        keep = ~mask.to(self.device)
        self.returns.mul_(keep)
        self.lengths.mul_(keep)
        self.success_once.logical_and_(keep)

    def update(
        self,
        rewards: torch.Tensor,
        steps: torch.Tensor,
        done: torch.Tensor,
        success_any: torch.Tensor | None = None,
        success_end: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Accumulates one vector step and returns the statistics of the episodes that ended in it.

        Args:
            rewards: (N,) reward of the step (summed over executed sub-steps).
            steps: (N,) env steps executed in the step.
            done: (N,) bool, episodes that ended in the step (their statistics restart at 0 afterwards).
            success_any: (N,) bool, success at any executed sub-step (None = no success signal).
            success_end: (N,) bool, success at the last executed sub-step.

        Returns:
            ``{"r", "l", "success_once", "success_at_end"}``: (N,) tensors, zero/False where `done` is False.
        """
        done = done.to(self.device)
        self.returns += rewards.to(self.device, torch.float64)
        self.lengths += steps.to(self.device, torch.int64)
        if success_any is not None:
            self.success_once |= success_any.to(self.device)
        at_end = torch.zeros_like(done) if success_end is None else success_end.to(self.device, torch.bool)
        out = {
            "r": torch.where(done, self.returns, 0.0),
            "l": torch.where(done, self.lengths, 0),
            "success_once": self.success_once & done,
            "success_at_end": at_end & done,
        }
        self.episodes += done.sum()
        self.reset(done)
        return out
