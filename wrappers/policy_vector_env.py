"""`PolicyVectorEnv`: a policy inside a Gymnasium vector env, one action chunk per step (DESIGN C2, C3).

One `step()` executes C sub-steps on the inner (freezable, see `wrappers.freeze`) vector env(s); env groups
and cross-step prefetch (when the policy calls and env chunks run) live in `wrappers.pipeline`. A sub-env
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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.error import ClosedEnvironmentError
from gymnasium.vector import AutoresetMode, VectorEnv, VectorWrapper
from gymnasium.vector.utils import batch_space

from policies.base import BatchSizePolicy, Policy, PolicyOutput, StreamPolicy
from policies.checks import check_int
from wrappers._chunk import ChunkResult, ChunkRunner, concat, take_rows, to_numpy_tree
from wrappers.episode_statistics import EpisodeStatistics
from wrappers.freeze import FREEZABLE_KEY, require_freezable, set_read_every, start_freezing
from wrappers.pipeline import CallSettings, EnvPipeline

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


def enable_freezing(envs: Sequence[VectorEnv], chunk: int) -> None:
    """The one place where `PolicyVectorEnv` switches on the freezing of the envs it drives (DESIGN C2).

    It also tells each env its reading schedule (`wrappers.freeze.set_read_every`): the policy reads the
    observation of every `chunk`-th step since a reset, so an env that renders on demand skips the rest.

    Chunk execution needs a finished sub-env to stay untouched until the chunk boundary, while a vector env
    used on its own keeps the autoreset mode it declares; every env here has passed `require_freezable`, and
    `wrappers.freeze.start_freezing` switches it over. It runs after every argument was checked, so a refused
    construction leaves the envs as they were.
    """
    for env in envs:
        start_freezing(env)
        set_read_every(env, chunk)


class PolicyVectorEnv(VectorWrapper):
    """Runs `policy` on a vector env, one C-step action chunk per `step()`.

    Args:
        env: a freezable vector env yielding canonical observations, or a sequence of G of them (env groups:
            the policy acts on group g+1 while group g steps in a thread; results equal one group).
        policy: implements `policies.base.Policy`. A `policies.base.BatchSizePolicy` is told, here, the batch
            sizes it will be called with (N, or each group's size).
        action_chunk: C, env steps per `step()` (default ``policy.action_horizon``).
        groups: G, checked against the number of envs given (None = infer).
        deterministic: pass ``deterministic=True`` to ``policy.act``.
        episode_statistics: report ``infos["episode"]`` (device-side statistics).
        numpy_infos: convert every info leaf to numpy (gymnasium's ``DictInfoToList`` needs that; costs a
            device-to-host copy of the policy outputs).
        callback: called as ``callback(self, infos)`` after every step (e.g. to sync weights periodically).
        prefetch: cross-step prefetch (needs a `policies.base.StreamPolicy`): as soon as group g has finished
            its chunk in ``step(None)``, the policy acts on its new observation for the next step in a worker
            thread, with its envs' stream counters passed explicitly, so the call changes nothing until the
            next ``step(None)`` uses it -- if it was made from the same observation, with the current weight
            version and settings; otherwise the policy acts again. A discarded call (stale, failed, or
            cancelled by ``step(actions)``, ``reset()``, ``sync_weights()``, ``close()`` or before the
            `callback` runs) leaves nothing to undo, so results equal ``prefetch=False`` bit for bit. The group
            that finishes last has its call started by the next ``step(None)``, so G=1 gains nothing from it
            (see `wrappers.pipeline.EnvPipeline`).
        env_concurrency: how many groups' env chunks may run at once (None = G); 1 runs them one after the
            other, for groups whose envs share one resource (see `wrappers.pipeline.EnvPipeline`). Results are
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
        self._num_envs = sum(e.num_envs for e in envs)
        self._action_chunk = self._check_chunk(action_chunk)
        self._setup_spaces(envs[0])
        self._pipeline = EnvPipeline(envs, policy, prefetch=prefetch, env_concurrency=env_concurrency)
        enable_freezing(envs, self._action_chunk)
        if isinstance(policy, BatchSizePolicy):
            policy.declare_batch_sizes(self._pipeline.batch_sizes)
        self._stats = EpisodeStatistics(self._num_envs) if episode_statistics else None
        self._pending_seeds: torch.Tensor | None = None
        self._is_closed = False
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

    def _check_chunk(self, action_chunk: int | None) -> int:
        horizon = int(self.policy.action_horizon)
        fix = f"pass 1 <= action_chunk <= {horizon}, or use a policy with a longer horizon"
        if action_chunk is None:
            return horizon
        return check_int(f"PolicyVectorEnv: argument `action_chunk` (policy.action_horizon={horizon})",
                         action_chunk, 1, horizon, fix=fix)  # fmt: skip

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
    def action_chunk(self) -> int:
        """C, env steps per `step()`; fixed at construction (the envs were told to render every C-th step)."""
        return self._action_chunk

    @property
    def num_envs(self) -> int:
        """N, over all groups."""
        return self._num_envs

    @property
    def groups(self) -> int:
        """G, the number of env groups."""
        return len(self._pipeline.runners)

    @property
    def prefetch(self) -> bool:
        """Whether cross-step prefetch is on (fixed at construction)."""
        return self._pipeline.prefetch

    def reset(
        self, *, seed: int | Sequence[int] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Resets the envs; ``seed=s`` gives env i the env seed and policy stream seed s + i.

        ``options["reset_mask"]`` resets only the masked envs (their policy streams are not re-seeded).
        ``options["stream_seeds"]`` (N ints) seeds the policy streams apart from the env seeds, e.g. envs that
        start from one state (equal seeds) but draw their own noise (GRPO's groups).
        """
        self._check_open("reset")
        options = dict(options or {})
        mask = options.pop("reset_mask", None)
        streams = options.pop("stream_seeds", None)
        if streams is not None and (mask is not None or len(streams) != self.num_envs):
            raise ValueError(
                f"PolicyVectorEnv.reset: options['stream_seeds'] must hold one seed per env ({self.num_envs}) in a "
                f"reset of all envs; got {len(streams)} seeds, reset_mask {'given' if mask is not None else 'None'}. "
                "Fix: pass N stream seeds without a reset_mask."
            )
        mask = None if mask is None else np.asarray(mask, dtype=bool)
        seeds = None if seed is None else ([seed + i for i in range(self.num_envs)] if isinstance(seed, int)
                                           else [int(s) for s in seed])  # fmt: skip
        if seeds is not None and len(seeds) != self.num_envs:
            raise ValueError(f"PolicyVectorEnv.reset: `seed` has {len(seeds)} entries, expected {self.num_envs}.")
        obs_parts, info_parts = self._pipeline.reset(seeds, options, mask)
        for obs in obs_parts:
            _check_canonical(list(obs), "observations from `env`")
        if streams is not None:
            self._pending_seeds = torch.tensor([int(v) for v in streams], dtype=torch.int64)
        elif seeds is not None and mask is None:
            self._pending_seeds = torch.tensor(seeds, dtype=torch.int64)
        if self._stats is not None:
            self._stats.to(self._pipeline.runners[0].device)
            self._stats.reset(None if mask is None else torch.as_tensor(mask))
        self._ready = True
        infos = _concat_infos(info_parts, [r.num_envs for r in self._pipeline.runners])
        return concat(obs_parts), (to_numpy_tree(infos) if self.numpy_infos else infos)

    def step(self, actions: Any = None) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Executes one action chunk: the policy's (``actions=None``) or explicit (N, C, A) actions."""
        self._check_open("step")
        if not self._ready:
            raise RuntimeError("PolicyVectorEnv.step: call reset() before step().")
        if actions is not None:
            actions = self._check_actions(actions)
        settings = CallSettings(self.deterministic, self.action_chunk, self.action_dim, self.single_action_space.dtype)
        results, outputs = self._pipeline.step(actions, settings, self._pending_seeds)
        if actions is None:
            self._pending_seeds = None
        return self._assemble(results, outputs)

    def sync_weights(self, *args: Any, **kwargs: Any) -> Any:
        """Passes through to ``policy.sync_weights(...)`` and returns its report (after cancelling prefetches)."""
        if not isinstance(self.policy, StreamPolicy):
            raise AttributeError(
                f"PolicyVectorEnv.sync_weights: the policy ({type(self.policy).__name__}) does not implement "
                "policies.base.StreamPolicy (weight_version, sync_weights(), stream_state(), advance_streams()). "
                "Fix: use a policy with a weight-sync hook (policies.Pi05Policy)."
            )
        self._pipeline.cancel()
        return self.policy.sync_weights(*args, **kwargs)

    def close(self, **kwargs: Any) -> None:
        """Closes every group's env; later calls to step()/reset() raise."""
        if self._is_closed:
            return
        self._is_closed = True
        self._pipeline.close(**kwargs)

    @property
    def closed(self) -> bool:
        """True after `close()`."""
        return self._is_closed

    @closed.setter
    def closed(self, value: bool) -> None:
        self._is_closed = value

    # ------------------------------------------------------------------------------------------ internals
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

    def _final_values(self, result: ChunkResult, group: ChunkRunner) -> torch.Tensor:
        """(n,) critic on the terminal observations of finished envs, 0 elsewhere.

        Only finished rows are evaluated (reading the done mask costs device envs one small sync per chunk, which
        the next policy call waits for anyway; the critic on every row would cost a prefix pass at the full batch
        per chunk). They are padded with unfinished rows to a power of two, so the critic meets at most
        log2(n) + 1 batch sizes however many envs finish (a graph-capturing policy captures each size once);
        ``value()`` consumes no random stream, so the padding rows change nothing.
        """
        device = self.policy.device
        done = result.done.cpu().numpy()
        rows = np.flatnonzero(done)
        values = torch.zeros(group.num_envs, device=device)
        finished = rows.size
        if finished:
            size = min(1 << (finished - 1).bit_length(), group.num_envs)
            padded = np.concatenate([rows, np.flatnonzero(~done)[: size - finished]])
            critic = self.policy.value(take_rows(result.final_obs, padded), env_ids=(padded + group.offset).tolist())
            values[torch.as_tensor(rows, device=device)] = critic[:finished].to(device, torch.float32)
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
        finals = [self._final_values(r, g) for r, g in zip(results, self._pipeline.runners)]
        policy_info["final_value"] = torch.cat(finals)
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
            if not self._pipeline.runners[0].is_numpy or bool(done.any()):  # numpy envs: only when one ended
                infos.update(episode=episode, _episode=done)
        if self._pipeline.runners[0].is_numpy:
            rewards, terminated, truncated = rewards.numpy(), terminated.numpy(), truncated.numpy()
            infos = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in infos.items()}
            if "episode" in infos:
                infos["episode"] = to_numpy_tree(infos["episode"])
        if self.numpy_infos:
            infos = to_numpy_tree(infos)
        obs = concat([r.obs for r in results])
        if self.callback is not None:
            self._pipeline.cancel()  # the callback may change the policy (weights, streams, settings)
            self.callback(self, infos)
        return obs, rewards, terminated, truncated, infos

    def _success(self, results: list[ChunkResult]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if all(r.success_any is None for r in results):
            return None, None
        zeros = lambda r: torch.zeros_like(r.done)
        success_any = torch.cat([zeros(r) if r.success_any is None else r.success_any for r in results])
        success_end = torch.cat([zeros(r) if r.success_end is None else r.success_end for r in results])
        return success_any, success_end


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
