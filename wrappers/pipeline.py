"""Env groups and cross-step prefetch behind `PolicyVectorEnv`: when policy calls and env chunks run (DESIGN C2).

`EnvPipeline` owns the G inner vector envs (one `ChunkRunner` each, env ids offset so that group g holds
envs ``offset_g .. offset_g + n_g - 1``), and runs one step of them: a policy call per group, then its chunk.
With G > 1 the chunks run in worker threads, so the policy acts on group g+1 while group g steps. With
``prefetch=True`` a group's call for the next step starts as soon as its chunk ends (a speculative call); the
next step uses it if it was made from the same observation, settings and weight version, and otherwise calls
again. A speculative call reads its envs' stream counters and acts with them without advancing them
(`policies.base.StreamPolicy`); only a call whose result is used advances them. A discarded call therefore
changes nothing, and results equal ``G = 1`` without prefetch bit for bit. Between steps the wrapper is taken
to be the only caller of ``policy.act`` for its env ids (as it is for their streams without prefetch).
"""

from __future__ import annotations

import multiprocessing.connection
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gymnasium.vector import VectorEnv

from policies.base import Policy, PolicyOutput, StreamPolicy
from wrappers._chunk import ChunkResult, ChunkRunner

WORKER_ERRORS = (BrokenPipeError, EOFError, ConnectionResetError)
"""What talking to a dead async sub-env worker raises."""


@dataclass(frozen=True)
class CallSettings:
    """The settings of the policy calls of one step; a speculative call is used only under equal settings.

    Attributes:
        deterministic: passed to ``policy.act``.
        action_chunk: C, passed to ``policy.act`` and checked against the actions it returns.
        action_dim: A, the env's action dims (checked against the actions).
        action_dtype: numpy dtype of the actions numpy envs receive.
    """

    deterministic: bool
    action_chunk: int
    action_dim: int
    action_dtype: Any


@dataclass
class _Call:
    """A policy call for one group: its output, the actions in the env's array type, and the counters it used."""

    out: PolicyOutput
    env_actions: Any
    counters: torch.Tensor | None = None  # explicit counters of a speculative call (None: the call advanced them)


@dataclass
class _Speculation:
    """A call started for a group's next step, and what it must match to be used."""

    future: Future[_Call]
    obs: Any  # the observation object it acts on (the group's `ChunkRunner.obs` when it started)
    settings: CallSettings
    weight_version: int  # the policy's when it started (a sync during the call makes it stale too)


