"""Policy side of phyai-gym, usable without Gymnasium: the Policy protocol, PI0.5 and baselines."""

from policies.base import BatchSizePolicy, Policy, PolicyOutput, RolloutConfig, StreamPolicy

__all__ = ["BatchSizePolicy", "Policy", "PolicyOutput", "RolloutConfig", "StreamPolicy"]
