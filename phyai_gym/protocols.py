"""Named evaluation protocols: the reference procedures that published success rates follow.

Success rates are only comparable under one protocol (episode limits, settle steps, image rendering and
resizing, seeding, trials per task, replanning, which success flag counts). `phyai-gym eval` writes the
protocol's name and primary metric into its header, shows them above the table, and refuses to resume a
folder made under another protocol.

Example:
    >>> get_protocol("openpi_libero").episodes_per_task
    50
    >>> protocol_for_preset("openpi_pi05_libero", "libero").name
    'openpi_libero'
    >>> protocol_for_preset(None, "mujoco").name
    'phyai'
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class EvalProtocol:
    """One evaluation protocol.

    Attributes:
        name: the protocol's name (written into the eval header).
        description: where it comes from and what it fixes.
        env_kinds: env kinds it applies to ("libero", "maniskill"; empty: any).
        primary_metric: "success_once" or "success_at_end": the success flag the protocol counts.
        episodes_per_task: trials per task of the reference (None: the user's ``--episodes``).
        action_chunk: env steps executed per policy call (the reference's replan steps; None: the policy's).
        env_kwargs: `phyai_gym.make.make_env` arguments that set up the reference's env.
    """

    name: str
    description: str
    env_kinds: tuple[str, ...] = ()
    primary_metric: str = "success_once"
    episodes_per_task: int | None = None
    action_chunk: int | None = None
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.primary_metric not in ("success_once", "success_at_end"):
            raise ValueError(
                f"EvalProtocol {self.name!r}: primary_metric must be 'success_once' or 'success_at_end', got "
                f"{self.primary_metric!r}."
            )
        object.__setattr__(self, "env_kwargs", MappingProxyType(dict(self.env_kwargs)))


def _protocols() -> dict[str, EvalProtocol]:
    items = [
        EvalProtocol("phyai", "phyai-gym's defaults: the env's own settings, the user's --episodes."),
        EvalProtocol(
            "openpi_libero",
            "openpi examples/libero/main.py: cameras rendered at 256 and resized with padding to 224 (PIL "
            "bilinear), numpy's RNG seeded once with 7, 50 trials per task on the fixed initial states 0..49, 10 "
            "settle no-ops, per-suite limits (spatial 220, object 280, goal 300, libero_10 520, libero_90 400), "
            "replan every 5 steps, success = check_success() at any step.",
            env_kinds=("libero",),
            episodes_per_task=50,
            action_chunk=5,
            env_kwargs={"preset": "openpi", "render_size": 256, "image_size": 224, "seed_mode": "once", "seed": 7},
        ),
        EvalProtocol(
            "lerobot_libero",
            "LeRobot lerobot-eval on its LIBERO env: cameras rendered at 360 (LeRobot's default observation size; "
            "the policy's processor resizes), fixed initial states, 10 settle no-ops, TASK_SUITE_MAX_STEPS "
            "(spatial and object 280, goal 300, libero_10 520, libero_90 400), the policy's n_action_steps, "
            "success = is_success at any step. Scenes are seeded per episode by phyai-gym's rule, not by "
            "lerobot-eval's seed numbering (not reproduced bit for bit).",
            env_kinds=("libero",),
            env_kwargs={"preset": "lerobot", "image_size": 360},
        ),
        EvalProtocol(
            "rlinf_maniskill",
            "RLinf's ManiSkill conventions: ignore_terminations (episodes run to the step limit), gripper "
            "binarised to 2*[g > 0.5] - 1, its tasks' 3rd_view_camera where the task has one, partial resets; "
            "success_once and success_at_end both reported, success_once primary.",
            env_kinds=("maniskill",),
            env_kwargs={
                "ignore_terminations": True,
                "gripper_binarize": True,
                "camera": ("3rd_view_camera", "base_camera"),
            },
        ),
    ]
    return {p.name: p for p in items}


PRESET_PROTOCOLS: Mapping[tuple[str, str], str] = MappingProxyType(
    {
        ("openpi_pi05_libero", "libero"): "openpi_libero",
        ("rlinf_pi05_libero", "libero"): "openpi_libero",
        ("lerobot_pi05", "libero"): "lerobot_libero",
        ("rlinf_pi05_maniskill", "maniskill"): "rlinf_maniskill",
    }
)
"""(processor preset, env kind) -> the protocol that the preset's checkpoints were evaluated with."""


def list_protocols() -> dict[str, str]:
    """Protocol name -> description.

    Example:
        >>> sorted(list_protocols())
        ['lerobot_libero', 'openpi_libero', 'phyai', 'rlinf_maniskill']
    """
    return {name: p.description for name, p in _protocols().items()}


def get_protocol(name: str, env_kind: str | None = None) -> EvalProtocol:
    """The protocol `name`; a `ValueError` names the known ones, or the env kinds it applies to.

    Example:
        >>> get_protocol("openpi_libero", "mujoco")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: --protocol 'openpi_libero' applies to libero envs, got a mujoco env. Fix: ...
    """
    protocols = _protocols()
    if name not in protocols:
        raise ValueError(f"--protocol {name!r} is unknown; choose one of: {', '.join(protocols)}.")
    protocol = protocols[name]
    if env_kind is not None and protocol.env_kinds and env_kind not in protocol.env_kinds:
        raise ValueError(
            f"--protocol {name!r} applies to {'/'.join(protocol.env_kinds)} envs, got a {env_kind} env. Fix: pick "
            "a protocol of that env kind (phyai applies to every env)."
        )
    return protocol


def protocol_for_preset(preset: str | None, env_kind: str) -> EvalProtocol:
    """The protocol a processor preset's checkpoints are evaluated with on `env_kind` (else "phyai")."""
    return get_protocol(PRESET_PROTOCOLS.get((preset or "", env_kind), "phyai"))
