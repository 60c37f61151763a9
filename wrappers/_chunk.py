"""Chunk execution over one freezable inner vector env (DESIGN C2), and the tree helpers it needs.

Private to `wrappers.policy_vector_env`. Observations and infos may hold numpy arrays (Sync/AsyncVectorEnv),
torch tensors on any device (ManiSkill) and per-env sequences (the ``task`` strings); bookkeeping is done
with torch tensors on the env's device (CPU for numpy envs), so GPU observations never visit the host.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gymnasium.vector import AutoresetMode, VectorEnv

from wrappers.freeze import THAW_OPTION

SUCCESS_KEYS = ("success", "is_success", "succeed", "solved")
"""Info keys read as the success flag, in order of preference."""
FINAL_OBS_KEYS = ("final_obs", "final_observation")
"""SAME_STEP keys for terminal observations (gymnasium 1.x, and the 0.29 naming ManiSkill keeps)."""
FINAL_INFO_KEY = "final_info"
_FINAL_KEYS = frozenset({*FINAL_OBS_KEYS, FINAL_INFO_KEY, *(f"_{k}" for k in (*FINAL_OBS_KEYS, FINAL_INFO_KEY))})


# ----------------------------------------------------------------------------------------------------------
# Tree helpers: leaves are np.ndarray, torch.Tensor or per-env sequences (tuple/list of N items).
# ----------------------------------------------------------------------------------------------------------


def _view_mask(mask: torch.Tensor, leaf: Any) -> Any:
    """`mask` (N,) shaped to broadcast against `leaf` (N, ...), in the leaf's array type."""
    if isinstance(leaf, torch.Tensor):
        return mask.to(leaf.device).view(-1, *([1] * (leaf.dim() - 1)))
    return mask.cpu().numpy().reshape(-1, *([1] * (np.ndim(leaf) - 1)))


def rows_where(mask: torch.Tensor, new: Any, old: Any) -> Any:
    """Row-wise ``new if mask else old`` over matching trees."""
    if isinstance(new, Mapping):
        return {key: rows_where(mask, new[key], old[key]) for key in new}
    if isinstance(new, torch.Tensor):
        return torch.where(_view_mask(mask, new), new, old.to(new.device))
    if isinstance(new, np.ndarray):
        return np.where(_view_mask(mask, new), new, np.asarray(old))
    if isinstance(new, (tuple, list)):
        return tuple(n if m else o for n, m, o in zip(new, mask.tolist(), old))
    raise TypeError(f"rows_where: unsupported leaf type {type(new).__name__}")


def take_rows(tree: Any, index: np.ndarray) -> Any:
    """Rows `index` of every leaf."""
    if isinstance(tree, Mapping):
        return {key: take_rows(value, index) for key, value in tree.items()}
    if isinstance(tree, torch.Tensor):
        return tree[torch.as_tensor(index, device=tree.device)]
    if isinstance(tree, np.ndarray):
        return tree[index]
    return tuple(tree[i] for i in index)


def concat(trees: Sequence[Any]) -> Any:
    """Concatenates matching trees along the env axis."""
    first = trees[0]
    if len(trees) == 1:
        return first
    if isinstance(first, Mapping):
        return {key: concat([tree[key] for tree in trees]) for key in first}
    if isinstance(first, torch.Tensor):
        return torch.cat([tree.to(first.device) for tree in trees])
    if isinstance(first, np.ndarray):
        return np.concatenate(trees)
    return tuple(item for tree in trees for item in tree)


def set_row(tree: Any, i: int, single: Any) -> Any:
    """A copy of the batched `tree` whose row `i` is the single-env `single`."""
    if isinstance(tree, Mapping):
        return {key: set_row(value, i, single[key]) for key, value in tree.items()}
    if isinstance(tree, torch.Tensor):
        out = tree.clone()
        out[i] = torch.as_tensor(single, device=tree.device)
        return out
    if isinstance(tree, np.ndarray):
        out = tree.copy()
        out[i] = single
        return out
    items = list(tree)
    items[i] = single
    return tuple(items)


def to_numpy_tree(tree: Any) -> Any:
    """Torch leaves -> numpy, sequences -> object arrays (what gymnasium's DictInfoToList asserts)."""
    if isinstance(tree, Mapping):
        return {key: to_numpy_tree(value) for key, value in tree.items()}
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy()
    if isinstance(tree, (tuple, list)):
        out = np.empty(len(tree), dtype=object)
        out[:] = list(tree)
        return out
    return tree