class EnvPipeline:
    """Runs the policy calls and env chunks of G env groups, overlapping them in threads when G > 1.

    Args:
        envs: the G freezable vector envs.
        policy: the policy; must be a `StreamPolicy` for ``prefetch=True``.
        prefetch: start each group's next call as soon as its chunk ends (see the module docstring). The group
            whose chunk ends last has its call started by the next `step`, once the first chunk's actions are
            with its envs (its host work would otherwise delay that chunk), so G = 1 gains nothing from it.
        env_concurrency: how many groups' chunks may run at once (None = G). 1 runs them one after the other,
            in the order their actions were ready: for envs that share one resource (a render GPU, a GPU
            simulator, fewer CPU cores than envs), where concurrent chunks only share it and the stagger
            between the groups is lost. Results are unchanged; only the timing moves.

    Example:
        >>> from policies.baseline import GaussianPolicy
        >>> from wrappers.adapters.scripted import make_scripted_env
        >>> envs = [make_scripted_env(2), make_scripted_env(2)]
        >>> pipeline = EnvPipeline(envs, GaussianPolicy(3, action_horizon=4), prefetch=True)
        >>> obs, infos = pipeline.reset(seeds=[0, 1, 2, 3], options={})
        >>> results, outputs = pipeline.step(None, CallSettings(False, 4, 3, np.float32))
        >>> [tuple(r.substep_mask.shape) for r in results], pipeline.batch_sizes
        ([(2, 4), (2, 4)], (2,))
        >>> pipeline.close()
    """

    def __init__(
        self, envs: Sequence[VectorEnv], policy: Policy, *, prefetch: bool = False, env_concurrency: int | None = None
    ) -> None:
        groups = len(envs)
        if env_concurrency is not None and (
            isinstance(env_concurrency, bool) or not isinstance(env_concurrency, int) or env_concurrency < 1
        ):
            raise ValueError(
                f"PolicyVectorEnv: argument `env_concurrency` must be None or an int >= 1, got "
                f"{env_concurrency!r}. Fix: pass 1 to run the groups' env chunks one at a time, or None to run "
                f"all {groups} group(s) at once."
            )
        if prefetch and not isinstance(policy, StreamPolicy):
            raise TypeError(
                f"PolicyVectorEnv: argument `prefetch=True` needs a policy that implements "
                f"policies.base.StreamPolicy (stream_state(), act(..., counters=...), advance_streams(), "
                f"weight_version, sync_weights()), so that a discarded speculative call changes nothing; got "
                f"{type(policy).__name__}. Fix: pass prefetch=False, or use policies.Pi05Policy or "
                "policies.baseline.GaussianPolicy."
            )
        offsets = np.cumsum([0] + [env.num_envs for env in envs])
        self.runners = [ChunkRunner(env, int(offset)) for env, offset in zip(envs, offsets)]
        self.num_envs = int(offsets[-1])
        self.policy = policy
        self.prefetch = bool(prefetch)
        self._stream_policy = policy if prefetch and isinstance(policy, StreamPolicy) else None
        workers = groups * (2 if self.prefetch else 1)  # prefetch: up to G chunks and G calls at once
        self.pool = ThreadPoolExecutor(workers, "pve-group") if workers > 1 else None
        concurrency = groups if env_concurrency is None else min(env_concurrency, groups)
        # chunks beyond `env_concurrency` wait here, in the order they were submitted (Condition wakes FIFO)
        self.env_slots = threading.Semaphore(concurrency) if concurrency < groups else None
        # a policy call and the device-to-host copy of its actions are queued together (see `_call`)
        self._gate = threading.Lock()
        self._speculations: dict[int, _Speculation] = {}
        self._deferred: set[int] = set()  # groups whose call starts once the next step's first chunk has
        self._workers_broken = False

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes the policy is called with (the groups' sizes, sorted, distinct)."""
        return tuple(sorted({runner.num_envs for runner in self.runners}))

    # --------------------------------------------------------------------------------------------- reset, step
    def reset(
        self, seeds: Sequence[int] | None, options: dict[str, Any], mask: np.ndarray | None = None
    ) -> tuple[list[Any], list[dict[str, Any]]]:
        """Resets every group (with env i's seed `seeds[i]`), or only the envs in the (N,) bool `mask`.

        Drops speculative calls first. Returns the groups' observations and reset infos (a group with no
        masked env keeps its observation and gets an empty info).
        """
        self.cancel()
        obs_parts, info_parts = [], []
        for runner in self.runners:
            rows = slice(runner.offset, runner.offset + runner.num_envs)
            group_options = dict(options) if mask is None else {**options, "reset_mask": mask[rows]}
            info: dict[str, Any] = {}
            if mask is None or mask[rows].any():
                _, info = runner.reset(None if seeds is None else list(seeds[rows]), group_options)
            if runner.obs is None:
                raise RuntimeError("PolicyVectorEnv.reset: a `reset_mask` reset needs a full reset() first.")
            obs_parts.append(runner.obs)
            info_parts.append(info)
        return obs_parts, info_parts

    def step(
        self, actions: Any, settings: CallSettings, seeds: torch.Tensor | None = None
    ) -> tuple[list[ChunkResult], list[PolicyOutput]]:
        """One chunk per group, with the policy's actions (``actions=None``) or explicit (N, C, A) ones.

        `seeds` are the (N,) stream seeds of a seeded reset, for the calls of this step. Returns the groups'
        chunk results and, for a policy step, the groups' policy outputs (in group order).
        """
        if actions is not None:
            self.cancel()
        try:
            return self._step(actions, settings, seeds)
        except WORKER_ERRORS as err:
            self._workers_broken = True
            raise self._worker_died("step", err) from err

    def _step(
        self, actions: Any, settings: CallSettings, seeds: torch.Tensor | None
    ) -> tuple[list[ChunkResult], list[PolicyOutput]]:
        """Calls on group g (now, or its speculative call) while other groups step in worker threads.

        A group's chunk starts as soon as its actions are ready, in the order the speculative calls finish
        (not in group order): waiting for group 0's call while group 1's actions are ready would start both
        groups' envs together at every step and lock the groups in step, with nothing to overlap.
        """
        policy_step = actions is None
        outputs: list[Any] = [None] * len(self.runners)
        pending: list[Any] = [None] * len(self.runners)
        deferred, self._deferred = (self._deferred if policy_step else set()), set()
        for g in self._group_order(policy_step, deferred):
            runner = self.runners[g]
            rows = slice(runner.offset, runner.offset + runner.num_envs)
            if policy_step:
                group_seeds = None if seeds is None else seeds[rows]
                call = self._take(g, settings, seeds) or self._call(runner, settings, group_seeds)
                outputs[g], env_actions = call.out, call.env_actions
                deferred.discard(g)
            else:
                env_actions = self._env_actions(runner, actions[rows], settings)
            if self.pool is None:
                pending[g] = runner.run(env_actions)
                continue
            started = threading.Event() if deferred else None
            pending[g] = self.pool.submit(self._run_chunk, runner, env_actions, started)
            if started is not None:  # the deferred calls start once this chunk's actions are with its envs
                started.wait()
                for d in sorted(deferred):
                    self._speculate(d, settings)
                deferred.clear()
        if self.prefetch and policy_step:
            return self._collect_and_speculate(pending, settings), outputs
        return [p if isinstance(p, ChunkResult) else p.result() for p in pending], (outputs if policy_step else [])

    def _run_chunk(self, runner: ChunkRunner, env_actions: Any, started: threading.Event | None) -> ChunkResult:
        """`runner.run` in a worker thread, holding one of the `env_concurrency` slots if they are limited."""
        if self.env_slots is None:
            return runner.run(env_actions, started)
        with self.env_slots:
            return runner.run(env_actions, started)

    def _group_order(self, policy_step: bool, deferred: set[int]) -> Iterator[int]:
        """Group indices in the order their chunks should start.

        Groups whose speculative call has finished come first, then groups without one (called now, on this
        thread), then the others as their calls finish. A group in `deferred` is not called here while a
        speculative call is still running.
        """
        remaining = list(range(len(self.runners)))
        while remaining:
            if not (policy_step and self._speculations):
                yield remaining.pop(0)
                continue
            waiting = {g: self._speculations[g].future for g in remaining if g in self._speculations}
            ready = [g for g, future in waiting.items() if future.done()]
            g = ready[0] if ready else next((g for g in remaining if g not in waiting and g not in deferred), None)
            if g is None and not waiting:
                g = remaining[0]
            if g is None:
                wait(list(waiting.values()), return_when=FIRST_COMPLETED)
                continue
            remaining.remove(g)
            yield g

    # --------------------------------------------------------------------------------------------- policy calls
    def _call(
        self, runner: ChunkRunner, settings: CallSettings, seeds: torch.Tensor | None, speculative: bool = False
    ) -> _Call:
        """One policy call on the group's current observation, and its actions in the env's array type.

        A speculative call reads its envs' counters and acts with them, changing no stream. For numpy envs the
        device-to-host copy of the actions is queued right behind the call, under a gate that the next call
        (another group's) waits for, and only that copy is waited for: otherwise a later call queued on the
        same CUDA stream first would delay these actions by its whole duration, the envs of both groups would
        start together and the overlap would be lost.
        """
        ids = range(runner.offset, runner.offset + runner.num_envs)
        explicit: dict[str, Any] = {}
        with self._gate:
            if speculative:
                assert self._stream_policy is not None
                explicit["counters"] = self._stream_policy.stream_state(ids)[1]
            out = self.policy.act(
                runner.obs,
                deterministic=settings.deterministic,
                seeds=seeds,
                env_ids=ids,
                action_chunk=settings.action_chunk,
                **explicit,
            )
            expected = (runner.num_envs, settings.action_chunk, settings.action_dim)
            if tuple(out.actions.shape) != expected:
                raise ValueError(
                    f"PolicyVectorEnv.step: policy.act returned actions of shape {tuple(out.actions.shape)}, "
                    f"expected (N, C, A) = {expected}. Fix: make the policy slice its output to action_chunk "
                    "and the env's action dims."
                )
            actions = out.actions
            if not (runner.is_numpy and isinstance(actions, torch.Tensor) and actions.is_cuda):
                return _Call(out, self._env_actions(runner, actions, settings), explicit.get("counters"))
            host = torch.empty(actions.shape, dtype=actions.dtype, pin_memory=True)
            host.copy_(actions.detach(), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(actions.device))
        copied.synchronize()
        return _Call(out, self._env_actions(runner, host, settings), explicit.get("counters"))

    @staticmethod
    def _env_actions(runner: ChunkRunner, actions: Any, settings: CallSettings) -> Any:
        """Actions in the env's array type (numpy for numpy envs, torch on the env's device otherwise)."""
        if runner.is_numpy:
            host = actions.detach().cpu().numpy() if isinstance(actions, torch.Tensor) else np.asarray(actions)
            return host.astype(settings.action_dtype, copy=False)
        return torch.as_tensor(actions).to(runner.device)

    # --------------------------------------------------------------------------------------------- speculation
    def _collect_and_speculate(self, pending: list[Future[ChunkResult]], settings: CallSettings) -> list[ChunkResult]:
        """Waits for the groups' chunks; as each group but the last finishes, starts its next step's call.

        The last group's call is deferred: started now, its host side (preprocessing, copies, graph launches,
        holding the GIL) would run just as `step` returns and delay the next `step` handing the first group's
        actions to its envs. The next `step` starts it once the first chunk's actions are with the envs.
        """
        group_of = {future: g for g, future in enumerate(pending)}
        results: list[Any] = [None] * len(pending)
        for left, future in enumerate(as_completed(pending), start=1 - len(pending)):
            g = group_of[future]
            results[g] = future.result()
            if left:
                self._speculate(g, settings)
            else:
                self._deferred = {g}
        return results

    def _speculate(self, g: int, settings: CallSettings) -> None:
        """Submits a speculative call on group g's current observation (its streams stay as they are)."""
        assert self.pool is not None and g not in self._speculations
        runner, policy = self.runners[g], self._stream_policy
        assert policy is not None
        version = policy.weight_version
        future = self.pool.submit(self._call, runner, settings, None, True)
        self._speculations[g] = _Speculation(future, runner.obs, settings, version)

    def _take(self, g: int, settings: CallSettings, seeds: torch.Tensor | None) -> _Call | None:
        """Group g's speculative call if it is still valid, its streams then advanced; else None."""
        record = self._speculations.pop(g, None)
        if record is None:
            return None
        try:
            call = record.future.result()
        except Exception:  # called again on this thread, which raises the error where it belongs
            return None
        runner, policy = self.runners[g], self._stream_policy
        assert policy is not None and call.counters is not None
        if not (
            record.obs is runner.obs
            and seeds is None
            and record.settings == settings
            and record.weight_version == call.out.header.weight_version == policy.weight_version
        ):
            return None
        policy.advance_streams(range(runner.offset, runner.offset + runner.num_envs), call.counters)
        return call

    def cancel(self) -> None:
        """Waits for every speculative call and drops it (nothing to undo: such calls change no stream)."""
        self._deferred = set()
        while self._speculations:
            _, record = self._speculations.popitem()
            wait([record.future])

    # --------------------------------------------------------------------------------------------- lifecycle
    def close(self, **kwargs: Any) -> None:
        """Drops speculative calls, stops the threads and closes every group's env (never waits on a dead one)."""
        self.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        for runner in self.runners:
            if self._workers_broken or _dead_workers(runner.env):
                _terminate_workers(runner.env)  # gymnasium's close() would wait on the dead pipe forever
                continue
            try:
                runner.env.close(**kwargs)
            except WORKER_ERRORS:
                _terminate_workers(runner.env)

    def _worker_died(self, method: str, err: BaseException) -> RuntimeError:
        """A clear error for a broken pipe to an async sub-env worker (the worker process died)."""
        dead = [f"sub-env {r.offset + i} ({what})" for r in self.runners for i, what in _dead_workers(r.env, 1.0)]
        return RuntimeError(
            f"PolicyVectorEnv.{method}: a worker process of the async vector env died ({type(err).__name__}: "
            f"{err}); expected every worker alive, got dead: {dead or 'unknown (a pipe broke)'}. The episode "
            "state is lost. Fix: close() this wrapper (it terminates the remaining workers) and build a new env; "
            "exit code -9 (SIGKILL) usually means the out-of-memory killer."
        )


def _dead_workers(env: VectorEnv, wait_s: float = 0.0) -> list[tuple[int, str]]:
    """(index, "pid P, exit code E") of the exited worker processes of an async vector env (none for others).

    `wait_s` bounds a wait for any worker to exit (a killed worker's pipe may report EOF a moment before the
    process can be reaped).
    """
    processes = getattr(env, "processes", None) or []
    live = [p.sentinel for p in processes if p.exitcode is None]
    if wait_s > 0 and live:
        multiprocessing.connection.wait(live, timeout=wait_s)
    return [(i, f"pid {p.pid}, exit code {p.exitcode}") for i, p in enumerate(processes) if p.exitcode is not None]


def _terminate_workers(env: VectorEnv, timeout_s: float = 10.0) -> None:
    """Closes an async vector env whose pipes are broken: terminate live workers, close pipes, mark closed.

    Uses AsyncVectorEnv's public ``processes``/``parent_pipes`` attributes; its own ``close()`` would wait
    for a reply from the dead worker.
    """
    for process in getattr(env, "processes", None) or []:
        if process.is_alive():
            process.terminate()
    for process in getattr(env, "processes", None) or []:
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
            process.join(timeout_s)
    for pipe in getattr(env, "parent_pipes", None) or []:
        if pipe is not None:
            pipe.close()
    env.closed = True
