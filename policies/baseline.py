"""Baseline policies implementing `policies.base.Policy` without a model (and without Gymnasium).

`GaussianPolicy` draws i.i.d. Gaussian actions from the per-env counter-based streams of `policies.rng`,
so env i's actions depend only on (seed_i, counter_i) -- not on batch composition, splitting or grouping.
`ConstantPolicy` returns one fixed action. Both report values of 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from policies.base import PolicyOutput, RolloutConfig
from policies.checks import seed_tensor
from policies.rng import STREAM_AUX, StreamTable, explicit_counters, normal

IdsLike = Sequence[int] | torch.Tensor | None


def batch_size(obs: Mapping[str, Any]) -> int:
    """N of a canonical observation (from ``state``, else from ``task``)."""
    if "state" in obs:
        return int(obs["state"].shape[0])
    return len(obs["task"])


def resolve_chunk(where: str, action_chunk: int | None, horizon: int) -> int:
    """The chunk C a call returns: `action_chunk`, default the horizon; outside [1, horizon] is refused."""
    chunk = horizon if action_chunk is None else int(action_chunk)
    if not 1 <= chunk <= horizon:
        raise ValueError(f"{where}: action_chunk must be in [1, action_horizon={horizon}], got {chunk}.")
    return chunk


def _ids(ids: IdsLike, n: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(env ids as an int64 tensor, an upper bound of the ids + 1)."""
    if ids is None:
        return torch.arange(n, device=device), n
    if isinstance(ids, torch.Tensor):
        ids = ids.to(device=device, dtype=torch.int64)
        return ids, int(ids.max()) + 1 if ids.numel() else 0
    ids_list = [int(i) for i in ids]
    return torch.tensor(ids_list, dtype=torch.int64, device=device), (max(ids_list) + 1 if ids_list else 0)


