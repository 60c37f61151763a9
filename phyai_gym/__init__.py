"""phyai-gym: run a PI0.5 policy inside Gymnasium vector envs for RL and evaluation.

The front door re-exports what most scripts need::

    from phyai_gym import make_env, make_policy, PolicyVectorEnv, evaluate_success
"""

from __future__ import annotations

from phyai_gym.evaluation import EvalResult, evaluate_success, plan_episodes, wilson_interval
from phyai_gym.make import make_env, make_policy, resolve_env
from phyai_gym.run import RunConfig, run
from policies.pi05.config import Pi05Config
from policies.pi05.policy import Pi05Policy, RolloutConfig
from wrappers import PolicyVectorEnv

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
