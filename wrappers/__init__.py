"""Gymnasium side of phyai-gym: the policy vector wrapper, chunk execution, episode statistics, adapters."""

from __future__ import annotations

from typing import Any

from wrappers.adapters.mujoco import make_mujoco_env
from wrappers.adapters.scripted import make_scripted_env
from wrappers.episode_statistics import EpisodeStatistics
from wrappers.frame_recorder import FrameRecorder
from wrappers.freeze import FREEZABLE_KEY, THAW_OPTION, FreezeOnDone, is_freezable, make_freezable_vector_env
from wrappers.policy_vector_env import PolicyVectorEnv

_LAZY_ADAPTERS = {
    "make_libero_env": "wrappers.adapters.libero",
    "make_maniskill_env": "wrappers.adapters.maniskill",
}

__all__ = [
    "FREEZABLE_KEY",
    "THAW_OPTION",
    "EpisodeStatistics",
    "FrameRecorder",
    "FreezeOnDone",
    "PolicyVectorEnv",
    "is_freezable",
    "make_freezable_vector_env",
    "make_mujoco_env",
    "make_scripted_env",
    *_LAZY_ADAPTERS,
]


def __getattr__(name: str) -> Any:
    """Imports the LIBERO/ManiSkill adapters on first use, so a missing simulator never breaks import."""
    if name in _LAZY_ADAPTERS:
        import importlib

        try:
            module = importlib.import_module(_LAZY_ADAPTERS[name])
        except ImportError as error:
            raise ImportError(
                f"wrappers.{name} is unavailable: importing {_LAZY_ADAPTERS[name]} failed ({error}). "
                "Fix: install the simulator extra (pip install 'phyai-gym[libero]' or '[maniskill]')."
            ) from error
        return getattr(module, name)
    raise AttributeError(f"module 'wrappers' has no attribute {name!r}")
