"""`PolicyVectorEnv`: a policy inside a Gymnasium vector env, one action chunk per step (DESIGN C2, C3).

One `step()` executes C sub-steps on the inner (freezable, see `wrappers.freeze`) vector env. A sub-env
that ends at sub-step k is frozen for the rest of the chunk; at the chunk boundary finished sub-envs are
reset, so the wrapper is a ``SAME_STEP`` autoreset env: the returned observation of a finished env is its
reset observation and ``infos["final_obs"]``/``infos["final_info"]`` hold the terminal ones.

Info keys of a step (``(N, ...)`` arrays of the env's array type unless noted; each with a ``_key`` mask):
  - ``substep_mask`` (N, C) bool: executed sub-steps; ``substep_rewards`` (N, C): their rewards (0 if not).
  - ``policy``: dict of (N, ...) torch tensors on the policy device -- `PolicyOutput.as_info()` of the
    call that produced the actions (from the observation the previous step returned), plus ``final_value``
    (the critic on ``final_obs``; 0 for envs that did not finish).
  - ``success`` (N,) bool: the env's success flag (``success``/``is_success``/...) at its last executed
    sub-step, when the env reports one.
  - ``final_obs`` (batched like the observation; rows of unfinished envs hold their current observation),
    ``final_info`` -- with ``_final_obs``/``_final_info`` marking finished envs.
  - ``episode`` = ``{"r", "l", "success_once", "success_at_end"}`` and ``_episode`` for episodes that ended
    (lengths in env steps), unless ``episode_statistics=False``.
"""

from __future__ import annotations

import multiprocessing.connection
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.error import ClosedEnvironmentError
from gymnasium.vector import AutoresetMode, VectorEnv, VectorWrapper
from gymnasium.vector.utils import batch_space

from policies.base import Policy, PolicyOutput
from wrappers._chunk import ChunkResult, ChunkRunner, concat, take_rows, to_numpy_tree
from wrappers.episode_statistics import EpisodeStatistics
from wrappers.freeze import FREEZABLE_KEY, require_freezable, start_freezing

CANONICAL_KEYS = ("images", "state", "task")
_FIX_OBS = (
    "Fix: build the env with an adapter (wrappers.make_mujoco_env / make_libero_env / make_maniskill_env) or "
    "map observations to {'images': {camera: (N, H, W, 3) uint8}, 'state': (N, S) float, 'task': N strings}."
)


def _check_canonical(keys: Sequence[str], where: str) -> None:
    missing = [key for key in CANONICAL_KEYS if key not in keys]
    if missing:
        raise KeyError(
            f"PolicyVectorEnv: {where} must be canonical (DESIGN C1) with keys {list(CANONICAL_KEYS)}; "
            f"missing {missing}, received keys {sorted(keys)}. {_FIX_OBS}"
        )


@dataclass
class _Prefetch:
    """A policy call started for a group's next step (cross-step prefetch), and what it must match to be used."""

    future: Future[tuple[PolicyOutput, Any]]  # the output and its actions in the env's array type
    obs: Any  # the observation object it acts on (the group's `ChunkRunner.obs` when it started)
    ids: torch.Tensor  # the group's env ids, on the stream table's device
    seeds: torch.Tensor  # stream seeds of `ids` before the call
    counters: torch.Tensor  # stream counters of `ids` before the call
    weight_version: Any  # policy.weight_version when the call started
    deterministic: bool
    action_chunk: int