def _as_bool(value: Any, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value).to(
        device=device, dtype=torch.bool
    )


def merge_info_rows(acc: dict[str, Any], new: Mapping[str, Any], mask: torch.Tensor) -> dict[str, Any]:
    """Copies the rows `mask` of a vector info dict `new` into `acc` (keeping Gymnasium ``_key`` masks)."""
    for key, value in new.items():
        if key.startswith("_") or key in _FINAL_KEYS:
            continue
        present = new.get(f"_{key}")
        rows = mask if present is None else mask & _as_bool(present, mask.device)
        if isinstance(value, Mapping):
            acc[key] = merge_info_rows(dict(acc.get(key, {})), value, rows)
            leaf: Any = np.zeros(mask.shape[0], bool)
        elif isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim and value.shape[0] == mask.shape[0]:
            old = acc.get(key)
            if old is None:
                old = torch.zeros_like(value) if isinstance(value, torch.Tensor) else np.zeros_like(value)
            acc[key] = rows_where(rows, value, old)
            leaf = value
        else:  # not a per-env array: keep as is
            acc[key] = value
            continue
        flag = acc.get(f"_{key}")
        if flag is None:
            flag = rows if isinstance(leaf, torch.Tensor) else rows.cpu().numpy()
        else:
            flag = flag | (rows.to(flag.device) if isinstance(flag, torch.Tensor) else rows.cpu().numpy())
        acc[f"_{key}"] = flag
    return acc


def success_flags(info: Mapping[str, Any], device: torch.device) -> torch.Tensor | None:
    """(N,) bool from the first success key present (rows without the key are False), or None."""
    for key in SUCCESS_KEYS:
        if key in info:
            flags = _as_bool(info[key], device)
            if f"_{key}" in info:
                flags = flags & _as_bool(info[f"_{key}"], device)
            return flags
    return None


# ----------------------------------------------------------------------------------------------------------
# One group: an inner vector env and its chunk execution.
# ----------------------------------------------------------------------------------------------------------


@dataclass
class ChunkResult:
    """What one chunk over a group returns (tensors on the env's device; `obs`/`info` in the env's types)."""

    obs: Any
    info: dict[str, Any]
    rewards: torch.Tensor  # (n,) float64, summed over executed sub-steps
    terminated: torch.Tensor  # (n,) bool
    truncated: torch.Tensor  # (n,) bool
    substep_mask: torch.Tensor  # (n, C) bool, executed sub-steps
    substep_rewards: torch.Tensor  # (n, C) float64, 0 where not executed
    final_obs: Any  # rows of finished envs hold their terminal observation
    final_info: dict[str, Any]
    success_any: torch.Tensor | None  # (n,) bool, success at any executed sub-step
    success_end: torch.Tensor | None  # (n,) bool, success at the last executed sub-step

    @property
    def done(self) -> torch.Tensor:
        """(n,) bool, envs whose episode ended in the chunk (they have been reset)."""
        return self.terminated | self.truncated


