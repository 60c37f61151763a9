"""phyai-gym: run a PI0.5 policy inside Gymnasium vector envs for RL and evaluation.

The front door re-exports what most scripts need::

    from phyai_gym import make_env, make_policy, PolicyVectorEnv, evaluate_success

The names are resolved on first use (PEP 562), so that ``import phyai_gym.cli`` -- and ``phyai-gym --help`` --
does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from phyai_gym.run import RunConfig, run  # light (stdlib only); bound here so `run` names the function

if TYPE_CHECKING:
    from phyai_gym.evaluation import EvalResult, evaluate_success, plan_episodes, wilson_interval
    from phyai_gym.make import make_env, make_policy, resolve_env
    from policies.pi05.config import Pi05Config
    from policies.pi05.policy import Pi05Policy, RolloutConfig
    from wrappers import PolicyVectorEnv

_SOURCES = {
    "EvalResult": "phyai_gym.evaluation",
    "evaluate_success": "phyai_gym.evaluation",
    "plan_episodes": "phyai_gym.evaluation",
    "wilson_interval": "phyai_gym.evaluation",
    "make_env": "phyai_gym.make",
    "make_policy": "phyai_gym.make",
    "resolve_env": "phyai_gym.make",
    "Pi05Config": "policies.pi05.config",
    "Pi05Policy": "policies.pi05.policy",
    "RolloutConfig": "policies.pi05.policy",
    "PolicyVectorEnv": "wrappers",
}

__all__ = [
    "EvalResult",
    "Pi05Config",
    "Pi05Policy",
    "PolicyVectorEnv",
    "RolloutConfig",
    "RunConfig",
    "evaluate_success",
    "make_env",
    "make_policy",
    "plan_episodes",
    "resolve_env",
    "run",
    "wilson_interval",
]


def __getattr__(name: str) -> Any:
    if name not in _SOURCES:
        raise AttributeError(f"module 'phyai_gym' has no attribute {name!r}")
    return getattr(importlib.import_module(_SOURCES[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
