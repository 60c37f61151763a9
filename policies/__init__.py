"""Policy side of phyai-gym, usable without Gymnasium: the Policy protocol, PI0.5 and baselines."""

from policies.base import Policy, PolicyOutput, RolloutConfig

__all__ = ["Policy", "PolicyOutput", "RolloutConfig"]