class GaussianPolicy:
    """Actions ``mean + std * z`` with z ~ N(0, I) from env i's counter-based stream (DESIGN C3).

    Args:
        action_dim: A, env action dims.
        action_horizon: the largest chunk C a call may return (noise is drawn for the full horizon and
            cropped, so a call's first C actions do not depend on C).
        mean: scalar or (A,) mean.
        std: scalar or (A,) standard deviation (> 0).
        device: where outputs live.

    Example:
        >>> import numpy as np
        >>> policy = GaussianPolicy(action_dim=2, action_horizon=4, std=0.5)
        >>> obs = {"state": np.zeros((3, 5), np.float32), "task": ["a", "b", "c"]}
        >>> out = policy.act(obs, seeds=[7, 8, 9], action_chunk=2)
        >>> tuple(out.actions.shape), tuple(out.log_prob.shape)
        ((3, 2, 2), (3,))
        >>> again = GaussianPolicy(action_dim=2, action_horizon=4, std=0.5)
        >>> one = again.act({"state": np.zeros((1, 5), np.float32)}, seeds=[8], action_chunk=2)
        >>> bool(torch.equal(out.actions[1], one.actions[0]))
        True
    """

    def __init__(
        self,
        action_dim: int,
        action_horizon: int = 8,
        mean: float | Sequence[float] | torch.Tensor = 0.0,
        std: float | Sequence[float] | torch.Tensor = 1.0,
        device: str | torch.device = "cpu",
    ) -> None:
        if action_dim <= 0 or action_horizon <= 0:
            raise ValueError(
                f"GaussianPolicy: action_dim and action_horizon must be positive, got "
                f"action_dim={action_dim}, action_horizon={action_horizon}."
            )
        self.device = torch.device(device)
        self.action_dim = int(action_dim)
        self.action_horizon = int(action_horizon)
        as_vector = lambda x: torch.broadcast_to(torch.as_tensor(x, dtype=torch.float32), (action_dim,))
        self.mean = as_vector(mean).to(self.device).clone()
        self.std = as_vector(std).to(self.device).clone()
        if bool((self.std <= 0).any()):
            raise ValueError(f"GaussianPolicy: std must be > 0, got {self.std.tolist()}.")
        self.streams = StreamTable(self.device)
        self.weight_version = 0

    def act(
        self,
        obs: Mapping[str, Any],
        *,
        deterministic: bool = False,
        seeds: Sequence[int] | torch.Tensor | None = None,
        env_ids: Sequence[int] | torch.Tensor | None = None,
        action_chunk: int | None = None,
        counters: torch.Tensor | None = None,
    ) -> PolicyOutput:
        """(N, C, A) Gaussian actions; log-probs of the drawn actions (0 when deterministic).

        With `counters` the call draws from them and leaves the stream table as it is (`StreamPolicy`).
        """
        n, chunk = batch_size(obs), resolve_chunk("GaussianPolicy.act", action_chunk, self.action_horizon)
        ids, upper = _ids(env_ids, n, self.device)
        if counters is not None:
            explicit = explicit_counters("GaussianPolicy.act", counters, n, self.device, seeds)
            stream_seeds = self.streams.take(ids, upper=upper, advance=False)[0]
            return self._draw(n, chunk, deterministic, stream_seeds, explicit)
        if seeds is not None:
            seed_t = seed_tensor(seeds, n, "GaussianPolicy.act: seeds")  # an int s gives env row i seed s + i
            self.streams.set_seeds(ids, seed_t.to(self.device), upper=upper)
        stream_seeds, drawn = self.streams.take(ids, upper=upper)
        return self._draw(n, chunk, deterministic, stream_seeds, drawn)

    def _draw(
        self, n: int, chunk: int, deterministic: bool, stream_seeds: torch.Tensor, counters: torch.Tensor
    ) -> PolicyOutput:
        shape = (n, chunk, self.action_dim)
        if deterministic:
            z = torch.zeros(shape, device=self.device)
            log_prob_elements = torch.zeros(shape, device=self.device)
        else:
            z = normal(stream_seeds, counters, STREAM_AUX, (self.action_horizon, self.action_dim))[:, :chunk]
            log_prob_elements = -0.5 * z.square() - torch.log(self.std) - 0.5 * math.log(2.0 * math.pi)
        actions = self.mean + self.std * z
        header = RolloutConfig(
            method="ode" if deterministic else "noise",
            action_chunk=chunk,
            action_dim=self.action_dim,
            value_source="none",
            weight_version=self.weight_version,
        )
        return PolicyOutput(
            actions=actions,
            log_prob=log_prob_elements.sum(dim=(1, 2)),
            log_prob_elements=log_prob_elements,
            values=torch.zeros(n, device=self.device),
            header=header,
        )

    def value(self, obs: Mapping[str, Any], *, env_ids: IdsLike = None) -> torch.Tensor:
        """(N,) zeros: the baseline has no critic."""
        return torch.zeros(batch_size(obs), device=self.device)

    def stream_state(self, env_ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the (seeds, counters) of `env_ids`."""
        ids, upper = _ids(env_ids, len(env_ids), self.device)
        seeds, counters = self.streams.take(ids, upper=upper, advance=False)
        return seeds.clone(), counters.clone()

    def advance_streams(self, env_ids: Sequence[int] | torch.Tensor, counters: torch.Tensor) -> None:
        """Records a call made with `counters` (see `StreamPolicy`)."""
        ids, upper = _ids(env_ids, len(env_ids), self.device)
        explicit = explicit_counters("GaussianPolicy.advance_streams", counters, len(ids), self.device)
        self.streams.advance(ids, explicit, upper)

    def sync_weights(self, source: Mapping[str, Any]) -> dict[str, Any]:
        """Loads ``{"mean": (A,), "std": (A,)}`` (either optional); returns a small report."""
        unknown = set(source) - {"mean", "std"}
        if unknown:
            raise KeyError(
                f"GaussianPolicy.sync_weights: unknown names {sorted(unknown)}; expected 'mean' and/or 'std'."
            )
        for name in ("mean", "std"):
            if name in source:
                value = torch.as_tensor(source[name], dtype=torch.float32, device=self.device)
                getattr(self, name).copy_(torch.broadcast_to(value, (self.action_dim,)))
        self.weight_version += 1
        return {"version": self.weight_version, "names": sorted(source)}


class ConstantPolicy:
    """Returns the same action at every step (log-probs and values 0).

    Args:
        action: (A,) the action.
        action_horizon: the largest chunk C a call may return.
        device: where outputs live.

    Example:
        >>> policy = ConstantPolicy([0.0, 1.0], action_horizon=2)
        >>> policy.act({"task": ["x"]}).actions.tolist()
        [[[0.0, 1.0], [0.0, 1.0]]]
    """

    def __init__(
        self,
        action: Sequence[float] | torch.Tensor,
        action_horizon: int = 8,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.action = torch.as_tensor(action, dtype=torch.float32, device=self.device).reshape(-1)
        self.action_dim = int(self.action.shape[0])
        self.action_horizon = int(action_horizon)
        self.weight_version = 0

    def act(
        self,
        obs: Mapping[str, Any],
        *,
        deterministic: bool = False,
        seeds: Sequence[int] | torch.Tensor | None = None,
        env_ids: Sequence[int] | torch.Tensor | None = None,
        action_chunk: int | None = None,
    ) -> PolicyOutput:
        """(N, C, A) copies of the constant action."""
        n = batch_size(obs)
        chunk = resolve_chunk("ConstantPolicy.act", action_chunk, self.action_horizon)
        actions = self.action.expand(n, chunk, self.action_dim).clone()
        zeros = torch.zeros_like(actions)
        return PolicyOutput(
            actions=actions,
            log_prob=zeros.sum(dim=(1, 2)),
            log_prob_elements=zeros,
            values=torch.zeros(n, device=self.device),
            header=RolloutConfig(method="ode", action_chunk=chunk, action_dim=self.action_dim, value_source="none"),
        )

    def value(self, obs: Mapping[str, Any], *, env_ids: IdsLike = None) -> torch.Tensor:
        """(N,) zeros."""
        return torch.zeros(batch_size(obs), device=self.device)
