"""The Policy protocol shared by PI0.5 and the baseline policies, and what one policy call returns.

A canonical observation (DESIGN C1) is a mapping with
  - ``"images"``: dict camera name -> uint8 array/tensor (N, H, W, 3), upright;
  - ``"state"``: float array/tensor (N, S) in simulator units;
  - ``"task"``: a sequence of N strings.
Arrays may be numpy or torch tensors on any device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class RolloutHeader:
    """Settings a rollout batch was produced with; `evaluate()` refuses a batch whose header disagrees.

    Attributes:
        weight_version: policy weight version at the time of the call (increases with every weight commit).
        method: "ode", "sde" or "noise".
        num_steps: K, the number of denoise steps.
        noise_level: a, the SDE noise level.
        action_chunk: C, env steps executed per call.
        action_dim: A, env action dims.
        value_source: "prefix", "suffix" or "none".
        joint: whether every denoise step is stochastic with a joint log-prob.
    """

    weight_version: int = 0
    method: str = "ode"
    num_steps: int = 0
    noise_level: float = 0.0
    action_chunk: int = 0
    action_dim: int = 0
    value_source: str = "none"
    joint: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the header fields."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class PolicyOutput:
    """What one `act()` call returns, per environment (all tensors on the policy's device).

    Attributes:
        actions: (N, C, A) float32 env-space actions.
        log_prob: (N,) float32, the element log-probs summed over C x A (0 for deterministic methods).
        log_prob_elements: (N, C, A) float32 element log-probs.
        values: (N,) float32 critic values (0 without a value head).
        model_actions: (N, H, D) float32 model-space (normalised, padded) actions, or None.
        chains: (N, K+1, H, D) float32 denoise chain x_0 .. x_K, or None.
        denoise_inds: (N, K) int64 stochastic step indices (-1 = deterministic step), or None.
        inputs: model inputs needed by `evaluate()` (uint8 images, token ids, masks), or None.
        header: the settings the call used.
    """

    actions: torch.Tensor
    log_prob: torch.Tensor
    log_prob_elements: torch.Tensor
    values: torch.Tensor
    model_actions: torch.Tensor | None = None
    chains: torch.Tensor | None = None
    denoise_inds: torch.Tensor | None = None
    inputs: Any = None
    header: RolloutHeader = field(default_factory=RolloutHeader)

    def as_info(self) -> dict[str, torch.Tensor]:
        """The (N, ...) tensors the vector wrapper reports in ``infos["policy"]``."""
        out = {
            "actions": self.actions,
            "log_prob": self.log_prob,
            "log_prob_elements": self.log_prob_elements,
            "values": self.values,
        }
        for name in ("model_actions", "chains", "denoise_inds"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


@runtime_checkable
class Policy(Protocol):
    """What `wrappers.PolicyVectorEnv` needs from a policy.

    Randomness (DESIGN C3): env i draws from a counter-based stream keyed by (seed_i, counter_i). `env_ids`
    names which streams a call uses (default ``range(N)``); `seeds` (re)sets those streams' seeds and zeroes
    their counters; every call advances the counters of the envs it acted for (see `StreamPolicy` for calls
    that do not).
    """

    device: torch.device
    action_horizon: int
    """Largest action chunk C the policy can return."""

    def act(
        self,
        obs: Mapping[str, Any],
        *,
        deterministic: bool = False,
        seeds: Sequence[int] | torch.Tensor | None = None,
        env_ids: Sequence[int] | torch.Tensor | None = None,
        action_chunk: int | None = None,
    ) -> PolicyOutput:
        """Actions for a batch of canonical observations."""
        ...

    def value(
        self, obs: Mapping[str, Any], *, env_ids: Sequence[int] | torch.Tensor | None = None
    ) -> torch.Tensor:
        """(N,) critic values for a batch of canonical observations."""
        ...


@runtime_checkable
class StreamPolicy(Policy, Protocol):
    """A `Policy` whose calls can be made without side effects, for speculative (prefetched) calls.

    `PolicyVectorEnv(..., prefetch=True)` needs it: it reads the counters of a group's env ids, acts with
    those counters while the table stays as it is, and advances them only if it uses the result. A
    discarded call therefore leaves nothing to undo (DESIGN C3). The weight version tells it whether a
    speculative output is stale, and `sync_weights` is what `PolicyVectorEnv.sync_weights` forwards to.
    `act` and `advance_streams` may be called from different threads for disjoint env ids.

    Example:
        >>> from policies.baseline import GaussianPolicy
        >>> policy = GaussianPolicy(action_dim=2, action_horizon=4)
        >>> obs = {"task": ["a", "b"]}
        >>> _, counters = policy.stream_state([0, 1])
        >>> out = policy.act(obs, env_ids=[0, 1], counters=counters)  # the table is unchanged
        >>> policy.stream_state([0, 1])[1].tolist()
        [0, 0]
        >>> policy.advance_streams([0, 1], counters)  # the output is used: record the call
        >>> bool(torch.equal(out.actions, GaussianPolicy(2, 4).act(obs).actions))
        True
        >>> policy.stream_state([0, 1])[1].tolist()
        [1, 1]
    """

    weight_version: int
    """Increases with every weight change; outputs carry the version they were made with."""

    def act(self, obs: Mapping[str, Any], *, counters: torch.Tensor | None = None, **kwargs: Any) -> PolicyOutput:
        """`Policy.act` (same arguments); with `counters` ((N,) ints) it changes no stream.

        Env i then draws from (seed_i, counters_i); `seeds` may not be given with `counters`.
        """
        ...

    def stream_state(self, env_ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the (seeds, counters) of `env_ids`, each (N,) int64 on the policy device; changes nothing."""
        ...

    def advance_streams(self, env_ids: Sequence[int] | torch.Tensor, counters: torch.Tensor) -> None:
        """Records a call made with `counters`: the counters of `env_ids` become ``counters + 1``."""
        ...

    def sync_weights(self, source: Any, **kwargs: Any) -> Any:
        """Loads new weights (and raises `weight_version`); returns a report."""
        ...


@runtime_checkable
class BatchSizePolicy(Protocol):
    """A policy that prepares for the batch sizes it will be called with (DESIGN C2's last sentence).

    `PolicyVectorEnv` declares, at construction, every batch size it will pass to ``act`` (N, or each env
    group's size), so that a policy with captured graphs captures those sizes and pays for no larger bucket.
    """

    def declare_batch_sizes(self, sizes: Sequence[int]) -> Any:
        """Prepares for calls of these batch sizes (distinct positive ints); what it returns is not used."""
        ...
