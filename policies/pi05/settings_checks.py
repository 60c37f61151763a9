"""Field checks of the rollout and scheduler settings, called from their ``__post_init__``.

A bad value is refused where the config is made, with the field, what it takes and what came, instead of a
policy that refuses every `act()` later or a ``ZeroDivisionError`` deep in the step tables. The checks read
fields by name, so any settings type that carries these fields can call them.

Example:
    >>> from types import SimpleNamespace
    >>> check_rollout_fields(SimpleNamespace(num_steps=0))
    Traceback (most recent call last):
    ...
    ValueError: SimpleNamespace.num_steps: expected an integer >= 1, got 0. Fix: K denoise steps, e.g. 10.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..checks import bad_input, check_bool, check_choice, check_float, check_int, check_int_tuple
from .sampler import METHODS

TRAINABLE = ("expert", "all")
"""Trainable subsets of a policy."""

_ROLLOUT: dict[str, Callable[[str, Any], Any]] = {
    "method": lambda name, v: check_choice(name, v, METHODS),
    "num_steps": lambda name, v: check_int(name, v, 1, fix="K denoise steps, e.g. 10"),
    "noise_level": lambda name, v: check_float(name, v, 0.0, fix="the SDE noise level a, e.g. 0.5 (0: no noise)"),
    "joint": check_bool,
    "shared_j": check_bool,
    "ignore_last": check_bool,
    "action_chunk": lambda name, v: check_int(name, v, 1, fix="C env steps per call, at most the model horizon H"),
    "action_dim": lambda name, v: check_int(name, v, 1),
    "trainable": lambda name, v: check_choice(name, v, TRAINABLE),
}


def check_rollout_fields(cfg: Any) -> None:
    """Refuse a bad rollout setting (method, K, a, flags, C, A, trainable) of `cfg`; checks only what it has."""
    owner = type(cfg).__name__
    for field, check in _ROLLOUT.items():
        if hasattr(cfg, field):
            check(f"{owner}.{field}", getattr(cfg, field))
    method = getattr(cfg, "method", "sde")
    if getattr(cfg, "ignore_last", False) and method == "sde" and not getattr(cfg, "joint", False):
        if getattr(cfg, "num_steps", 2) < 2:
            raise ValueError(
                bad_input(f"{owner}.ignore_last", "num_steps >= 2 (a stochastic step other than the last)",
                          f"num_steps={cfg.num_steps}", "raise num_steps or set ignore_last=False", raw=True)
            )  # fmt: skip


def check_scheduler_fields(cfg: Any) -> None:
    """Refuse bad scheduler settings: sizes, buckets, declared K values, camera sets, the graph switch."""
    owner = type(cfg).__name__
    check_int(f"{owner}.max_batch_size", cfg.max_batch_size, 1, fix="the largest batch one replay serves, e.g. 64")
    if cfg.batch_buckets is not None:
        buckets = check_int_tuple(f"{owner}.batch_buckets", cfg.batch_buckets, 1)
        if max(buckets) > cfg.max_batch_size:
            raise ValueError(
                bad_input(f"{owner}.batch_buckets", f"sizes <= max_batch_size ({cfg.max_batch_size})", buckets,
                          "raise max_batch_size or drop the larger buckets")
            )  # fmt: skip
    check_int_tuple(f"{owner}.prompt_buckets", cfg.prompt_buckets, 1, fix="prompt lengths L, e.g. (16, 48, 112, 200)")
    check_int_tuple(f"{owner}.num_steps", cfg.num_steps, 1, fix="the K values act() may use, e.g. (10,)")
    sets = cfg.camera_sets
    if isinstance(sets, str) or not isinstance(sets, Sequence) or not sets:
        raise TypeError(bad_input(f"{owner}.camera_sets", "a non-empty tuple of slot-index tuples, e.g. ((0, 1),)",
                                  sets))  # fmt: skip
    for i, cams in enumerate(sets):
        slots = check_int_tuple(f"{owner}.camera_sets[{i}]", cams, 0, fix="slot indices, e.g. (0, 1)")
        if len(set(slots)) != len(slots):
            raise ValueError(bad_input(f"{owner}.camera_sets[{i}]", "distinct slot indices", slots))
    check_bool(f"{owner}.cuda_graphs", cfg.cuda_graphs)