class PolicyVectorEnv(VectorWrapper):
    """Runs `policy` on a vector env, one C-step action chunk per `step()`.

    Args:
        env: a freezable vector env yielding canonical observations, or a sequence of G of them (env groups:
            the policy acts on group g+1 while group g steps in a thread; results equal one group).
        policy: implements `policies.base.Policy`.
        action_chunk: C, env steps per `step()` (default ``policy.action_horizon``).
        groups: G, checked against the number of envs given (None = infer).
        deterministic: pass ``deterministic=True`` to ``policy.act``.
        episode_statistics: report ``infos["episode"]`` (device-side statistics).
        numpy_infos: convert every info leaf to numpy (gymnasium's ``DictInfoToList`` needs that; costs a
            device-to-host copy of the policy outputs).
        callback: called as ``callback(self, infos)`` after every step (e.g. to sync weights periodically).
        prefetch: cross-step prefetch (needs a policy with a restorable ``streams`` table, see
            `_check_prefetch`): as soon as group g has finished its chunk in ``step(None)``, the policy acts on
            its new observation for the next step in a worker thread, while later groups still step (the group
            that finishes last has its call started by the next ``step(None)``, once the first chunk's actions
            are with its envs; so G=1 gains nothing from prefetch); the next
            ``step(None)`` uses that output if it was made from the same observation, with the current weight
            version and settings, and otherwise recomputes it. A discarded prefetch (stale, failed, or cancelled
            by ``step(actions)``, ``reset()``, ``sync_weights()``, ``close()`` or before the `callback` runs)
            has its envs' random streams restored, so results equal ``prefetch=False`` bit for bit.
        env_concurrency: how many groups' env chunks may run at once (None = G). 1 runs the chunks one after
            the other, in the order their actions were ready. Use it when all groups' envs share one resource (a
            render GPU, a GPU simulator, fewer CPU cores than envs): there, concurrent chunks only share it, and
            when the one that started last gets the larger share, the first one finishes late, its next policy
            call starts late, and the stagger between the groups that overlap needs is lost. Results are
            unchanged; only the timing moves.

    Example:
        >>> from policies.baseline import GaussianPolicy
        >>> from wrappers.adapters.scripted import make_scripted_env
        >>> env = PolicyVectorEnv(make_scripted_env(2), GaussianPolicy(3, action_horizon=4), action_chunk=4)
        >>> obs, info = env.reset(seed=0)
        >>> obs, rewards, terminated, truncated, info = env.step()
        >>> rewards.shape, info["substep_mask"].shape, tuple(info["policy"]["actions"].shape)
        ((2,), (2, 4), (2, 4, 3))
        >>> env.close()
    """

    def __init__(
        self,
        env: VectorEnv | Sequence[VectorEnv],
        policy: Policy,
        action_chunk: int | None = None,
        *,
        groups: int | None = None,
        deterministic: bool = False,
        episode_statistics: bool = True,
        numpy_infos: bool = False,
        callback: Callable[[PolicyVectorEnv, dict[str, Any]], None] | None = None,
        prefetch: bool = False,
        env_concurrency: int | None = None,
    ) -> None:
        envs = self._check_envs(env, groups)
        concurrency = self._check_concurrency(env_concurrency, len(envs))
        if not isinstance(policy, Policy):
            raise TypeError(
                f"PolicyVectorEnv: argument `policy` must implement policies.base.Policy (device, "
                f"action_horizon, act(), value()), got {type(policy).__name__}. Fix: use policies.Pi05Policy "
                "or a baseline from policies.baseline."
            )
        super().__init__(envs[0])
        self.policy = policy
        self.deterministic = deterministic
        self.numpy_infos = numpy_infos
        self.callback = callback
        offsets = np.cumsum([0] + [e.num_envs for e in envs])
        self._runners = [ChunkRunner(e, int(o)) for e, o in zip(envs, offsets)]
        self._num_envs = int(offsets[-1])
        self.action_chunk = self._check_chunk(action_chunk)
        self._setup_spaces(envs[0])
        self._stats = EpisodeStatistics(self._num_envs) if episode_statistics else None
        self._prefetch = bool(prefetch)
        if self._prefetch:
            self._check_prefetch(policy)
        for e in envs:  # all arguments valid: from here on the envs freeze finished sub-envs (C2)
            start_freezing(e)
        # prefetch: up to G chunks and G policy calls at once
        workers = len(envs) * (2 if self._prefetch else 1)
        self._pool = ThreadPoolExecutor(workers, "pve-group") if workers > 1 else None
        self._prefetches: dict[int, _Prefetch] = {}
        self._deferred: set[int] = set()  # groups whose prefetch waits for the next step's first chunk to start
        # chunks beyond `env_concurrency` wait here, in the order they were submitted (Condition wakes FIFO)
        self._env_slots = threading.Semaphore(concurrency) if concurrency < len(envs) else None
        # a policy call and the device-to-host copy of its actions are queued together (see `_act_for_env`)
        self._launch_gate = threading.Lock()
        self._pending_seeds: torch.Tensor | None = None
        self._is_closed = False
        self._workers_broken = False
        self._ready = False
        self.last_output: PolicyOutput | None = None
        """The policy output of the latest `step(None)` (all groups concatenated)."""

    # ------------------------------------------------------------------------------------------ validation
    @staticmethod
    def _check_envs(env: Any, groups: int | None) -> list[VectorEnv]:
        envs = list(env) if isinstance(env, (list, tuple)) else [env]
        for e in envs:
            if not isinstance(e, VectorEnv):
                raise TypeError(
                    f"PolicyVectorEnv: argument `env` must be a gymnasium.vector.VectorEnv (or a list of "
                    f"them), got {type(e).__name__}. Fix: vectorise it, e.g. "
                    "wrappers.freeze.make_freezable_vector_env([make_env] * n) or "
                    "wrappers.make_mujoco_env(...)."
                )
            require_freezable(e)
        if groups is not None and groups != len(envs):
            raise ValueError(
                f"PolicyVectorEnv: argument `groups` is {groups} but {len(envs)} vector env(s) were given. "
                "Fix: pass a list of `groups` vector envs (one per group), e.g. "
                "[make_mujoco_env(num_envs=n // groups) for _ in range(groups)], or leave groups=None."
            )
        return envs

    @staticmethod
    def _check_concurrency(env_concurrency: int | None, groups: int) -> int:
        if env_concurrency is None:
            return groups
        if isinstance(env_concurrency, bool) or not isinstance(env_concurrency, int) or env_concurrency < 1:
            raise ValueError(
                f"PolicyVectorEnv: argument `env_concurrency` must be None or an int >= 1, got "
                f"{env_concurrency!r}. Fix: pass 1 to run the groups' env chunks one at a time, or None to run "
                f"all {groups} group(s) at once."
            )
        return min(env_concurrency, groups)

    @staticmethod
    def _check_prefetch(policy: Policy) -> None:
        """Prefetch needs ``policy.streams.seeds``/``.counters`` (env-id indexed tensors) to undo a discarded call."""
        streams = getattr(policy, "streams", None)
        if not all(isinstance(getattr(streams, name, None), torch.Tensor) for name in ("seeds", "counters")):
            raise TypeError(
                f"PolicyVectorEnv: argument `prefetch=True` needs a policy with a restorable random-stream table "
                f"(`policy.streams.seeds` and `.counters` tensors indexed by env id, DESIGN C3), got "
                f"{type(policy).__name__} without one. Fix: pass prefetch=False, or use policies.Pi05Policy or "
                "policies.baseline.GaussianPolicy (or expose such a `streams` table on the policy)."
            )

    def _check_chunk(self, action_chunk: int | None) -> int:
        horizon = int(self.policy.action_horizon)
        chunk = horizon if action_chunk is None else int(action_chunk)
        if not 1 <= chunk <= horizon:
            raise ValueError(
                f"PolicyVectorEnv: argument `action_chunk` must be in [1, policy.action_horizon={horizon}], "
                f"got {chunk}. Fix: pass action_chunk<={horizon} or use a policy with a longer horizon."
            )
        return chunk

    def _setup_spaces(self, env: VectorEnv) -> None:
        obs_space, act_space = env.single_observation_space, env.single_action_space
        if not isinstance(obs_space, spaces.Dict):
            raise TypeError(
                f"PolicyVectorEnv: env.single_observation_space must be a Dict, got {obs_space}. {_FIX_OBS}"
            )
        _check_canonical(list(obs_space.spaces), "env.single_observation_space")
        if not isinstance(act_space, spaces.Box) or len(act_space.shape) != 1:
            raise TypeError(
                f"PolicyVectorEnv: env.single_action_space must be a 1-D Box (A,), got {act_space}. "
                "Fix: flatten the action space in the adapter."
            )
        self.action_dim = int(act_space.shape[0])
        policy_dim = getattr(self.policy, "action_dim", None)
        if policy_dim is not None and int(policy_dim) != self.action_dim:
            raise ValueError(
                f"PolicyVectorEnv: policy.action_dim={policy_dim} does not match the env's action dims "
                f"{self.action_dim} (env.single_action_space.shape={act_space.shape}). Fix: configure the "
                "policy (or its preset) with the env's action dims, or use the matching env."
            )
        shape = (self.action_chunk, self.action_dim)
        self.single_action_space = spaces.Box(
            np.broadcast_to(act_space.low, shape),
            np.broadcast_to(act_space.high, shape),
            shape,
            act_space.dtype,
        )
        self.action_space = batch_space(self.single_action_space, self._num_envs)
        self.single_observation_space = obs_space
        self.observation_space = batch_space(obs_space, self._num_envs)
        metadata = {k: v for k, v in env.metadata.items() if k != FREEZABLE_KEY}
        self.metadata = {**metadata, "autoreset_mode": AutoresetMode.SAME_STEP}

    def _check_open(self, method: str) -> None:
        if self._is_closed:
            raise ClosedEnvironmentError(
                f"PolicyVectorEnv.{method}: the wrapper is closed (close() was called). "
                "Fix: create a new PolicyVectorEnv around a new env."
            )

    # ------------------------------------------------------------------------------------------ public API
    @property
    def num_envs(self) -> int:
        """N, over all groups."""
        return self._num_envs

    @property
    def groups(self) -> int:
        """G, the number of env groups."""
        return len(self._runners)

    @property
    def prefetch(self) -> bool:
        """Whether cross-step prefetch is on (fixed at construction)."""
        return self._prefetch

    def reset(
        self, *, seed: int | Sequence[int] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Resets the envs; ``seed=s`` gives env i the env seed and policy stream seed s + i.

        ``options["reset_mask"]`` resets only the masked envs (their policy streams are not re-seeded).
        """
        self._check_open("reset")
        self._cancel_prefetches()
        options = dict(options or {})
        mask = options.pop("reset_mask", None)
        seeds = None if seed is None else ([seed + i for i in range(self.num_envs)] if isinstance(seed, int)
                                           else [int(s) for s in seed])  # fmt: skip
        if seeds is not None and len(seeds) != self.num_envs:
            raise ValueError(f"PolicyVectorEnv.reset: `seed` has {len(seeds)} entries, expected {self.num_envs}.")
        obs_parts, info_parts = [], []
        for runner in self._runners:
            rows = slice(runner.offset, runner.offset + runner.num_envs)
            sub = dict(options)
            if mask is not None:
                sub["reset_mask"] = np.asarray(mask, dtype=bool)[rows]
            info: dict[str, Any] = {}
            if mask is None or sub["reset_mask"].any():
                _, info = runner.reset(None if seeds is None else seeds[rows], sub)
            if runner.obs is None:
                raise RuntimeError("PolicyVectorEnv.reset: a `reset_mask` reset needs a full reset() first.")
            _check_canonical(list(runner.obs), "observations from `env`")
            obs_parts.append(runner.obs)
            info_parts.append(info)
        if seeds is not None and mask is None:
            self._pending_seeds = torch.tensor(seeds, dtype=torch.int64)
        if self._stats is not None:
            self._stats.to(self._runners[0].device)
            self._stats.reset(None if mask is None else torch.as_tensor(np.asarray(mask, dtype=bool)))
        self._ready = True
        infos = _concat_infos(info_parts, [r.num_envs for r in self._runners])
        return concat(obs_parts), (to_numpy_tree(infos) if self.numpy_infos else infos)

    def step(self, actions: Any = None) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Executes one action chunk: the policy's (``actions=None``) or explicit (N, C, A) actions."""
        self._check_open("step")
        if not self._ready:
            raise RuntimeError("PolicyVectorEnv.step: call reset() before step().")
        if actions is not None:
            actions = self._check_actions(actions)
            self._cancel_prefetches()
        try:
            results, outputs = self._run_groups(actions)
        except (BrokenPipeError, EOFError, ConnectionResetError) as err:
            self._workers_broken = True
            raise self._worker_died("step", err) from err
        return self._assemble(results, outputs)

    def sync_weights(self, *args: Any, **kwargs: Any) -> Any:
        """Passes through to ``policy.sync_weights(...)`` and returns its report (after cancelling prefetches)."""
        sync = getattr(self.policy, "sync_weights", None)
        if sync is None:
            raise AttributeError(
                f"PolicyVectorEnv.sync_weights: the policy ({type(self.policy).__name__}) has no "
                "sync_weights(). "
                "Fix: use a policy with a weight-sync hook (policies.Pi05Policy)."
            )
        self._cancel_prefetches()
        return sync(*args, **kwargs)

    def close(self, **kwargs: Any) -> None:
        """Closes every group's env; later calls to step()/reset() raise."""
        if self._is_closed:
            return
        self._is_closed = True
        self._cancel_prefetches()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for runner in self._runners:
            if self._workers_broken or _dead_workers(runner.env):
                _terminate_workers(runner.env)  # gymnasium's close() would wait on the dead pipe forever
                continue
            try:
                runner.env.close(**kwargs)
            except (BrokenPipeError, EOFError, ConnectionResetError):
                _terminate_workers(runner.env)

    @property
    def closed(self) -> bool:
        """True after `close()`."""
        return self._is_closed

    @closed.setter
    def closed(self, value: bool) -> None:
        self._is_closed = value

    # ------------------------------------------------------------------------------------------ internals
    def _worker_died(self, method: str, err: BaseException) -> RuntimeError:
        """A clear error for a broken pipe to an async sub-env worker (the worker process died)."""
        dead = [f"sub-env {r.offset + i} ({what})" for r in self._runners for i, what in _dead_workers(r.env, 1.0)]
        return RuntimeError(
            f"PolicyVectorEnv.{method}: a worker process of the async vector env died ({type(err).__name__}: "
            f"{err}); expected every worker alive, got dead: {dead or 'unknown (a pipe broke)'}. The episode "
            "state is lost. Fix: close() this wrapper (it terminates the remaining workers) and build a new env; "
            "exit code -9 (SIGKILL) usually means the out-of-memory killer."
        )

    def _check_actions(self, actions: Any) -> Any:
        shape = tuple(actions.shape) if hasattr(actions, "shape") else np.shape(actions)
        expected = (self.num_envs, self.action_chunk, self.action_dim)
        if shape != expected:
            raise ValueError(
                f"PolicyVectorEnv.step: argument `actions` must have shape (N, C, A) = {expected}, "
                f"got {shape}. "
                "Fix: pass one chunk per env, or step() / step(None) to let the policy act."
            )
        return actions

    def _act(self, runner: ChunkRunner, pending_seeds: bool = True) -> PolicyOutput:
        """One policy call on the group's current observation (with the seeds of a seeded reset, if pending)."""
        ids = range(runner.offset, runner.offset + runner.num_envs)
        seeds = None
        if pending_seeds and self._pending_seeds is not None:
            seeds = self._pending_seeds[runner.offset : runner.offset + runner.num_envs]
        out = self.policy.act(
            runner.obs,
            deterministic=self.deterministic,
            seeds=seeds,
            env_ids=ids,
            action_chunk=self.action_chunk,
        )
        expected = (runner.num_envs, self.action_chunk, self.action_dim)
        if tuple(out.actions.shape) != expected:
            raise ValueError(
                f"PolicyVectorEnv.step: policy.act returned actions of shape {tuple(out.actions.shape)}, "
                f"expected (N, C, A) = {expected}. Fix: make the policy slice its output to action_chunk and "
                "the env's action dims."
            )
        return out

    def _act_for_env(self, runner: ChunkRunner, pending_seeds: bool = True) -> tuple[PolicyOutput, Any]:
        """One policy call and its actions in the env's array type.

        For numpy envs the device-to-host copy of the actions is queued right behind the call, under a gate that
        the next call (another group's prefetch) waits for, and only that copy is waited for. Otherwise a later
        policy call queued on the same CUDA stream first would delay these actions by its whole duration: the
        envs of both groups would then start together and the overlap would be lost.
        """
        with self._launch_gate:
            out = self._act(runner, pending_seeds)
            actions = out.actions
            if not (runner.is_numpy and isinstance(actions, torch.Tensor) and actions.is_cuda):
                return out, self._env_actions(runner, actions)
            host = torch.empty(actions.shape, dtype=actions.dtype, pin_memory=True)
            host.copy_(actions.detach(), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(actions.device))
        copied.synchronize()
        return out, self._env_actions(runner, host)

    def _env_actions(self, runner: ChunkRunner, actions: Any) -> Any:
        """Actions in the env's array type (numpy for numpy envs, torch on the env's device otherwise)."""
        if runner.is_numpy:
            host = actions.detach().cpu().numpy() if isinstance(actions, torch.Tensor) else np.asarray(actions)
            return host.astype(self.single_action_space.dtype, copy=False)
        return torch.as_tensor(actions).to(runner.device)

    def _run_groups(self, actions: Any) -> tuple[list[ChunkResult], list[PolicyOutput]]:
        """Policy on group g (main thread, or its prefetched output) while other groups step in worker threads.

        With prefetches, a group's chunk starts as soon as its prefetched call is done, in the order the calls
        finish (not in group order): waiting for group 0's call while group 1's actions are ready would start
        both groups' envs together at every step and lock the groups in step, with nothing to overlap.
        """
        count = len(self._runners)
        outputs: list[PolicyOutput | None] = [None] * count
        pending: list[Any] = [None] * count
        deferred, self._deferred = (self._deferred if actions is None else set()), set()
        for g in self._group_order(actions is None, deferred):
            runner = self._runners[g]
            if actions is None:
                out, env_actions = self._take_prefetch(g, runner) or self._act_for_env(runner)
                outputs[g] = out
                deferred.discard(g)
            else:
                env_actions = self._env_actions(runner, actions[runner.offset : runner.offset + runner.num_envs])
            if self._pool is None:
                pending[g] = runner.run(env_actions)
                continue
            started = threading.Event() if deferred else None
            pending[g] = self._pool.submit(self._run_chunk, runner, env_actions, started)
            if started is not None:  # the deferred calls start once this chunk's actions are with its envs
                started.wait()
                for d in sorted(deferred):
                    self._start_prefetch(d, self._runners[d])
                deferred.clear()
        if actions is None:
            self._pending_seeds = None
        acted = outputs if actions is None else []  # explicit actions: no policy outputs
        if self._prefetch and actions is None:
            return self._collect_and_prefetch(pending), acted
        results = [p if isinstance(p, ChunkResult) else p.result() for p in pending]
        return results, acted

    def _run_chunk(self, runner: ChunkRunner, env_actions: Any, started: threading.Event | None) -> ChunkResult:
        """`runner.run` in a worker thread, holding one of the `env_concurrency` slots if they are limited."""
        if self._env_slots is None:
            return runner.run(env_actions, started)
        with self._env_slots:
            return runner.run(env_actions, started)

    def _group_order(self, policy_step: bool, deferred: set[int]) -> Iterator[int]:
        """Group indices in the order their chunks should start.

        Groups whose prefetched call has finished come first, then groups without a prefetch (acted on now, on
        this thread), then the others as their calls finish. A group in `deferred` (its call starts after the
        first chunk has, see `_collect_and_prefetch`) is not acted on here while a prefetch is still running.
        """
        remaining = list(range(len(self._runners)))
        while remaining:
            if not (policy_step and self._prefetches):
                yield remaining.pop(0)
                continue
            waiting = {g: self._prefetches[g].future for g in remaining if g in self._prefetches}
            ready = [g for g, future in waiting.items() if future.done()]
            g = ready[0] if ready else next((g for g in remaining if g not in waiting and g not in deferred), None)
            if g is None and not waiting:
                g = remaining[0]
            if g is None:
                wait(list(waiting.values()), return_when=FIRST_COMPLETED)
                continue
            remaining.remove(g)
            yield g

    # ------------------------------------------------------------------------------------- cross-step prefetch
    def _collect_and_prefetch(self, pending: list[Future[ChunkResult]]) -> list[ChunkResult]:
        """Waits for the groups' chunks; as each group but the last finishes, starts its next step's policy call.

        The last group's call is deferred: started now, its host side (preprocessing, copies, graph launches,
        holding the GIL) would run just as `step` returns and delay the next `step` handing the first group's
        actions to its envs (measured on the H200: ~4 ms of every step). The next `step` starts it once the
        first chunk's actions are with the envs (`ChunkRunner.run`'s `started`).
        """
        group_of = {future: g for g, future in enumerate(pending)}
        results: list[ChunkResult | None] = [None] * len(pending)
        for left, future in enumerate(as_completed(pending), start=1 - len(pending)):
            g = group_of[future]
            results[g] = future.result()
            if left:
                self._start_prefetch(g, self._runners[g])
            else:
                self._deferred = {g}
        return results  # type: ignore[return-value]

    def _start_prefetch(self, g: int, runner: ChunkRunner) -> None:
        """Snapshots the group's random streams and submits `policy.act` on its current observation."""
        assert self._pool is not None and g not in self._prefetches
        table = self.policy.streams  # type: ignore[attr-defined]
        ids = torch.arange(runner.offset, runner.offset + runner.num_envs, device=table.seeds.device)
        seeds, counters = _stream_rows(table, ids)
        self._prefetches[g] = _Prefetch(
            future=self._pool.submit(self._act_for_env, runner, False),  # seeds of a seeded reset: reset() cancels
            obs=runner.obs,
            ids=ids,
            seeds=seeds,
            counters=counters,
            weight_version=getattr(self.policy, "weight_version", None),
            deterministic=self.deterministic,
            action_chunk=self.action_chunk,
        )

    def _take_prefetch(self, g: int, runner: ChunkRunner) -> tuple[PolicyOutput, Any] | None:
        """The prefetched (output, env actions) of group g if still valid; else None (its streams restored)."""
        record = self._prefetches.pop(g, None)
        if record is None:
            return None
        try:
            out, env_actions = record.future.result()
        except Exception:  # recomputed on the main thread, which raises the error where it belongs
            out = env_actions = None
        version = getattr(self.policy, "weight_version", None)
        valid = (
            out is not None
            and record.obs is runner.obs
            and self._pending_seeds is None
            and record.deterministic == self.deterministic
            and record.action_chunk == self.action_chunk
            and record.weight_version == version
            and (version is None or out.header.weight_version == version)
        )
        if valid:
            return out, env_actions
        self._restore_streams(record)
        return None

    def _cancel_prefetches(self) -> None:
        """Waits for every pending prefetch, restores its envs' random streams and drops it (and the deferred)."""
        self._deferred = set()
        while self._prefetches:
            _, record = self._prefetches.popitem()
            try:
                record.future.result()
            except Exception:  # a failed call is discarded like any other; its streams are restored below
                pass
            self._restore_streams(record)

    def _restore_streams(self, record: _Prefetch) -> None:
        """Puts back the seeds/counters of the prefetch's env ids (only those rows: other groups use other ids)."""
        table = self.policy.streams  # type: ignore[attr-defined]
        size = table.seeds.shape[0]
        keep = record.ids < size
        table.seeds[record.ids[keep]] = record.seeds[keep].to(table.seeds.device)
        table.counters[record.ids[keep]] = record.counters[keep].to(table.counters.device)

    def _final_values(self, result: ChunkResult, group: ChunkRunner) -> torch.Tensor:
        """(n,) critic on the terminal observations of finished envs, 0 elsewhere."""
        device = self.policy.device
        done = result.done
        if not group.is_numpy:  # no host sync: evaluate every row and mask
            ids = range(group.offset, group.offset + group.num_envs)
            values = self.policy.value(result.final_obs, env_ids=ids)
            return torch.where(done.to(values.device), values, 0.0)
        rows = np.flatnonzero(done.numpy())
        values = torch.zeros(group.num_envs, device=device)
        if rows.size:
            sub_obs = take_rows(result.final_obs, rows)
            values[torch.as_tensor(rows, device=device)] = self.policy.value(
                sub_obs, env_ids=(rows + group.offset).tolist()
            ).to(device, torch.float32)
        return values

    def _assemble(
        self, results: list[ChunkResult], outputs: list[PolicyOutput]
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Concatenates group results into the Gymnasium 5-tuple and builds the info dict."""
        cat = lambda name: torch.cat([getattr(r, name).to(results[0].rewards.device) for r in results])
        rewards, terminated, truncated = cat("rewards"), cat("terminated"), cat("truncated")
        substep_mask, done = cat("substep_mask"), terminated | truncated
        infos = _concat_infos([r.info for r in results], [r.rewards.shape[0] for r in results])
        all_true = torch.ones_like(done)
        infos.update(substep_mask=substep_mask, _substep_mask=all_true)
        infos.update(substep_rewards=cat("substep_rewards"), _substep_rewards=all_true)
        policy_info = {}
        if outputs:
            self.last_output = _concat_outputs(outputs)
            policy_info = self.last_output.as_info()
        policy_info["final_value"] = torch.cat([self._final_values(r, g) for r, g in zip(results, self._runners)])
        # The mask lives with the env's arrays (numpy envs get a numpy mask); the dict stays on the policy device.
        infos.update(policy=policy_info, _policy=torch.ones_like(done))
        infos.update(final_obs=concat([r.final_obs for r in results]), _final_obs=done)
        infos.update(final_info=_concat_infos([r.final_info for r in results], [len(r.done) for r in results]))
        infos["_final_info"] = done
        success_any, success_end = self._success(results)
        if success_end is not None:
            infos.update(success=success_end, _success=all_true)
        if self._stats is not None:
            episode = self._stats.update(rewards, substep_mask.sum(1), done, success_any, success_end)
            if not self._runners[0].is_numpy or bool(done.any()):  # numpy envs: only when one ended
                infos.update(episode=episode, _episode=done)
        if self._runners[0].is_numpy:
            rewards, terminated, truncated = rewards.numpy(), terminated.numpy(), truncated.numpy()
            infos = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in infos.items()}
            if "episode" in infos:
                infos["episode"] = to_numpy_tree(infos["episode"])
        if self.numpy_infos:
            infos = to_numpy_tree(infos)
        obs = concat([r.obs for r in results])
        if self.callback is not None:
            self._cancel_prefetches()  # the callback may change the policy (weights, streams, settings)
            self.callback(self, infos)
        return obs, rewards, terminated, truncated, infos

    def _success(self, results: list[ChunkResult]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if all(r.success_any is None for r in results):
            return None, None
        zeros = lambda r: torch.zeros_like(r.done)
        success_any = torch.cat([zeros(r) if r.success_any is None else r.success_any for r in results])
        success_end = torch.cat([zeros(r) if r.success_end is None else r.success_end for r in results])
        return success_any, success_end


def _stream_rows(table: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the (seeds, counters) rows `ids` of a stream table.

    Rows the table has not grown to yet read as the defaults it would grow them with (seed = env id, counter 0).
    """
    size = table.seeds.shape[0]
    inside = ids < size
    rows = torch.where(inside, ids, 0)
    seeds = torch.where(inside, table.seeds[rows], ids)
    counters = torch.where(inside, table.counters[rows], 0)
    return seeds.clone(), counters.clone()


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


def _concat_outputs(outputs: list[PolicyOutput]) -> PolicyOutput:
    if len(outputs) == 1:
        return outputs[0]
    cat = lambda name: None if getattr(outputs[0], name) is None else torch.cat([getattr(o, name) for o in outputs])
    return PolicyOutput(
        actions=cat("actions"),
        log_prob=cat("log_prob"),
        log_prob_elements=cat("log_prob_elements"),
        values=cat("values"),
        model_actions=cat("model_actions"),
        chains=cat("chains"),
        denoise_inds=cat("denoise_inds"),
        inputs=[o.inputs for o in outputs] if outputs[0].inputs is not None else None,
        header=outputs[0].header,
    )


def _concat_infos(infos: list[Mapping[str, Any]], sizes: list[int]) -> dict[str, Any]:
    """Concatenates per-group vector info dicts (keys missing in a group get zeros and a False mask)."""
    if len(infos) == 1:
        return dict(infos[0])
    out: dict[str, Any] = {}
    keys = {k for info in infos for k in info if not k.startswith("_")}
    for key in keys:
        values = [info.get(key) for info in infos]
        if any(isinstance(v, Mapping) for v in values):
            out[key] = _concat_infos([v if isinstance(v, Mapping) else {} for v in values], sizes)
        else:
            template = next(v for v in values if v is not None)
            filled = [v if v is not None else _zeros_rows(template, n) for v, n in zip(values, sizes)]
            out[key] = concat(filled)
        masks = [info.get(f"_{key}", np.full(n, key in info, bool)) for info, n in zip(infos, sizes)]
        out[f"_{key}"] = concat([m.cpu().numpy() if isinstance(m, torch.Tensor) else np.asarray(m) for m in masks])
    return out


def _zeros_rows(template: Any, n: int) -> Any:
    if isinstance(template, torch.Tensor):
        return torch.zeros((n, *template.shape[1:]), dtype=template.dtype, device=template.device)
    template = np.asarray(template)
    return np.zeros((n, *template.shape[1:]), dtype=template.dtype)
