"""An `AsyncVectorEnv` whose workers must answer within a deadline, so that a stuck worker never hangs the caller.

A worker that cannot start (the classic case: the parent already holds an EGL/OSMesa context and the workers
were forked, so the child's renderer waits on a lock copied in a locked state) would make gymnasium's
``AsyncVectorEnv`` wait forever, in its constructor or in the first ``reset()``. `BoundedAsyncVectorEnv`
bounds every blocking exchange with its workers (construction, ``reset``, ``step``): when the deadline passes,
the workers are terminated and a `WorkerTimeoutError` says what did not answer and how to fix it.

Example:
    >>> import gymnasium as gym
    >>> venv = BoundedAsyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2, timeout=120, context="spawn")
    >>> venv.reset(seed=0)[0].shape
    (2, 4)
    >>> venv.close()
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
from gymnasium.vector import AsyncVectorEnv

DEFAULT_TIMEOUT_S = 300.0
"""Default deadline of one exchange with the workers; a first LIBERO reset (imports, model build) fits in it."""


class WorkerTimeoutError(RuntimeError):
    """Raised when the async workers do not answer within the deadline (they are terminated first)."""


class BoundedAsyncVectorEnv(AsyncVectorEnv):
    """`gymnasium.vector.AsyncVectorEnv` with a deadline on construction, ``reset`` and ``step``.

    Args:
        env_fns: functions that each build one env (as for ``AsyncVectorEnv``).
        timeout: seconds one exchange may take; None waits forever (gymnasium's behaviour).
        **kwargs: passed to ``AsyncVectorEnv`` (``context``, ``shared_memory``, ``autoreset_mode``, ...).

    Raises:
        WorkerTimeoutError: a worker did not answer in time; the message names the start method and the fix.

    Example:
        >>> import gymnasium as gym
        >>> venv = BoundedAsyncVectorEnv([lambda: gym.make("CartPole-v1")], timeout=120, context="spawn")
        >>> venv.timeout
        120.0
        >>> venv.close()
    """

    def __init__(
        self, env_fns: Sequence[Callable[[], gym.Env]], *, timeout: float | None = DEFAULT_TIMEOUT_S, **kwargs: Any
    ) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"BoundedAsyncVectorEnv: timeout must be > 0 seconds or None, got {timeout!r}.")
        self.timeout = None if timeout is None else float(timeout)
        self.start_method = kwargs.get("context") or "the platform default (fork on Linux)"
        expired = threading.Event()
        # the constructor's space check has no timeout of its own: a watchdog terminates silent workers
        timer = threading.Timer(self.timeout or 0.0, self._terminate_workers, args=(expired,))
        timer.daemon = True
        if self.timeout is not None:
            timer.start()
        try:
            super().__init__(env_fns, **kwargs)
        except Exception as error:
            if not expired.is_set():
                raise
            self._close_expired()
            raise WorkerTimeoutError(self._message("start (build the sub-envs and report their spaces)")) from error
        finally:
            timer.cancel()
        if expired.is_set():
            self._close_expired()
            raise WorkerTimeoutError(self._message("start (build the sub-envs and report their spaces)"))

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """``AsyncVectorEnv.reset`` with the deadline."""
        self.reset_async(seed=seed, options=options)
        try:
            return self.reset_wait(timeout=self.timeout)
        except multiprocessing.TimeoutError as error:
            self._close_expired()
            raise WorkerTimeoutError(self._message("reset()")) from error

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """``AsyncVectorEnv.step`` with the deadline."""
        self.step_async(actions)
        try:
            return self.step_wait(timeout=self.timeout)
        except multiprocessing.TimeoutError as error:
            self._close_expired()
            raise WorkerTimeoutError(self._message("step()")) from error

    def _terminate_workers(self, expired: threading.Event) -> None:
        expired.set()
        for process in getattr(self, "processes", []):
            if process.is_alive():
                process.terminate()

    def _close_expired(self) -> None:
        if not getattr(self, "closed", True):
            self.close(terminate=True)

    def _message(self, what: str) -> str:
        return (
            f"AsyncVectorEnv: the sub-env workers did not answer {what} within timeout={self.timeout:g} s and were "
            f"terminated (start method: {self.start_method}). The usual cause is a worker forked from a process "
            "that already holds a GL context (an earlier env rendered with EGL/OSMesa): the child's renderer "
            "waits forever on a lock it inherited. Fix: use context='forkserver' or 'spawn' (the adapters' "
            "default), or raise timeout= if the envs are just slow to start."
        )
