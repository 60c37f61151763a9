"""``phyai-gym run``: drive a policy through `PolicyVectorEnv` for a few chunks and show what it does.

With no arguments it runs offline: a tiny PI0.5 (random weights with a fixed seed, the locally built
stand-in tokenizer) on 4 MuJoCo Pusher envs. With a checkpoint and a LIBERO suite or ManiSkill task it
runs the real policy on the real simulator.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from phyai_gym.make import TEST_ENVS, make_env, make_policy, resolve_env, standin_tokenizer
from policies.checks import check_float, check_int

POLICIES: tuple[str, ...] = ("tiny", "base", "gaussian")
"""Policies without a checkpoint: random PI0.5 geometries and the Gaussian baseline."""
_LIBERO_PRESETS = {"openpi": "openpi", "lerobot": "lerobot", "rlinf": "rlinf"}


@dataclass
class RunConfig:
    """Options of ``phyai-gym run`` (and the policy/env options ``eval`` shares).

    Example:
        >>> cfg = RunConfig(env="scripted", num_envs=2, chunks=1, action_chunk=2, quiet=True)
        >>> run(cfg).env_steps
        4
    """

    env: str = "Pusher-v5"
    """Env name (see `phyai_gym.make.make_env`)."""
    num_envs: int = 4
    """N, sub-envs."""
    chunks: int = 3
    """Policy calls (each runs C env steps)."""
    action_chunk: int | None = None
    """C, env steps per call (None: 5 for random policies, the checkpoint's setting otherwise)."""
    seed: int = 0
    """Env i and its policy stream get seed + i; also the weight seed of a random policy."""
    checkpoint: str | None = None
    """PI0.5 checkpoint folder (None: a random policy, see `policy`)."""
    preset: str | None = None
    """Processor preset of the checkpoint."""
    policy: str | None = None
    """"tiny", "base" or "gaussian" without a checkpoint (None: "tiny"); conflicts with `checkpoint`."""
    device: str = "cpu"
    """Torch device of the policy."""
    image_size: int | None = None
    """Rendered image side (None: the env's default, 224 for simulators)."""
    max_episode_steps: int | None = None
    """Episode limit override."""
    vectorization: str = "sync"
    """"sync" or "async" sub-envs."""
    deterministic: bool = False
    """ODE sampling (no noise) instead of the rollout's stochastic method."""
    std: float = 0.5
    """Standard deviation of the Gaussian baseline."""
    quiet: bool = False
    """Print nothing (library use)."""

    def __post_init__(self) -> None:
        if self.checkpoint is not None and self.policy is not None:
            raise ValueError(
                f"conflicting options: --checkpoint {self.checkpoint!r} and --policy {self.policy!r}; a checkpoint "
                "is a PI0.5 policy. Fix: drop --policy, or drop --checkpoint for a random policy."
            )
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(f"--policy: expected one of {POLICIES}, got {self.policy!r}.")
        if self.preset is not None and self.checkpoint is None and self.policy == "gaussian":
            raise ValueError("conflicting options: --preset applies to PI0.5 policies, not --policy gaussian.")
        for name in ("num_envs", "chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(self, name)}.")
        for name in ("action_chunk", "image_size", "max_episode_steps"):
            if getattr(self, name) is not None:
                check_int(f"--{name.replace('_', '-')}", getattr(self, name), 1, fix="or leave it out for the default")
        check_float("--std", self.std, 0.0, exclusive_minimum=True, fix="the Gaussian baseline's standard deviation")
        resolve_env(self.env)  # unknown names fail here, before anything is built


@dataclass
class RunSummary:
    """What `run` measured.

    Attributes:
        env_steps: sub-env steps executed (N x C x chunks).
        seconds: wall time of the chunk loop.
        mean_return: mean per-env reward sum over the run.
        episodes: episodes that finished.
        policy: a one-line description of the policy.
    """

    env_steps: int
    seconds: float
    mean_return: float
    episodes: int
    policy: str


def build_policy(cfg: RunConfig, action_dim: int) -> tuple[Any, str]:
    """The policy of `cfg` and a one-line description (says when weights are random / the tokenizer a stand-in)."""
    if cfg.checkpoint is not None:
        policy = make_policy(cfg.checkpoint, preset=cfg.preset, device=cfg.device, max_batch_size=cfg.num_envs)
        preset = policy.processor.config.preset or cfg.preset
        return policy, f"PI0.5 from {cfg.checkpoint} (preset {preset}, weight version {policy.weight_version})"
    kind = cfg.policy or "tiny"
    if kind == "gaussian":
        from policies.baseline import GaussianPolicy

        return GaussianPolicy(action_dim, action_horizon=max(cfg.action_chunk or 5, 1), std=cfg.std), (
            f"Gaussian baseline (std {cfg.std})"
        )
    policy = make_policy(
        config=kind, preset=cfg.preset, action_dim=action_dim, device=cfg.device, seed=cfg.seed,
        max_batch_size=cfg.num_envs,
    )  # fmt: skip
    return policy, (
        f"PI0.5 {kind}() with RANDOM weights (seed {cfg.seed}) and the locally built STAND-IN tokenizer "
        f"({standin_tokenizer()}); offline demo, not a trained policy"
    )


def build_env(cfg: RunConfig, policy_preset: str | None = None) -> Any:
    """The vector env of `cfg` (LIBERO gets the episode limits that match the policy's preset)."""
    kwargs: dict[str, Any] = {}
    if resolve_env(cfg.env).kind == "libero" and policy_preset:
        kwargs["preset"] = _LIBERO_PRESETS.get(policy_preset.split("_")[0], "openpi")
    if cfg.env in TEST_ENVS and cfg.env == "scripted":
        kwargs["episode_lengths"] = (7, 12)
    return make_env(
        cfg.env, cfg.num_envs, image_size=cfg.image_size, max_episode_steps=cfg.max_episode_steps,
        vectorization=cfg.vectorization, **kwargs,
    )  # fmt: skip


def action_chunk_for(cfg: RunConfig, policy: Any) -> int:
    """C: the flag, else the policy's rollout setting (capped at its horizon)."""
    if cfg.action_chunk is not None:
        return cfg.action_chunk
    rollout = getattr(policy, "rollout", None)
    return int(rollout.action_chunk) if rollout is not None else min(5, int(policy.action_horizon))


def run(cfg: RunConfig) -> RunSummary:
    """Runs `cfg.chunks` policy calls on `cfg.num_envs` envs; prints a per-step table and a summary."""
    from tqdm import tqdm

    from wrappers import PolicyVectorEnv

    say = (lambda *a: None) if cfg.quiet else print
    preset = cfg.preset
    if cfg.checkpoint is not None and preset is None:
        from policies.pi05.presets import infer_preset

        try:
            preset = infer_preset(cfg.checkpoint).name
        except Exception:  # the policy load below reports the real problem
            preset = None
    env = build_env(cfg, preset)
    try:
        action_dim = int(env.single_action_space.shape[0])
        policy, description = build_policy(cfg, action_dim)
        chunk = action_chunk_for(cfg, policy)
        wrapper = PolicyVectorEnv(env, policy, action_chunk=chunk, deterministic=cfg.deterministic)
    except BaseException:
        env.close()
        raise
    say(f"policy: {description}")
    obs, _ = wrapper.reset(seed=cfg.seed)
    say(
        f"env={cfg.env} num_envs={wrapper.num_envs} action_chunk={chunk} action_dim={action_dim} "
        f"state_dim={obs['state'].shape[1]} task={str(obs['task'][0])!r}"
    )
    rows, returns, episodes = [], np.zeros(wrapper.num_envs), 0
    start = time.perf_counter()
    bar = tqdm(range(cfg.chunks), desc="chunks", unit="chunk", file=sys.stderr, disable=cfg.quiet)
    for index in bar:
        obs, rewards, terminated, truncated, info = wrapper.step()
        rewards = np.asarray(rewards.cpu() if isinstance(rewards, torch.Tensor) else rewards, dtype=np.float64)
        done = np.asarray(terminated | truncated).astype(bool)
        rows.extend(table_rows(index, rewards, done, info["policy"]))
        returns += rewards
        episodes += int(np.asarray(info.get("_episode", np.zeros(1, bool))).sum())
    elapsed = time.perf_counter() - start
    wrapper.close()
    env_steps = cfg.chunks * chunk * wrapper.num_envs
    if not cfg.quiet:
        print_table(rows)
        print(
            f"summary: {cfg.chunks} chunks, {env_steps} env steps in {elapsed:.2f} s "
            f"({env_steps / max(elapsed, 1e-9):.1f} env steps/s); mean return so far {returns.mean():.3f}; "
            f"finished episodes {episodes}; policy: {description.split(';')[0]}"
        )
    return RunSummary(env_steps, elapsed, float(returns.mean()), episodes, description)


def table_rows(chunk: int, rewards: np.ndarray, done: np.ndarray, policy: dict[str, torch.Tensor]) -> list[tuple]:
    """(chunk, env, reward, log-prob, value, |action|, done) per env of one step."""
    norms = policy["actions"].flatten(1).norm(dim=1).tolist()
    log_probs, values = policy["log_prob"].tolist(), policy["values"].tolist()
    return [
        (chunk, i, float(rewards[i]), log_probs[i], values[i], norms[i], bool(done[i])) for i in range(len(rewards))
    ]


def print_table(rows: list[tuple]) -> None:
    """The per-step table."""
    header = f"{'chunk':>5} {'env':>3} {'reward':>10} {'log-prob':>10} {'value':>8} {'|action|':>9} {'done':>5}"
    print(header)
    print("-" * len(header))
    for chunk, env, reward, log_prob, value, norm, done in rows:
        print(f"{chunk:>5} {env:>3} {reward:>10.4f} {log_prob:>10.3f} {value:>8.3f} {norm:>9.3f} {done!s:>5}")
