"""`make_env` and `make_policy`: one name (or checkpoint folder) in, a ready vector env or PI0.5 policy out.

Env names: ``"scripted"`` and ``"target"`` (small test tasks), a Gymnasium MuJoCo id (``"Pusher-v5"``), a
LIBERO suite (``"libero_spatial"``, ...), a ManiSkill3 task id (``"PickCube-v1"``, ...) or a GPU-batched MuJoCo
Warp Panda task (``"mjwarp_pick_cube"``, ``"mjwarp_push_cube"``). Simulator
adapters are imported only when asked for; a missing simulator raises an `ImportError` naming the extra.

Policies: ``make_policy()`` gives a tiny PI0.5 with random weights (fixed seed) and the locally built
stand-in tokenizer, which needs no download; ``make_policy(checkpoint=DIR, preset=...)`` loads a checkpoint.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymnasium.vector import VectorEnv

from phyai_gym.train.training_state import CHECKPOINTS, LAST, PRETRAINED, latest_checkpoint
from policies.checks import bad_input, check_device, check_int
from policies.pi05.checkpoint import CheckpointError, checkpoint_folder, load_config
from policies.pi05.config import Pi05Config
from policies.pi05.policy import Pi05Policy, RolloutConfig
from policies.pi05.presets import list_presets
from policies.pi05.scheduler import SchedulerConfig

TEST_ENVS: tuple[str, ...] = ("scripted", "target")
"""Envs built in-process without a simulator."""
LIBERO_PREFIX = "libero_"
WARP_PREFIX = "mjwarp_"
"""MuJoCo Warp tasks: ``mjwarp_`` + a key of `wrappers.adapters.panda_tasks.TASKS`."""
WARP_ENVS: tuple[str, ...] = ("mjwarp_pick_cube", "mjwarp_push_cube", "mjwarp_push_cube_state")
MODEL_FILE = "model.safetensors"
_EXTRAS = {
    "mujoco": "pip install 'phyai-gym[sim]' (gymnasium[mujoco])",
    "libero": "pip install 'phyai-gym[libero]'",
    "maniskill": "pip install 'phyai-gym[maniskill]'",
    "mujoco_warp": "pip install 'phyai-gym[warp]' (mujoco-warp, warp-lang, the Panda assets wheel)",
}


@dataclass(frozen=True)
class EnvSpec:
    """What an env name resolves to.

    Attributes:
        name: the name as given.
        kind: "scripted", "target", "mujoco", "libero", "maniskill" or "mujoco_warp".
    """

    name: str
    kind: str


def _mujoco_ids() -> list[str]:
    import gymnasium as gym

    return sorted(k for k, s in gym.registry.items() if "mujoco" in str(s.entry_point))


def _maniskill_ids() -> list[str]:
    from wrappers.adapters.maniskill import MANISKILL_INSTRUCTIONS

    return sorted(MANISKILL_INSTRUCTIONS)


def resolve_env(name: str) -> EnvSpec:
    """Classify an env name; raises `ValueError` listing the accepted names for an unknown one.

    Example:
        >>> resolve_env("Pusher-v5").kind, resolve_env("libero_spatial").kind, resolve_env("target").kind
        ('mujoco', 'libero', 'target')
    """
    if name in TEST_ENVS:
        return EnvSpec(name, name)
    if name.startswith(LIBERO_PREFIX):
        return EnvSpec(name, "libero")
    if name in WARP_ENVS:
        return EnvSpec(name, "mujoco_warp")
    if name in _mujoco_ids():
        return EnvSpec(name, "mujoco")
    if name in _maniskill_ids() or _registered_maniskill(name):
        return EnvSpec(name, "maniskill")
    mujoco = ", ".join(i for i in _mujoco_ids() if i.endswith("-v5"))
    raise ValueError(
        f"unknown env {name!r}. Expected one of: {', '.join(TEST_ENVS)}; a Gymnasium MuJoCo id ({mujoco}); "
        f"a LIBERO suite (libero_spatial, libero_object, libero_goal, libero_10, libero_90); or a ManiSkill3 "
        f"task id ({', '.join(_maniskill_ids()[:6])}, ...); or a MuJoCo Warp task ({', '.join(WARP_ENVS)})."
    )


def _registered_maniskill(name: str) -> bool:
    """True when ManiSkill is installed and registers `name` (only tried for id-like names)."""
    if not re.fullmatch(r"[A-Z][A-Za-z0-9]*-v\d+", name) or importlib.util.find_spec("mani_skill") is None:
        return False
    try:
        import mani_skill.envs  # noqa: F401  (registers the ids)
        from mani_skill.utils.registration import REGISTERED_ENVS
    except Exception:  # a broken ManiSkill install is reported when the env is built
        return False
    return name in REGISTERED_ENVS


def make_env(
    name: str,
    num_envs: int = 4,
    *,
    image_size: int | None = None,
    max_episode_steps: int | None = None,
    vectorization: str | None = None,
    **kwargs: Any,
) -> VectorEnv:
    """A freezable vector env yielding canonical observations (DESIGN C1), from a name.

    Args:
        name: see the module docstring.
        num_envs: N.
        image_size: rendered image side (default: 224 for simulators, the test envs' own default otherwise).
        max_episode_steps: override of the episode limit (None: the env's own).
        vectorization: "sync" or "async" (ManiSkill also "maniskill", its batched GPU env); None: the adapter's
            default ("sync"; ManiSkill: "maniskill" on a CUDA machine, else "sync"). Every value is honoured or
            refused by the adapter.
        **kwargs: passed to the adapter (e.g. ``num_targets`` for "target", ``task_ids`` for LIBERO).

    Raises:
        ValueError: unknown name (the message lists the accepted ones).
        ImportError: the simulator is not installed (the message names the extra).

    Example:
        >>> venv = make_env("target", num_envs=2)
        >>> venv.num_envs
        2
        >>> venv.close()
    """
    spec = resolve_env(name)
    size = {} if image_size is None else {"image_size": image_size}
    if vectorization is None:
        vectorization = "auto" if spec.kind == "maniskill" else "sync"
    if spec.kind == "scripted":
        from wrappers.adapters.scripted import make_scripted_env

        kwargs.setdefault("episode_lengths", (max_episode_steps or 7,))
        return make_scripted_env(num_envs, vectorization=vectorization, **size, **kwargs)  # type: ignore[arg-type]
    if spec.kind == "target":
        from wrappers.adapters.target_task import make_target_env

        if max_episode_steps is not None:
            kwargs["episode_length"] = max_episode_steps
        return make_target_env(num_envs, vectorization=vectorization, **size, **kwargs)  # type: ignore[arg-type]
    limit = {} if max_episode_steps is None else {"max_episode_steps": max_episode_steps}
    if spec.kind == "mujoco":
        try:
            import mujoco  # noqa: F401
        except ImportError as error:
            raise ImportError(f"env {name!r} needs MuJoCo ({error}). Fix: {_EXTRAS['mujoco']}.") from error
        from wrappers.adapters.mujoco import make_mujoco_env

        return make_mujoco_env(name, num_envs=num_envs, vectorization=vectorization, **size, **limit, **kwargs)  # type: ignore[arg-type]
    if spec.kind == "mujoco_warp":
        return _make_warp_env(name, num_envs, vectorization, size, limit, kwargs)
    adapter = "libero" if spec.kind == "libero" else "maniskill"
    try:
        module = importlib.import_module(f"wrappers.adapters.{adapter}")
    except ImportError as error:
        raise ImportError(f"env {name!r} needs {adapter} ({error}). Fix: {_EXTRAS[adapter]}.") from error
    if spec.kind == "libero":
        return module.make_libero_env(name, num_envs=num_envs, vectorization=vectorization, **size, **limit, **kwargs)
    return module.make_maniskill_env(name, num_envs=num_envs, vectorization=vectorization, **size, **limit, **kwargs)


def _make_warp_env(
    name: str, num_envs: int, vectorization: str, size: dict[str, int], limit: dict[str, int], kwargs: dict[str, Any]
) -> VectorEnv:
    if vectorization not in ("sync", "auto", "warp"):
        raise ValueError(
            f"make_env: vectorization={vectorization!r} does not apply to {name!r}, whose worlds are one batch on the "
            "device. Fix: leave vectorization unset."
        )
    try:
        from wrappers.adapters.mujoco_warp import make_mujoco_warp_env
    except ImportError as error:
        raise ImportError(f"env {name!r} needs MuJoCo Warp ({error}). Fix: {_EXTRAS['mujoco_warp']}.") from error
    return make_mujoco_warp_env(name.removeprefix(WARP_PREFIX), num_envs, **size, **limit, **kwargs)


def standin_tokenizer() -> Path:
    """Folder of the locally built stand-in PaliGemma tokenizer (built on first use, about 0.5 s, offline)."""
    from policies.pi05.tokenizer import build_standin_tokenizer, default_standin_dir

    return build_standin_tokenizer(default_standin_dir())


def check_checkpoint(path: str | Path, argument: str = "checkpoint") -> Path:
    """The checkpoint folder, or a `CheckpointError` saying what `path` is instead and how to get a folder.

    A training run folder (``--run-dir`` of the PPO and SFT examples) stands for its newest complete checkpoint's
    policy, ``RUN/checkpoints/last/pretrained_model``. `argument` names the value in the message
    (``"--checkpoint"`` from the command line).
    """
    if isinstance(path, str | Path) and (Path(path).expanduser() / CHECKPOINTS).is_dir():
        last = latest_checkpoint(Path(path).expanduser())
        if last is None:
            raise CheckpointError(bad_input(
                argument, "a checkpoint folder, or a training run folder with a complete checkpoint",
                f"the run folder {str(path)!r}, whose {CHECKPOINTS}/ has no '{LAST}' checkpoint yet",
                "wait for the run's first checkpoint (--save-every), or pass a checkpoint folder", raw=True,
            ))  # fmt: skip
        path = last / PRETRAINED
    return checkpoint_folder(path, argument)


def check_preset(preset: str | None) -> str | None:
    """`preset`, or a `ValueError` listing the known presets."""
    known = list_presets()
    if preset is not None and preset not in known:
        raise ValueError(f"--preset {preset!r} is unknown; choose one of: {', '.join(known)}.")
    return preset


SMALL_CONFIGS: tuple[str, ...] = ("tiny", "small")
"""`make_policy` config names of small models: random ones train with small-model defaults (1 CPU thread, rates of
1e-3 for SFT and 3e-3 for PPO) in the examples."""


def make_policy(
    checkpoint: str | Path | None = None,
    *,
    preset: str | None = None,
    config: str | Pi05Config = "tiny",
    action_dim: int = 7,
    camera_map: dict[str, str] | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    seed: int = 0,
    rollout: RolloutConfig | None = None,
    max_batch_size: int = 64,
    cuda_graphs: bool = True,
    warmup: tuple[tuple[int, int], ...] | str = (),
    **processor_kwargs: Any,
) -> Pi05Policy:
    """A PI0.5 policy: loaded from `checkpoint`, or with random weights when `checkpoint` is None.

    Args:
        checkpoint: a safetensors checkpoint folder; None builds `config` with weights randomised by `seed`
            and the local stand-in tokenizer (no download).
        preset: processor conventions (`policies.pi05.presets`); required by checkpoints it cannot infer.
        config: "tiny", "small", "base" or a `Pi05Config` (random policies only).
        action_dim: env action dims A (random policies; a checkpoint's preset fixes it).
        camera_map: env camera -> model slot (random policies; default ``{"image": "base_0_rgb"}``).
        device: torch device.
        dtype: compute dtype override.
        seed: weight seed of a random policy.
        rollout: rollout settings (None: the checkpoint's or the defaults).
        max_batch_size: largest batch one scheduler replay serves.
        cuda_graphs: capture CUDA graphs on a GPU (False: eager, e.g. for a trainer copy). Each shape is captured
            the first time a call needs it (`SchedulerConfig`: under a second more for that call at full size).
        warmup: shapes to capture while building instead: (batch_size, prompt_length) pairs, or "all"
            (`SchedulerConfig.warmup`).
        **processor_kwargs: `ProcessorConfig` overrides of a random policy (e.g. ``prompt_format="state"``).
            Without a preset the policy does not normalise (``norm_mode="identity"``), unless ``state_stats`` or
            ``action_stats`` are given: then openpi's PI0.5 mode, ``"quantile"``, applies them.

    Example:
        >>> policy = make_policy(action_dim=1)
        >>> policy.action_dim, policy.config.llm.width
        (1, 64)
    """
    check_preset(preset)
    check_device(device, "device")
    check_int("seed", seed, fix="an integer weight seed")
    if rollout is not None and not isinstance(rollout, RolloutConfig):
        raise TypeError(bad_input("rollout", "a RolloutConfig or None", rollout, "RolloutConfig(num_steps=5, ...)"))
    if checkpoint is not None:
        root = check_checkpoint(checkpoint, "checkpoint")
        if cuda_graphs:
            return Pi05Policy.from_pretrained(
                root,
                preset=preset,
                device=device,
                dtype=dtype,
                max_batch_size=max_batch_size,
                rollout=rollout,
                warmup=warmup,
            )
        return _eager_from_pretrained(root, preset, device, dtype, max_batch_size, rollout)
    if isinstance(config, str):
        if config not in (*SMALL_CONFIGS, "base"):
            raise ValueError(f"config: expected 'tiny', 'small', 'base' or a Pi05Config, got {config!r}. Fix: pass "
                             "one of those names.")  # fmt: skip
        # tiny, small: a 128-token prompt holds the state-in-prompt format of a 23-dim MuJoCo state untruncated
        config = Pi05Config.pi05_base() if config == "base" else getattr(Pi05Config, config)(max_token_len=128)
    if rollout is None:
        rollout = RolloutConfig(num_steps=config.num_steps, action_chunk=min(5, config.action_horizon))
    processor_kwargs.setdefault("camera_map", camera_map or {"image": "base_0_rgb"})
    if preset is None:  # statistics without a mode: openpi's PI0.5 mode (quantile) applies them
        given = any(processor_kwargs.get(k) is not None for k in ("state_stats", "action_stats"))
        processor_kwargs.setdefault("norm_mode", "quantile" if given else "identity")
    from policies.pi05.processor import Pi05Processor

    processor = Pi05Processor.for_config(
        config, action_dim=action_dim, device=device, tokenizer=standin_tokenizer(), preset=preset, **processor_kwargs
    )
    scheduler = SchedulerConfig(
        max_batch_size=max_batch_size,
        num_steps=(rollout.num_steps,),
        camera_sets=(tuple(processor.slots),),
        prompt_buckets=processor.prompt_buckets,
        cuda_graphs=cuda_graphs,
        warmup=warmup,
    )
    return Pi05Policy.from_config(
        config, processor, device=device, dtype=dtype, seed=seed, rollout=rollout, scheduler=scheduler
    )


def _eager_from_pretrained(
    root: Path, preset: str | None, device: str, dtype: str | None, max_batch_size: int, rollout: RolloutConfig | None
) -> Pi05Policy:
    """`Pi05Policy.from_pretrained` with a scheduler that never captures CUDA graphs (a trainer copy)."""
    from policies.pi05.processor import Pi05Processor

    slots = tuple(Pi05Processor.from_pretrained(root, preset=preset, device="cpu").slots)
    num_steps = rollout.num_steps if rollout is not None else load_config(root).num_steps
    scheduler = SchedulerConfig(
        max_batch_size=max_batch_size, num_steps=(num_steps,), camera_sets=(slots,), cuda_graphs=False
    )
    return Pi05Policy.from_pretrained(
        root, preset=preset, device=device, dtype=dtype, max_batch_size=max_batch_size, rollout=rollout,
        scheduler=scheduler,
    )  # fmt: skip
