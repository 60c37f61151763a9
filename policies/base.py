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

from policies.checks import bad_input, check_bool, check_choice, check_float, check_int

METHODS = ("ode", "sde", "noise")
"""Rollout methods (DESIGN C4): deterministic Euler, flow-SDE, learned noise head."""
TRAINABLE = ("expert", "all")
"""Trainable subsets of a policy."""


@dataclass(frozen=True)
class RolloutConfig:
    """Rollout settings: a policy's configuration, one call's options and the header of what a call returned.

    One type serves all three: a policy holds one as its settings; a call's options are
    ``replace(config, method="ode", action_chunk=C, action_dim=A)``; an `act()` output's header is the options
    with the weight version and the value source filled in, and `evaluate()` checks a batch against it.

    Attributes:
        method: "ode", "sde" or "noise" for stochastic calls (`deterministic=True` always uses "ode").
        num_steps: K denoise steps (must be declared in the scheduler).
        noise_level: a, the SDE noise level (a graph input: changing it never recaptures).
        joint: joint SDE log-prob over all steps (always on for "noise").
        shared_j: one stochastic step for the whole batch, drawn from the first env's stream (RLinf).
        ignore_last: never choose the last step as the stochastic one.
        action_chunk: C, env steps executed for each call (the log-probs are cropped to it).
        trainable: "expert" (expert, action/time projections and heads; RLinf's default) or "all".
        keep_prefix: every `act()` output carries a copy of the prefix K/V (`PolicyOutput.prefix`), so that a PPO
            trainer whose prefix is frozen never recomputes it (about 10 MB per sample in the LIBERO RL setting).
        action_dim: A, the env action dims the log-probs are cropped to (0 in a policy's config: its own).
        value_source: "prefix", "suffix" or "none" in a header ("" in a config: the model's).
        weight_version: the policy's weight version at the call (headers; it rises with every weight commit).

    Example:
        >>> from dataclasses import replace
        >>> config = RolloutConfig(method="sde", num_steps=5, joint=True)
        >>> options = replace(config, method="ode", action_chunk=2, action_dim=7)
        >>> options.is_joint, config.is_joint
        (False, True)
    """

    method: str = "sde"
    num_steps: int = 10
    noise_level: float = 0.5
    joint: bool = False
    shared_j: bool = False
    ignore_last: bool = False
    action_chunk: int = 5
    trainable: str = "expert"
    keep_prefix: bool = False
    action_dim: int = 0
    value_source: str = ""
    weight_version: int = 0

    def __post_init__(self) -> None:
        name = "RolloutConfig."
        check_choice(name + "method", self.method, METHODS)
        check_int(name + "num_steps", self.num_steps, 1, fix="K denoise steps, e.g. 10")
        check_float(name + "noise_level", self.noise_level, 0.0, fix="the SDE noise level a, e.g. 0.5 (0: no noise)")
        for flag in ("joint", "shared_j", "ignore_last", "keep_prefix"):
            check_bool(name + flag, getattr(self, flag))
        check_int(name + "action_chunk", self.action_chunk, 1, fix="C env steps a call, at most the model horizon H")
        check_choice(name + "trainable", self.trainable, TRAINABLE)
        check_int(name + "action_dim", self.action_dim, 0, fix="the env action dims A (0 in a config: the policy's)")
        check_choice(name + "value_source", self.value_source, ("", "prefix", "suffix", "none"))
        check_int(name + "weight_version", self.weight_version, 0)
        if self.ignore_last and self.method == "sde" and not self.joint and self.num_steps < 2:
            raise ValueError(
                bad_input(name + "ignore_last", "num_steps >= 2 (a stochastic step other than the last)",
                          f"num_steps={self.num_steps}", "raise num_steps or set ignore_last=False", raw=True)
            )  # fmt: skip

    @property
    def is_joint(self) -> bool:
        """Whether the log-prob is the mean over the K+1 rows (x_0 and every transition)."""
        return self.method == "noise" or (self.method == "sde" and self.joint)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields."""
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
        prefix: the prefix K/V the call computed, kept for `evaluate()` when the policy is asked to, or None.
    """

    actions: torch.Tensor
    log_prob: torch.Tensor
    log_prob_elements: torch.Tensor
    values: torch.Tensor
    model_actions: torch.Tensor | None = None
    chains: torch.Tensor | None = None
    denoise_inds: torch.Tensor | None = None
    inputs: Any = None
    header: RolloutConfig = field(default_factory=RolloutConfig)
    prefix: Any = None

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
