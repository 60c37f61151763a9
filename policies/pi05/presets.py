"""Named presets (DESIGN C7): the conventions a checkpoint's config.json does not carry.

Each preset fixes the prompt format, horizon H, executed chunk C, default denoise steps K, resize mode,
normalisation mode and epsilon rule, camera map (env camera name -> model slot), env state/action dims and
the tokenizer name. Sources: reference/pi05_model.md sections 3.3, 4 and 8; reference/rl_rollout.md section 1.

Camera names follow the adapters' canonical observation: LIBERO ``"image"`` (agent view) and
``"wrist_image"``; ManiSkill ``"image"`` (third-person view); otherwise the model slot names themselves.

Example:
    >>> get_preset("openpi_pi05_libero").prompt_format
    'text'
    >>> sorted(list_presets())[:2]
    ['lerobot_pi05', 'openpi_pi05_base']
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from policies.pi05.tokenizer import DEFAULT_TOKENIZER

_SLOT_IDENTITY = {
    "base_0_rgb": "base_0_rgb",
    "left_wrist_0_rgb": "left_wrist_0_rgb",
    "right_wrist_0_rgb": "right_wrist_0_rgb",
}
_LIBERO_CAMERAS = {"image": "base_0_rgb", "wrist_image": "left_wrist_0_rgb"}


@dataclass(frozen=True)
class Preset:
    """Conventions of one checkpoint family.

    Example:
        >>> p = get_preset("rlinf_pi05_libero")
        >>> (p.action_horizon, p.action_chunk, p.num_steps, dict(p.camera_map))
        (10, 5, 5, {'image': 'base_0_rgb', 'wrist_image': 'left_wrist_0_rgb'})
    """

    name: str
    """Preset name."""
    description: str
    """One line on where the conventions come from."""
    prompt_format: str
    """``"state"``, ``"lerobot_no_state"`` or ``"text"`` (see `policies.pi05.prompt`)."""
    action_horizon: int
    """H, actions the model produces in one call."""
    action_chunk: int
    """C, actions executed per policy call by default."""
    num_steps: int
    """K, default number of denoise steps."""
    resize_mode: str
    """``"antialias"`` (PIL, openpi) or ``"bilinear"`` (torch, LeRobot/phyai)."""
    norm_mode: str
    """``"identity"``, ``"mean_std"`` or ``"quantile"``."""
    eps_rule: str
    """``"openpi"``, ``"lerobot"`` or ``"phyai"``."""
    camera_map: Any = field(default_factory=dict)
    """Env camera name -> model slot name (read-only mapping)."""
    state_dim: int | None = None
    """Env state width S (None: any width, fixed by the statistics)."""
    action_dim: int = 32
    """Env action dims A kept from the 32 model dims."""
    max_token_len: int = 200
    """Maximum prompt length in tokens."""
    tokenizer: str = DEFAULT_TOKENIZER
    """Tokenizer name or folder (a stored name; not downloaded by tests)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "camera_map", MappingProxyType(dict(self.camera_map)))


def _presets() -> dict[str, Preset]:
    return {
        p.name: p
        for p in (
            Preset(
                name="openpi_pi05_base",
                description="openpi pi05_base: state-in-prompt, H=50, PIL resize, quantile +1e-6, 3 cameras.",
                prompt_format="state",
                action_horizon=50,
                action_chunk=50,
                num_steps=10,
                resize_mode="antialias",
                norm_mode="quantile",
                eps_rule="openpi",
                camera_map=_SLOT_IDENTITY,
            ),
            Preset(
                name="openpi_pi05_libero",
                description="openpi pi05_libero: pi0-style text prompt (no state), H=10, client replans every 5.",
                prompt_format="text",
                action_horizon=10,
                action_chunk=5,
                num_steps=10,
                resize_mode="antialias",
                norm_mode="quantile",
                eps_rule="openpi",
                camera_map=_LIBERO_CAMERAS,
                state_dim=8,
                action_dim=7,
            ),
            Preset(
                name="lerobot_pi05",
                description="LeRobot PI05Policy: state-in-prompt, H=50, torch bilinear, quantile eps only if q99==q01.",
                prompt_format="state",
                action_horizon=50,
                action_chunk=50,
                num_steps=10,
                resize_mode="bilinear",
                norm_mode="quantile",
                eps_rule="lerobot",
                camera_map=_SLOT_IDENTITY,
            ),
            Preset(
                name="rlinf_pi05_libero",
                description="RLinf PPO on LIBERO (openpi pi05_libero checkpoint): text prompt, H=10, C=5, K=5.",
                prompt_format="text",
                action_horizon=10,
                action_chunk=5,
                num_steps=5,
                resize_mode="antialias",
                norm_mode="quantile",
                eps_rule="openpi",
                camera_map=_LIBERO_CAMERAS,
                state_dim=8,
                action_dim=7,
            ),
            Preset(
                name="rlinf_pi05_maniskill",
                description="RLinf PPO on ManiSkill PutOnPlateInScene: text prompt, H=8, C=5, K=4, one camera.",
                prompt_format="text",
                action_horizon=8,
                action_chunk=5,
                num_steps=4,
                resize_mode="antialias",
                norm_mode="quantile",
                eps_rule="openpi",
                camera_map={"image": "base_0_rgb"},
                action_dim=7,
            ),
        )
    }


def list_presets() -> dict[str, str]:
    """Preset name -> one-line description."""
    return {name: p.description for name, p in _presets().items()}


def get_preset(name: str) -> Preset:
    """The preset called `name`.

    Raises:
        ValueError: unknown name (the message lists the presets).
    """
    presets = _presets()
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(presets)} (preset=...).")
    return presets[name]


def infer_preset(folder: str | Path) -> Preset:
    """Guess the preset of a checkpoint folder.

    Rules: a saved ``processor_config.json`` naming a preset; LeRobot ``config.json`` with ``"type": "pi05"``
    -> ``lerobot_pi05``; openpi ``assets/<id>/norm_stats.json`` whose id mentions ``libero`` ->
    ``openpi_pi05_libero``, ``maniskill`` -> ``rlinf_pi05_maniskill``.

    Raises:
        ValueError: nothing identifies the preset; the message lists the presets to pass as ``preset=``.
    """
    root = Path(folder)
    saved = root / "processor_config.json"
    if saved.is_file():
        name = json.loads(saved.read_text()).get("preset")
        if name:
            return get_preset(name)
    config = root / "config.json"
    if config.is_file():
        try:
            kind = json.loads(config.read_text()).get("type")
        except (json.JSONDecodeError, AttributeError):
            kind = None
        if kind == "pi05":
            return get_preset("lerobot_pi05")
    assets = root / "assets"
    ids = (
        [str(p.parent.relative_to(assets)).lower() for p in assets.glob("**/norm_stats.json")]
        if assets.is_dir()
        else []
    )
    if any("libero" in i for i in ids):
        return get_preset("openpi_pi05_libero")
    if any("maniskill" in i for i in ids):
        return get_preset("rlinf_pi05_maniskill")
    lines = "; ".join(f"{k}: {v}" for k, v in sorted(list_presets().items()))
    raise ValueError(
        f"cannot infer the preset of checkpoint {str(root)!r} (no processor_config.json preset, no LeRobot "
        f"config.json type 'pi05', no libero/maniskill openpi asset). Pass preset= one of: {lines}"
    )
