"""Per-sub-env freezing: what lets `PolicyVectorEnv` execute an action chunk (DESIGN C2).

Contract
--------
A vector env is *freezable* when each of its sub-envs can obey these rules once it has reported
``terminated`` or ``truncated``:

1. **Frozen until thawed.** Further ``step()`` calls do not step the simulator; they replay the
   terminal observation and info with reward 0 and ``terminated = truncated = False`` (so that the
   vector env's own bookkeeping does not try to autoreset it again).
2. **Autoresets are ignored.** A ``reset()`` that does not carry the thaw option -- which is what
   Sync/AsyncVectorEnv issue in ``NEXT_STEP`` and ``SAME_STEP`` autoreset mode, and what a
   ``reset_mask`` reset without the option does -- leaves the simulator untouched and returns the
   terminal observation and info again.
3. **Thawing.** ``reset(seed=..., options={THAW_OPTION: True, ...})`` really resets the sub-env (with
   that seed) and unfreezes it. A sub-env that is not frozen resets normally whatever the options.

Freezing is off until `start_freezing(env)` switches it on, which `PolicyVectorEnv` does when it is built
around the env. Until then the vector env is a plain Gymnasium vector env that behaves as the autoreset
mode it declares in ``metadata["autoreset_mode"]`` (a user's own loop, ``RecordEpisodeStatistics``, ...).

`PolicyVectorEnv` resets finished sub-envs at the chunk boundary with
``env.reset(options={"reset_mask": mask, THAW_OPTION: True})``; gymnasium 1.x Sync/AsyncVectorEnv pop
``reset_mask`` and pass the remaining options (here ``{THAW_OPTION: True}``) to the masked sub-envs only.
Its full resets (``reset(seed=s)``) carry the option too.

How an adapter builds one
-------------------------
* numpy envs: ``make_freezable_vector_env(env_fns, vectorization="sync"|"async", autoreset_mode=...)``
  wraps every sub-env in `FreezeOnDone` (outermost, so that it sees ``TimeLimit`` truncations) and
  builds a Sync/AsyncVectorEnv. `FreezeOnDone` sets ``metadata[FREEZABLE_KEY] = True``, which
  Sync/AsyncVectorEnv copy from their first sub-env into their own metadata.
* Envs with their own termination controls (ManiSkill's GPU-batched env): an adapter-specific
  `VectorWrapper` that obeys rules 1-3 for the ``reset_mask``/``THAW_OPTION`` reset above once its
  ``start_freezing()`` method has been called, and sets ``metadata[FREEZABLE_KEY] = True`` itself.

How `PolicyVectorEnv` uses one
------------------------------
`start_freezing(env)` checks the flag (raising a `ValueError` that says how to build a freezable env when it
is missing) and switches freezing on; `is_freezable(env)` only reads ``env.metadata.get(FREEZABLE_KEY)``.

Reading schedule (render on demand)
-----------------------------------
Thawing resets happen only at chunk boundaries, so every live sub-env's env steps since its last reset count
the sub-steps of the current chunk. `set_read_every(env, C)`, which `PolicyVectorEnv` calls once after
`start_freezing`, tells an env that offers ``set_read_every(C)`` that the observations anyone reads are those
of resets, of the step ending an episode, and of every C-th step since a reset (the chunk's last sub-step);
the images of other steps may be left stale (the state vector is always current). An env without the method
renders every step, as before; a recorder that needs every frame passes 1 down.

Example:
    >>> import gymnasium as gym
    >>> venv = make_freezable_vector_env([lambda: gym.make("CartPole-v1")] * 2)
    >>> is_freezable(venv), venv.envs[0].freezing
    (True, False)
    >>> start_freezing(venv); venv.envs[0].freezing
    True
    >>> venv.close()
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, SupportsFloat

import gymnasium as gym
from gymnasium.utils import RecordConstructorArgs
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv, VectorEnv, VectorWrapper

from wrappers.bounded_async import DEFAULT_TIMEOUT_S, BoundedAsyncVectorEnv

FREEZABLE_KEY = "phyai_gym.freezable"
"""Metadata key: True when every sub-env freezes after it finishes (rules 1-3 above)."""
READ_EVERY_KEY = "phyai_gym.read_every"
"""Metadata key: True when every sub-env has ``set_read_every(chunk)`` (needed to find it behind AsyncVectorEnv)."""
THAW_OPTION = "phyai_gym.thaw"
"""Reset option: when true, a frozen sub-env is really reset; otherwise the reset is ignored."""


class FreezeOnDone(gym.Wrapper, RecordConstructorArgs):
    """Freezes a single env after it terminates or truncates, until a reset carrying `THAW_OPTION`.

    Freezing is off until `start_freezing()` (the env then passes everything through unchanged). Once on:
    while frozen, `step()` replays the terminal observation and info with reward 0 and no done flags,
    and `reset()` without the thaw option returns the terminal observation and info again without
    touching the simulator. Put it outermost (outside ``TimeLimit``) so it sees every episode end.

    Example:
        >>> import gymnasium as gym
        >>> env = FreezeOnDone(gym.make("CartPole-v1"))
        >>> env.start_freezing()
        >>> obs, _ = env.reset(seed=0)
        >>> env.frozen
        False
        >>> env.metadata[FREEZABLE_KEY]
        True
    """

    def __init__(self, env: gym.Env) -> None:
        RecordConstructorArgs.__init__(self)
        gym.Wrapper.__init__(self, env)
        self.metadata = {**env.metadata, FREEZABLE_KEY: True}
        self._freezing = False
        self._frozen = False
        self._terminal_obs: Any = None
        self._terminal_info: dict[str, Any] = {}

    @property
    def frozen(self) -> bool:
        """True between the end of an episode and the next thawing reset (never while freezing is off)."""
        return self._frozen

    @property
    def freezing(self) -> bool:
        """True once `start_freezing()` was called: finished episodes then stay frozen until thawed."""
        return self._freezing

    def start_freezing(self) -> None:
        """Switches freezing on (what `PolicyVectorEnv` needs); from the next episode end on, rules 1-3 hold."""
        self._freezing = True

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Steps the env, or replays the terminal transition with reward 0 while frozen."""
        if self._frozen:
            return self._terminal_obs, 0.0, False, False, dict(self._terminal_info)
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self._freezing and (terminated or truncated):
            self._frozen = True
            self._terminal_obs, self._terminal_info = obs, dict(info)
        return obs, reward, terminated, truncated, info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Resets the env unless it is frozen and `options` lacks a true `THAW_OPTION`."""
        options = dict(options) if options else {}
        thaw = bool(options.pop(THAW_OPTION, False))
        if self._frozen and not thaw:
            return self._terminal_obs, dict(self._terminal_info)
        self._frozen = False
        self._terminal_obs, self._terminal_info = None, {}
        return self.env.reset(seed=seed, options=options or None)


def _make_frozen(env_fn: Callable[[], gym.Env]) -> gym.Env:
    return FreezeOnDone(env_fn())


def make_freezable_vector_env(
    env_fns: Sequence[Callable[[], gym.Env]],
    vectorization: Literal["sync", "async"] = "sync",
    autoreset_mode: AutoresetMode | str = AutoresetMode.SAME_STEP,
    **vector_kwargs: Any,
) -> VectorEnv:
    """A Sync/AsyncVectorEnv whose sub-envs are wrapped in `FreezeOnDone`.

    Args:
        env_fns: functions that each build one single env (picklable by cloudpickle for "async").
        vectorization: "sync" (in-process) or "async" (one process per sub-env).
        autoreset_mode: the inner env's autoreset mode; `PolicyVectorEnv` handles all three. SAME_STEP
            (default) never needs extra calls: the inner autoreset is simply ignored by frozen sub-envs.
        **vector_kwargs: passed to ``SyncVectorEnv``/`BoundedAsyncVectorEnv` (e.g. ``context="forkserver"``,
            ``timeout=`` seconds a worker may take to answer). For "async", ``shared_memory`` defaults to
            False (gymnasium 1.4 reads a ``Text`` space, the canonical ``task``, from shared memory only once,
            so instructions would go stale), ``context`` to "forkserver" (a forked worker of a process that
            holds a GL context hangs) and ``timeout`` to `DEFAULT_TIMEOUT_S`.

    Raises:
        ValueError: for "async" with NEXT_STEP and ``shared_memory=False``: gymnasium 1.4's worker then keeps
            its autoreset flag across a ``reset_mask`` reset and would reset a thawed sub-env behind our back.
        WorkerTimeoutError: an "async" worker did not answer within ``timeout`` (see `wrappers.bounded_async`).

    Returns:
        A vector env with ``metadata[FREEZABLE_KEY] = True``.

    Example:
        >>> import gymnasium as gym
        >>> venv = make_freezable_vector_env([lambda: gym.make("CartPole-v1")] * 2, vectorization="sync")
        >>> venv.num_envs, venv.metadata[FREEZABLE_KEY]
        (2, True)
        >>> venv.close()
    """
    fns = [functools.partial(_make_frozen, fn) for fn in env_fns]
    if vectorization == "sync":
        venv: VectorEnv = SyncVectorEnv(fns, autoreset_mode=autoreset_mode, **vector_kwargs)
    elif vectorization == "async":
        vector_kwargs.setdefault("shared_memory", False)
        vector_kwargs.setdefault("context", "forkserver")
        vector_kwargs.setdefault("timeout", DEFAULT_TIMEOUT_S)
        if AutoresetMode(autoreset_mode) == AutoresetMode.NEXT_STEP and not vector_kwargs["shared_memory"]:
            raise ValueError(
                "make_freezable_vector_env: vectorization='async' with autoreset_mode=NEXT_STEP needs "
                "shared_memory=True (gymnasium's worker only clears its autoreset flag on a shared-memory "
                "reset), got shared_memory=False. Fix: use autoreset_mode='SameStep' or 'Disabled', or "
                "shared_memory=True when the observation space has no Text space."
            )
        venv = BoundedAsyncVectorEnv(fns, autoreset_mode=autoreset_mode, **vector_kwargs)
    else:
        raise ValueError(f"make_freezable_vector_env: vectorization must be 'sync' or 'async', got {vectorization!r}.")
    venv.metadata = {**venv.metadata, FREEZABLE_KEY: True}
    return venv


def is_freezable(env: VectorEnv) -> bool:
    """True when `env` declares ``metadata[FREEZABLE_KEY]`` (its sub-envs obey the freeze contract)."""
    metadata: Mapping[str, Any] = getattr(env, "metadata", None) or {}
    return bool(metadata.get(FREEZABLE_KEY, False))


def start_freezing(env: VectorEnv, argument: str = "env") -> None:
    """Checks that `env` is freezable (`require_freezable`) and switches its sub-envs' freezing on.

    `PolicyVectorEnv` calls it once when it is built around `env`; a vector env nobody drives this way keeps
    Gymnasium's plain autoreset behaviour. Walks down vector wrappers to the first level that has a
    ``start_freezing()`` method, or to the Sync/AsyncVectorEnv whose `FreezeOnDone` sub-envs have one.

    Example:
        >>> import gymnasium as gym
        >>> venv = make_freezable_vector_env([lambda: gym.make("CartPole-v1")])
        >>> start_freezing(venv); venv.envs[0].freezing
        True
        >>> venv.close()
    """
    require_freezable(env, argument)
    level: Any = env
    while not callable(getattr(type(level), "start_freezing", None)) and isinstance(level, VectorWrapper):
        level = level.env
    if callable(getattr(type(level), "start_freezing", None)):
        level.start_freezing()
    elif isinstance(level, SyncVectorEnv):
        for sub_env in level.envs:
            sub_env.get_wrapper_attr("start_freezing")()
    elif isinstance(level, AsyncVectorEnv):
        level.call("start_freezing")
    else:
        raise ValueError(
            f"PolicyVectorEnv: argument `{argument}` declares metadata[{FREEZABLE_KEY!r}] = True but "
            f"{type(level).__name__} has no start_freezing() method and is not a Sync/AsyncVectorEnv of "
            "FreezeOnDone sub-envs. Fix: give the vector env (or a wrapper of it) a start_freezing() method "
            "that switches rules 1-3 of wrappers.freeze on, or build it with make_freezable_vector_env."
        )


def set_read_every(env: VectorEnv, chunk: int) -> bool:
    """Tells `env` that only resets, episode ends and every `chunk`-th step since a reset are read.

    Walks down vector wrappers to the first level with a ``set_read_every()`` method (or to a Sync/AsyncVectorEnv
    whose sub-envs have one) and calls it. Returns False, changing nothing, when no level has one.

    Example:
        >>> import gymnasium as gym
        >>> venv = make_freezable_vector_env([lambda: gym.make("CartPole-v1")])
        >>> set_read_every(venv, 5)   # CartPole has no images: it keeps computing every observation
        False
        >>> venv.close()
    """
    level: Any = env
    while not callable(getattr(type(level), "set_read_every", None)) and isinstance(level, VectorWrapper):
        level = level.env
    if callable(getattr(type(level), "set_read_every", None)):
        level.set_read_every(chunk)
        return True
    if isinstance(level, SyncVectorEnv):
        if not all(_has_attr(sub_env, "set_read_every") for sub_env in level.envs):
            return False
        for sub_env in level.envs:
            sub_env.get_wrapper_attr("set_read_every")(chunk)
        return True
    if isinstance(level, AsyncVectorEnv) and level.metadata.get(READ_EVERY_KEY):
        level.call("set_read_every", chunk)
        return True
    return False


def _has_attr(env: gym.Env, name: str) -> bool:
    try:
        env.get_wrapper_attr(name)
    except AttributeError:
        return False
    return True


def require_freezable(env: VectorEnv, argument: str = "env") -> None:
    """Raises a `ValueError` explaining how to build a freezable env unless `env` is one."""
    if is_freezable(env):
        return
    raise ValueError(
        f"PolicyVectorEnv: argument `{argument}` must be a vector env whose sub-envs freeze after they end "
        f"(metadata[{FREEZABLE_KEY!r}] = True), got {type(env).__name__} without that flag. Chunk execution "
        "needs finished sub-envs to stay untouched until the chunk boundary. Fix: build it with "
        "wrappers.make_mujoco_env / make_libero_env / make_maniskill_env, or with "
        "wrappers.freeze.make_freezable_vector_env(env_fns, vectorization='sync'|'async'), or wrap each "
        "sub-env in wrappers.freeze.FreezeOnDone before vectorising it."
    )