class ChunkRunner:
    """Executes C sub-steps on one freezable vector env, freezing finished sub-envs, then resets them."""

    def __init__(self, env: VectorEnv, offset: int) -> None:
        self.env = env
        self.offset = offset
        self.num_envs = env.num_envs
        self.mode = AutoresetMode(env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))
        self.is_numpy = True
        self.device = torch.device("cpu")
        self.obs: Any = None

    def _t(self, x: Any) -> torch.Tensor:
        return x.to(self.device) if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))

    def reset(self, seed: list[int | None] | None, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Full (or ``reset_mask``) reset with the thaw option; remembers the observation."""
        obs, info = self.env.reset(seed=seed, options={**options, THAW_OPTION: True})
        state = obs["state"] if isinstance(obs, Mapping) and "state" in obs else None
        self.is_numpy = not isinstance(state, torch.Tensor)
        self.device = state.device if isinstance(state, torch.Tensor) else torch.device("cpu")
        self.obs = obs
        return obs, info

    def _terminal_obs(self, obs: Any, info: Mapping[str, Any], ended: torch.Tensor) -> Any:
        """Terminal observations: `obs`, or the SAME_STEP ``final_obs``/``final_observation`` when present."""
        key = next((k for k in FINAL_OBS_KEYS if k in info), None)
        if key is None:
            return obs
        final = info[key]
        if isinstance(final, np.ndarray) and final.dtype == object:  # per-env objects (Sync/Async)
            present = info.get(f"_{key}", np.ones(self.num_envs, bool))
            for i in np.flatnonzero(np.asarray(present) & ended.cpu().numpy()):
                obs = set_row(obs, int(i), final[i])
            return obs
        return final  # batched (ManiSkill)

    def run(self, actions: Any, started: threading.Event | None = None) -> ChunkResult:
        """Runs one chunk of (n, C, A) actions (numpy for numpy envs, torch on the env device otherwise).

        `started` is set once the first sub-step's actions were handed to the envs (after ``step_async`` for an
        env that has it, e.g. `AsyncVectorEnv`; at once otherwise), or when the chunk fails before that.
        """
        try:
            return self._run(actions, started)
        finally:
            if started is not None:
                started.set()

    def _step(self, actions: Any, started: threading.Event | None) -> tuple[Any, ...]:
        """`env.step`; the first call sets `started` once the actions are with the envs (after ``step_async``)."""
        if started is None or started.is_set():
            return self.env.step(actions)
        if not hasattr(self.env, "step_async"):
            started.set()
            return self.env.step(actions)
        self.env.step_async(actions)
        started.set()
        return self.env.step_wait()

    def _run(self, actions: Any, started: threading.Event | None) -> ChunkResult:
        n, chunk, dev = self.num_envs, actions.shape[1], self.device
        live = torch.ones(n, dtype=torch.bool, device=dev)
        substep_mask = torch.zeros(n, chunk, dtype=torch.bool, device=dev)
        substep_rewards = torch.zeros(n, chunk, dtype=torch.float64, device=dev)
        terminated = torch.zeros(n, dtype=torch.bool, device=dev)
        truncated = torch.zeros_like(terminated)
        success_any = success_end = None
        obs, info, final_obs, final_info = self.obs, {}, self.obs, {}
        for k in range(chunk):
            obs, rew, term, trunc, info = self._step(actions[:, k], started)
            rew, term, trunc = self._t(rew), self._t(term).bool(), self._t(trunc).bool()
            substep_mask[:, k] = live
            substep_rewards[:, k] = torch.where(live, rew.to(torch.float64), 0.0)
            ended = live & (term | trunc)
            success = self._success(info, ended)
            if success is not None:
                if success_any is None:
                    success_any, success_end = torch.zeros_like(live), torch.zeros_like(live)
                success_any = success_any | (success & live)
                success_end = torch.where(live, success, success_end)
            if self.is_numpy and bool(ended.any()):
                final_obs = rows_where(ended, self._terminal_obs(obs, info, ended), final_obs)
            if not self.is_numpy or bool(ended.any()):
                final_info = merge_info_rows(final_info, info.get(FINAL_INFO_KEY, info), ended)
                terminated |= ended & term
                truncated |= ended & trunc
                live = live & ~ended
                if self.mode == AutoresetMode.DISABLED and k < chunk - 1 and bool(ended.any()):
                    # Sync DISABLED asserts on stepping a done sub-env: a reset without the thaw option
                    # clears its flag and is ignored by the frozen sub-env.
                    self.env.reset(options={"reset_mask": ended.cpu().numpy()})
            if self.is_numpy and not bool(live.any()):
                break
        if not self.is_numpy:  # batched envs: a frozen row replays its terminal observation to the chunk's end
            final_obs = rows_where(terminated | truncated, obs, final_obs)  # (rule 1), rendered there on demand
        result = ChunkResult(
            obs, info, substep_rewards.sum(1), terminated, truncated, substep_mask, substep_rewards,
            final_obs, final_info, success_any, success_end,
        )  # fmt: skip
        self._reset_finished(result)
        return result

    def _success(self, info: Mapping[str, Any], ended: torch.Tensor) -> torch.Tensor | None:
        success = success_flags(info, self.device)
        final_info = info.get(FINAL_INFO_KEY)
        if isinstance(final_info, Mapping):
            final_success = success_flags(final_info, self.device)
            if final_success is not None:
                success = final_success if success is None else torch.where(ended, final_success, success)
        return success

    def _reset_finished(self, result: ChunkResult) -> None:
        """Resets the envs that finished (thaw); their rows of obs/info become the reset ones."""
        done = result.done
        info = {k: v for k, v in result.info.items() if k not in _FINAL_KEYS}
        if bool(done.any()):
            reset_obs, reset_info = self.env.reset(options={"reset_mask": done.cpu().numpy(), THAW_OPTION: True})
            result.obs = rows_where(done, reset_obs, result.obs)
            info = merge_info_rows(merge_info_rows({}, info, ~done), reset_info, done)
        result.info = info
        self.obs = result.obs
