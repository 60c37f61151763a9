"""Typed configuration of the PI0.5 model: geometry of the three towers and the sampling options.

`Pi05Config.pi05_base()` is the published geometry (SigLIP So400m/14, Gemma-2B prefix, Gemma-300M expert).
`Pi05Config.tiny()` keeps every asymmetry of it at small sizes so that layout bugs show on CPU.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checks import bad_input, check_bool, check_float, check_int, check_int_tuple

CAMERA_SLOTS: tuple[str, ...] = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
"""Model camera slots, in the order their tokens enter the prefix."""


def _pair(value: Any) -> tuple[Any, Any]:
    if isinstance(value, str) or not hasattr(value, "__len__") or len(value) != 2:
        raise TypeError(bad_input("Pi05Config: noise_std_range", "a pair (s_min, s_max)", value))
    return tuple(value)


@dataclass
class SiglipConfig:
    """SigLIP vision tower geometry."""

    width: int = 1152
    """Hidden width of the encoder."""
    depth: int = 27
    """Number of pre-LN encoder blocks."""
    mlp_dim: int = 4304
    """Hidden width of each block's MLP."""
    num_heads: int = 16
    """Attention heads (head_dim = width // num_heads)."""
    patch_size: int = 14
    """Patch size of the convolutional stem."""
    image_size: int = 224
    """Square input resolution."""
    eps: float = 1e-6
    """LayerNorm epsilon."""

    @property
    def head_dim(self) -> int:
        """Per-head width."""
        return self.width // self.num_heads

    @property
    def num_patches(self) -> int:
        """Tokens per image."""
        return (self.image_size // self.patch_size) ** 2


@dataclass
class GemmaConfig:
    """Geometry of one Gemma stack (the PaliGemma LM or the action expert)."""

    width: int = 2048
    """Residual stream width."""
    depth: int = 18
    """Number of decoder layers."""
    mlp_dim: int = 16384
    """GeGLU hidden width."""
    num_heads: int = 8
    """Query heads."""
    num_kv_heads: int = 1
    """Key/value heads (1 = multi-query attention)."""
    head_dim: int = 256
    """Per-head width (independent of width: q_proj maps width -> num_heads * head_dim)."""
    eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10_000.0
    """RoPE base."""


@dataclass
class Pi05Config:
    """Geometry and runtime options of a PI0.5 policy.

    Example:
        >>> cfg = Pi05Config.tiny()
        >>> cfg.action_dim, len(cfg.camera_slots)
        (32, 3)
        >>> Pi05Config.from_dict(cfg.to_dict()) == cfg
        True
    """

    vision: SiglipConfig = field(default_factory=SiglipConfig)
    """SigLIP vision tower."""
    llm: GemmaConfig = field(default_factory=GemmaConfig)
    """PaliGemma Gemma-2B language model (the prefix stream)."""
    expert: GemmaConfig = field(
        default_factory=lambda: GemmaConfig(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1)
    )
    """Gemma-300M action expert (the suffix stream, adaRMS-conditioned on time)."""
    vocab_size: int = 257_152
    """Token embedding rows (PaliGemma vocabulary)."""
    action_dim: int = 32
    """Padded model action dimension."""
    action_horizon: int = 50
    """Actions per chunk produced by the model (H)."""
    num_steps: int = 10
    """Default number of Euler denoise steps (K)."""
    max_token_len: int = 200
    """Maximum prompt length in tokens."""
    camera_slots: tuple[str, ...] = CAMERA_SLOTS
    """Model camera slots in prefix order."""
    min_period: float = 4e-3
    """Smallest period of the sinusoidal time embedding."""
    max_period: float = 4.0
    """Largest period of the sinusoidal time embedding."""
    value_source: str = "prefix"
    """Critic input: "prefix" (mean LM output over valid prefix tokens), "suffix" (expert output), "none"."""
    value_hidden: tuple[int, ...] = (1024, 512, 256)
    """Hidden widths of the value head MLP."""
    value_chunk_only: bool = False
    """Suffix value source only: pool the first C positions instead of all H."""
    noise_head: bool = True
    """Build the learned noise head used by the `noise` rollout method."""
    noise_hidden: tuple[int, ...] = (128, 64)
    """Hidden widths of the noise head MLP."""
    noise_std_range: tuple[float, float] = (0.08, 0.16)
    """Bounds [s_min, s_max] of the noise head's standard deviation."""
    dtype: str = "bfloat16"
    """Compute dtype of the transformer blocks ("bfloat16" or "float32"); heads stay float32."""

    def __post_init__(self) -> None:
        # Derived values and cross-checks live here (STYLE item 2).
        for name in ("vision", "llm", "expert"):
            value = getattr(self, name)
            if isinstance(value, dict):
                cls = SiglipConfig if name == "vision" else GemmaConfig
                known = {f.name for f in dataclasses.fields(cls)}
                unknown = sorted(set(value) - known)
                if unknown:
                    raise ValueError(
                        f"Pi05Config.{name}: unknown {cls.__name__} fields {unknown}; known fields are {sorted(known)}."
                    )
                setattr(self, name, cls(**value))
            elif not isinstance(value, SiglipConfig | GemmaConfig):
                raise TypeError(bad_input(f"Pi05Config.{name}", "a dict of tower fields or a tower config", value))
            for f in dataclasses.fields(getattr(self, name)):
                size = getattr(getattr(self, name), f.name)
                if f.type == "int":
                    check_int(f"Pi05Config: {name}.{f.name}", size, 1)
                else:
                    check_float(f"Pi05Config: {name}.{f.name}", size, 0.0, exclusive_minimum=True)
        for attr in ("vocab_size", "action_dim", "action_horizon", "num_steps", "max_token_len"):
            check_int(f"Pi05Config: {attr}", getattr(self, attr), 1)
        for attr in ("min_period", "max_period"):
            check_float(f"Pi05Config: {attr}", getattr(self, attr), 0.0, exclusive_minimum=True)
        if self.max_period <= self.min_period:
            raise ValueError(bad_input("Pi05Config: max_period", f"> min_period ({self.min_period})", self.max_period))
        for attr in ("value_chunk_only", "noise_head"):
            check_bool(f"Pi05Config: {attr}", getattr(self, attr))
        if isinstance(self.camera_slots, str) or not self.camera_slots or not all(
            isinstance(c, str) and c for c in self.camera_slots
        ):
            raise TypeError(bad_input("Pi05Config: camera_slots", "a non-empty tuple of slot names", self.camera_slots))
        if len(set(self.camera_slots)) != len(self.camera_slots):
            raise ValueError(bad_input("Pi05Config: camera_slots", "distinct slot names", tuple(self.camera_slots)))
        self.camera_slots = tuple(self.camera_slots)
        self.value_hidden = check_int_tuple("Pi05Config: value_hidden", self.value_hidden, 1)
        self.noise_hidden = check_int_tuple("Pi05Config: noise_hidden", self.noise_hidden, 1)
        low, high = (check_float(f"Pi05Config: noise_std_range[{i}]", v, 0.0, exclusive_minimum=True)
                     for i, v in enumerate(_pair(self.noise_std_range)))  # fmt: skip
        if high < low:
            raise ValueError(bad_input("Pi05Config: noise_std_range", "(s_min, s_max) with s_min <= s_max",
                                       tuple(self.noise_std_range)))  # fmt: skip
        self.noise_std_range = (low, high)
        if self.llm.depth != self.expert.depth:
            raise ValueError(
                f"Pi05Config: llm.depth ({self.llm.depth}) must equal expert.depth ({self.expert.depth}); "
                "the expert runs one layer per LM layer over the joint attention."
            )
        for attr in ("num_heads", "num_kv_heads", "head_dim"):
            if getattr(self.llm, attr) != getattr(self.expert, attr):
                raise ValueError(
                    f"Pi05Config: llm.{attr} ({getattr(self.llm, attr)}) must equal expert.{attr} "
                    f"({getattr(self.expert, attr)}); both streams share one attention per layer."
                )
        if self.llm.num_heads % self.llm.num_kv_heads:
            raise ValueError(
                f"Pi05Config: llm.num_heads ({self.llm.num_heads}) must be a multiple of num_kv_heads "
                f"({self.llm.num_kv_heads})."
            )
        if self.value_source not in ("prefix", "suffix", "none"):
            raise ValueError(
                f"Pi05Config: value_source must be 'prefix', 'suffix' or 'none', got {self.value_source!r}."
            )
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"Pi05Config: dtype must be 'bfloat16', 'float32' or 'float16', got {self.dtype!r}.")
        if self.vision.width % self.vision.num_heads:
            raise ValueError(
                f"Pi05Config: vision.width ({self.vision.width}) must be divisible by vision.num_heads "
                f"({self.vision.num_heads})."
            )

    # ----------------------------------------------------------------------------------------- presets
    @classmethod
    def pi05_base(cls, **overrides: Any) -> Pi05Config:
        """The published PI0.5 geometry (about 3.35 B parameters without the RL heads)."""
        return cls(**overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> Pi05Config:
        """A small model that keeps every asymmetry of the real one (C7).

        Expert width (40) != heads x head_dim (4 x 24 = 96) != LM width (64); one KV head with 4 query heads;
        SigLIP head_dim (16) != LM head_dim (24); 3 camera slots; action dim 32; the full 257,152-row vocabulary
        so that a real or stand-in PaliGemma tokenizer fits.
        """
        base: dict[str, Any] = dict(
            vision=SiglipConfig(width=48, depth=2, mlp_dim=80, num_heads=3, patch_size=28, image_size=224),
            llm=GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=24),
            expert=GemmaConfig(width=40, depth=2, mlp_dim=72, num_heads=4, num_kv_heads=1, head_dim=24),
            action_horizon=10,
            num_steps=5,
            max_token_len=48,
            value_hidden=(32, 16),
            noise_hidden=(16, 8),
            dtype="float32",
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def small(cls, **overrides: Any) -> Pi05Config:
        """The tiny model with a 4-layer, 128-wide LM and action expert (RL from a cloned scripted expert).

        The tiny expert (2 layers, width 40) averages across a scripted push expert's phase switches; this one is
        the next size up for that job (docs/rl.md, section 5).

        >>> Pi05Config.small().expert.width, Pi05Config.small().llm.depth
        (128, 4)
        """
        base: dict[str, Any] = dict(
            llm=GemmaConfig(width=128, depth=4, mlp_dim=256, num_heads=4, num_kv_heads=1, head_dim=32),
            expert=GemmaConfig(width=128, depth=4, mlp_dim=256, num_heads=4, num_kv_heads=1, head_dim=32),
            value_hidden=(64, 32),
        )
        base.update(overrides)
        return cls.tiny(**base)

    # ------------------------------------------------------------------------------------- serialising
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (round-trips through `from_dict`)."""
        out = dataclasses.asdict(self)
        out["type"] = "phyai_pi05"
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Pi05Config:
        """Build from `to_dict()` output or from a LeRobot PI0.5 `config.json` (`"type": "pi05"`)."""
        data = dict(data)
        kind = data.pop("type", "phyai_pi05")
        if kind == "pi05":
            return cls.from_lerobot_dict(data)
        if kind != "phyai_pi05":
            raise ValueError(
                f"config.json: 'type' must be 'phyai_pi05' or LeRobot's 'pi05', got {kind!r}; "
                "this loader reads PI0.5 checkpoints only."
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config.json: unknown Pi05Config fields {unknown}; known fields are {sorted(known)}.")
        return cls(**data)

    @classmethod
    def from_lerobot_dict(cls, data: dict[str, Any]) -> Pi05Config:
        """Read the fields of a LeRobot `PI05Config` JSON that decide the model geometry.

        LeRobot has no size options: `gemma_2b`/`gemma_300m` are the only variants, so the towers take the
        published geometry; horizon, steps, prompt length and padded dims come from the file.
        """
        variants = (data.get("paligemma_variant", "gemma_2b"), data.get("action_expert_variant", "gemma_300m"))
        if variants != ("gemma_2b", "gemma_300m"):
            raise ValueError(
                f"config.json: paligemma_variant/action_expert_variant must be gemma_2b/gemma_300m, got {variants}."
            )
        dtype = data.get("dtype", "bfloat16")

        def integer(key: str, default: int) -> int:
            return check_int(f"config.json (LeRobot): {key}", data.get(key, default), 1)

        def number(key: str, default: float) -> float:
            return check_float(f"config.json (LeRobot): {key}", data.get(key, default), 0.0, exclusive_minimum=True)

        return cls.pi05_base(
            action_horizon=integer("chunk_size", 50),
            num_steps=integer("num_inference_steps", 10),
            max_token_len=integer("tokenizer_max_length", 200),
            action_dim=integer("max_action_dim", 32),
            min_period=number("min_period", 4e-3),
            max_period=number("max_period", 4.0),
            dtype=dtype if dtype in ("bfloat16", "float32") else "bfloat16",
        )

    def save(self, path: str | Path) -> None:
        """Write `config.json`-style JSON to `path`."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Pi05Config:
        """Read JSON written by `save` or by LeRobot."""
        return cls.from_dict(json.loads(Path(path).read_text()))
