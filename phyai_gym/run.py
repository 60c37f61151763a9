"""``phyai-gym run``: drive a policy through `PolicyVectorEnv` until every env finished an episode.

With no arguments it runs offline: a tiny PI0.5 (random weights with a fixed seed, the locally built
stand-in tokenizer) on 4 MuJoCo Pusher envs. With a checkpoint and a LIBERO suite or ManiSkill task it
runs the real policy on the real simulator. Heavy modules (torch, gymnasium, the simulators) are imported
when a run starts, so that ``phyai-gym --help`` stays instant.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

POLICIES: tuple[str, ...] = ("tiny", "base", "gaussian")
"""Policies without a checkpoint: random PI0.5 geometries and the Gaussian baseline."""
PRESETS: tuple[str, ...] = (
    "openpi_pi05_base", "openpi_pi05_libero", "lerobot_pi05", "rlinf_pi05_libero", "rlinf_pi05_maniskill",
)  # fmt: skip
"""`policies.pi05.presets.list_presets()`'s names, spelled here so that ``phyai-gym --help`` imports no torch
(``tests/phyai_gym/test_cli.py`` checks that the two agree)."""
_LIBERO_PRESETS = {"openpi": "openpi", "lerobot": "lerobot", "rlinf": "rlinf"}
GROUPABLE = ("mujoco",)
"""Env kinds whose sub-env i depends only on its seed, so N envs split into groups equal one vector env of N."""
CPU_SIM = ("mujoco", "libero")
"""Env kinds simulated on the CPU: under a CUDA policy the defaults step their N >= 2 sub-envs in worker processes
(LIBERO's 10-env openpi eval on a 16-core H100 node: ~235 env-steps/s async, ~44 in one process)."""


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
    chunks: int | None = None
    """Policy calls (each runs C env steps); None: enough for every env to finish one episode."""
    action_chunk: int | None = None
    """C, env steps for each policy call (None: 5 for random policies, the checkpoint's setting otherwise)."""
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
    vectorization: str | None = None
    """"sync" (in this process) or "async" (a worker process per sub-env). None: "async" for a MuJoCo env under a
    CUDA policy with N >= 2 (the simulator then has the CPU cores to itself), else the env's default."""
    groups: int | None = None
    """Env groups the policy alternates between, so that one group simulates while the policy acts for the other
    (the results are the same for any count). None: 2 where `vectorization` resolves to "async" for a MuJoCo env
    under a CUDA policy with N >= 2, else 1."""
    deterministic: bool = False
    """ODE sampling (no noise) instead of the rollout's stochastic method."""
    std: float = 0.5
    """Standard deviation of the Gaussian baseline."""
    quiet: bool = False
    """Print nothing (library use)."""
    threads: int | None = None
    """Torch CPU threads (None: 1 for small policies on the CPU, torch's default otherwise)."""

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
        for name in ("num_envs", "chunks", "threads", "groups"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(self, name)}.")
        from phyai_gym.make import resolve_env
        from policies.checks import check_float, check_int

        for name in ("action_chunk", "image_size", "max_episode_steps"):
            if getattr(self, name) is not None:
                check_int(f"--{name.replace('_', '-')}", getattr(self, name), 1, fix="or leave it out for the default")
        check_float("--std", self.std, 0.0, exclusive_minimum=True, fix="the Gaussian baseline's standard deviation")
        kind = resolve_env(self.env).kind  # unknown names fail here, before anything is built
        if self.groups is not None and self.groups > 1:
            if kind not in GROUPABLE:
                raise ValueError(
                    f"--groups {self.groups}: --env {self.env} ({kind}) runs in one group only, because its "
                    "sub-envs' tasks and initial states follow their index in one vector env. Fix: leave --groups "
                    f"out or pass 1; groups work for the {'/'.join(GROUPABLE)} envs."
                )
            if self.groups > self.num_envs:
                raise ValueError(
                    f"--groups: expected <= --num-envs ({self.num_envs}), got {self.groups}. Fix: pass fewer groups "
                    "or more envs."
                )
            if self.resolved_vectorization() != "async":
                raise ValueError(
                    f"--groups {self.groups} needs --vectorization async: groups step in worker threads, and an "
                    "in-process MuJoCo env renders through an OpenGL context bound to the thread that made it. "
                    "Fix: add --vectorization async, or leave --groups out."
                )

    def _parallel(self, kinds: tuple[str, ...]) -> bool:
        """An env of one of `kinds` under a CUDA policy with N >= 2 (the cores are free for the simulator)."""
        from phyai_gym.make import resolve_env

        cuda = str(self.device).startswith("cuda")
        return cuda and self.num_envs >= 2 and resolve_env(self.env).kind in kinds

    def resolved_vectorization(self) -> str | None:
        """`vectorization`, or its default: async for a CPU simulator under a CUDA policy (None: the env's own)."""
        if self.vectorization is not None:
            return self.vectorization
        return "async" if self._parallel(CPU_SIM) else None

    def resolved_groups(self) -> int:
        """`groups`, or its default: 2 where the defaults step a MuJoCo env in worker processes, else 1."""
        if self.groups is not None:
            return self.groups
        return 2 if self._parallel(GROUPABLE) and self.resolved_vectorization() == "async" else 1


@dataclass
class RunSummary:
    """What `run` measured.

    Attributes:
        env_steps: sub-env steps executed (N x C x chunks).
        seconds: wall time of the chunk loop.
        mean_return: mean per-env reward sum over the run.
        episodes: episodes that finished.
        policy: a one-line description of the policy.
        episode_return: mean return of the finished episodes (nan without any).
        success_rate: success rate of the finished episodes (nan without any, or when the env reports none).
    """

    env_steps: int
    seconds: float
    mean_return: float
    episodes: int
    policy: str
    episode_return: float = float("nan")
    success_rate: float = float("nan")


def build_policy(cfg: RunConfig, action_dim: int) -> tuple[Any, str]:
    """The policy of `cfg` and a one-line description (says when weights are random / the tokenizer a stand-in)."""
    from phyai_gym.make import make_policy, standin_tokenizer

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
    from phyai_gym.make import TEST_ENVS, make_env, resolve_env

    kwargs: dict[str, Any] = {}
    if resolve_env(cfg.env).kind == "libero" and policy_preset:
        kwargs["preset"] = _LIBERO_PRESETS.get(policy_preset.split("_")[0], "openpi")
    if cfg.env in TEST_ENVS and cfg.env == "scripted":
        kwargs["episode_lengths"] = (7, 12)
    return make_env(
        cfg.env, cfg.num_envs, image_size=cfg.image_size, max_episode_steps=cfg.max_episode_steps,
        vectorization=cfg.resolved_vectorization(), **kwargs,
    )  # fmt: skip


def build_envs(cfg: RunConfig, build: Any = build_env) -> list[Any]:
    """`cfg.resolved_groups()` vector envs of N / G sub-envs each (the first N % G get one more).

    Each is ``build(cfg)`` with its size; the ones built are closed if a later one fails.
    """
    groups = cfg.resolved_groups()
    sizes = [cfg.num_envs // groups + (g < cfg.num_envs % groups) for g in range(groups)]
    envs: list[Any] = []
    try:
        for size in sizes:
            envs.append(build(replace(cfg, num_envs=size, groups=1, vectorization=cfg.resolved_vectorization())))
    except BaseException:
        for env in envs:
            env.close()
        raise
    return envs


def check_state_fits(cfg: RunConfig, env: Any, policy: Any) -> None:
    """Refuses a policy whose processor expects another state width than the env gives, before the first step.

    A preset fixes the state layout of the checkpoint it describes (``openpi_pi05_libero``: LIBERO's 8 dims);
    without this check the mismatch surfaces at the first policy call as a processor error that names neither
    the preset nor the checkpoint.
    """
    processor = getattr(policy, "processor", None)
    width = getattr(processor, "expected_state_dim", None)
    try:
        got = int(env.single_observation_space["state"].shape[0])
    except (KeyError, TypeError, IndexError, AttributeError):  # an env without a state vector
        return
    if width is None or width == got:
        return
    if cfg.checkpoint is None:
        raise ValueError(
            f"--preset {cfg.preset}: the preset's state has {width} dims, but --env {cfg.env} gives {got}. A preset "
            "describes a checkpoint's conventions, and no --checkpoint was given (the policy would have random "
            f"weights). Fix: add --checkpoint DIR and an env of that checkpoint (e.g. `phyai-gym run --checkpoint "
            f"DIR --preset {cfg.preset} --env libero_spatial`), or drop --preset for the offline demo."
        )
    raise ValueError(
        f"--checkpoint {cfg.checkpoint}: the policy expects a {width}-dim state (its preset / state statistics), "
        f"but --env {cfg.env} gives {got}. Fix: run the checkpoint on the env it was trained on, or pass the "
        "--preset that matches it."
    )


def action_chunk_for(cfg: RunConfig, policy: Any) -> int:
    """C: the flag, else the policy's rollout setting (capped at its horizon)."""
    if cfg.action_chunk is not None:
        return cfg.action_chunk
    rollout = getattr(policy, "rollout", None)
    return int(rollout.action_chunk) if rollout is not None else min(5, int(policy.action_horizon))


def sub_env_attr(env: Any, name: str) -> Any:
    """Attribute `name` of the first sub-env of a vector env (read below vector wrappers), or None without one.

    The sub-env is asked `has_wrapper_attr(name)` first: an async worker asked for an attribute it lacks reports
    the error and shuts down, which would break the env for the rest of the run.
    """
    while not callable(getattr(env, "get_attr", None)) and hasattr(env, "env"):
        env = env.env
    try:
        if callable(getattr(env, "call", None)) and not env.call("has_wrapper_attr", name)[0]:
            return None
        return env.get_attr(name)[0]
    except Exception:  # an env without get_attr, or one whose sub-envs are no Gymnasium envs
        return None


def episode_limit(env: Any) -> int | None:
    """Episode limit in env steps of the first sub-env, where the env exposes one (read below vector wrappers)."""
    limit = getattr(sub_env_attr(env, "spec"), "max_episode_steps", None)
    for name in ("max_episode_steps", "_max_episode_steps", "episode_length"):  # ManiSkill's time limit: the 2nd
        if limit is None:
            limit = sub_env_attr(env, name)
    return None if limit is None else int(limit)


MAX_CHUNKS_UNTIL_DONE = 200
"""Cap of a ``chunks=None`` run on an env without an episode limit."""
COLUMNS = (
    "columns: means over the N envs of one policy call -- reward summed over its C env steps; log-prob of the "
    "sampled chunk (a log-density summed over C x A action dims, so it can be positive); value = the critic's "
    "estimate; |action| = L2 norm of the chunk; ended = episodes that finished in it"
)


def run(cfg: RunConfig) -> RunSummary:
    """Runs `cfg.chunks` policy calls on `cfg.num_envs` envs; prints a per-chunk table and a summary.

    Example:
        >>> summary = run(RunConfig(env="scripted", num_envs=2, action_chunk=2, quiet=True))
        >>> summary.episodes >= 2
        True
    """
    import numpy as np
    import torch
    from tqdm import tqdm

    from phyai_gym.threads import configure_threads
    from wrappers import PolicyVectorEnv

    say = (lambda *a, **k: None) if cfg.quiet else print
    say(configure_threads(cfg.threads, device=cfg.device, small_model=cfg.checkpoint is None and cfg.policy != "base"))
    preset = cfg.preset
    if cfg.checkpoint is not None and preset is None:
        from policies.pi05.presets import infer_preset

        try:
            preset = infer_preset(cfg.checkpoint).name
        except Exception:  # the policy load below reports the real problem
            preset = None
    with phase(f"loading the simulator: {cfg.env} x {cfg.num_envs}", say):
        envs = build_envs(cfg, lambda c: build_env(c, preset))
    env = envs[0]
    try:
        action_dim = int(env.single_action_space.shape[0])
        with phase(building_policy_message(cfg), say):
            policy, description = build_policy(cfg, action_dim)
            check_state_fits(cfg, env, policy)
            chunk = action_chunk_for(cfg, policy)
            wrapper = PolicyVectorEnv(
                envs, policy, action_chunk=chunk, deterministic=cfg.deterministic, prefetch=len(envs) > 1
            )
    except BaseException:
        for e in envs:
            e.close()
        raise
    limit = episode_limit(env)
    # chunks=None: to the episode limit (every env then has ended an episode), or until every env ended one
    planned = cfg.chunks if cfg.chunks is not None else (math.ceil(limit / chunk) if limit else None)
    say(f"policy: {description}")
    obs, _ = wrapper.reset(seed=cfg.seed)
    say(
        f"env={cfg.env} num_envs={wrapper.num_envs} action_chunk={chunk} action_dim={action_dim} "
        f"state_dim={obs['state'].shape[1]} episode_limit={limit} task={str(obs['task'][0])!r}"
    )
    rows, returns, ended_returns, successes = [], np.zeros(wrapper.num_envs), [], []
    start = time.perf_counter()
    bar = tqdm(total=planned, desc="chunks", unit="chunk", file=sys.stderr, disable=cfg.quiet)
    ended_once, index = np.zeros(wrapper.num_envs, bool), 0
    try:  # an error or Ctrl-C closes the bar first, so that the message is not glued to it
        while index < (planned or MAX_CHUNKS_UNTIL_DONE) and (planned is not None or not ended_once.all()):
            obs, rewards, terminated, truncated, info = wrapper.step()
            rewards = np.asarray(rewards.cpu() if isinstance(rewards, torch.Tensor) else rewards, dtype=np.float64)
            ended = np.asarray(info.get("_episode", np.zeros(wrapper.num_envs, bool)), dtype=bool)
            rows.append(table_row(index, rewards, ended, info["policy"]))
            returns += rewards
            if ended.any():
                ended_returns += np.asarray(info["episode"]["r"])[ended].tolist()
                if "success" in info:
                    successes += np.asarray(info["episode"]["success_once"])[ended].tolist()
            ended_once |= ended
            index += 1
            bar.update(1)
    finally:
        bar.close()
        wrapper.close()
    chunks = index
    elapsed = time.perf_counter() - start
    env_steps = chunks * chunk * wrapper.num_envs
    summary = RunSummary(
        env_steps, elapsed, float(returns.mean()), len(ended_returns), description,
        float(np.mean(ended_returns)) if ended_returns else float("nan"),
        float(np.mean(successes)) if successes else float("nan"),
    )  # fmt: skip
    if not cfg.quiet:
        print(COLUMNS)
        print_table(rows)
        success = f"{summary.success_rate:.2f}" if successes else f"n/a ({cfg.env} reports no success flag)"
        print(
            f"summary: {chunks} chunks, {env_steps} env steps in {elapsed:.2f} s "
            f"({env_steps / max(elapsed, 1e-9):.1f} env steps/s); finished episodes {summary.episodes}, "
            f"mean episode return {summary.episode_return:.3f}, success rate {success}; "
            f"policy: {description.split(';')[0]}"
        )
        print(next_steps(cfg))
    return summary


def building_policy_message(cfg: RunConfig) -> str:
    """The start-up line of the policy build (on a GPU its CUDA graphs are captured later, at the first steps)."""
    what = f"loading the policy from {cfg.checkpoint}" if cfg.checkpoint is not None else (
        f"building the policy ({cfg.policy or 'tiny'}, random weights)"
    )
    graphs = " (CUDA graphs: captured at the first step of each shape)" if str(cfg.device).startswith("cuda") else ""
    return f"{what} on {cfg.device}{graphs}"


@contextlib.contextmanager
def phase(message: str, say: Callable[..., None] = print) -> Iterator[None]:
    """Says what a start-up phase does before it starts and how long it took, so a slow start shows progress.

    Example:
        >>> with phase("loading the simulator: scripted x 2"):
        ...     pass  # doctest: +ELLIPSIS
        loading the simulator: scripted x 2 ...
        loading the simulator: scripted x 2: done in 0.0 s
    """
    say(f"{message} ...", flush=True)
    start = time.perf_counter()
    yield
    say(f"{message}: done in {time.perf_counter() - start:.1f} s", flush=True)


def next_steps(cfg: RunConfig) -> str:
    """What to try after a run: success rates, PPO, a real checkpoint; every command runs as written.

    ``eval`` has no default env (an evaluation names what it measures), so the suggestion always names it.
    """
    return (
        f"next: success rates with `phyai-gym eval --env {cfg.env} --policy tiny --episodes 4 --out runs/demo`; "
        "PPO with `python examples/ppo_pi05.py`; a trained policy with `phyai-gym run --checkpoint DIR "
        "--preset openpi_pi05_libero --env libero_spatial` (see the README)"
    )


def table_row(chunk: int, rewards: np.ndarray, ended: np.ndarray, policy: dict[str, torch.Tensor]) -> tuple:
    """(chunk, reward, log-prob, value, |action|, ended) of one policy call, means over the envs."""
    norms = policy["actions"].flatten(1).norm(dim=1)
    return (
        chunk, float(rewards.mean()), float(policy["log_prob"].float().mean()), float(policy["values"].float().mean()),
        float(norms.float().mean()), int(ended.sum()),
    )  # fmt: skip


def print_table(rows: list[tuple]) -> None:
    """The per-chunk table."""
    header = f"{'chunk':>5} {'reward':>10} {'log-prob':>10} {'value':>8} {'|action|':>9} {'ended':>5}"
    print(header)
    print("-" * len(header))
    for chunk, reward, log_prob, value, norm, ended in rows:
        print(f"{chunk:>5} {reward:>10.4f} {log_prob:>10.3f} {value:>8.3f} {norm:>9.3f} {ended:>5d}")
