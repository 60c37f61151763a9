"""The PI0.5 processor: canonical observations (DESIGN C1) to `ModelInputs`, model actions to env actions.

Pre-processing of a batch of N observations:
  images  {camera: (N, H, W, 3) uint8}  -> camera map -> resize-with-pad -> (N, cams, 3, S, S) uint8
  state   (N, S_state) float            -> normalise (quantile / mean-std, epsilon rule) -> bins
  task    N strings                     -> prompt format -> (N, L) int32 ids + (N,) lengths (on device)
Images and states reach the device as they come (uint8 pixels, through pinned memory from the host) and are
resized and normalised there; each distinct task is tokenised once (`PromptBuilder`, a bounded cache).
Post-processing: (N, H, 32) model actions -> first C steps -> first A dims -> un-normalise -> gripper map.

Inputs are validated at this boundary; errors name the key, the expected and received value and a fix, and
leave the processor unchanged.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from policies.checks import bad_input, check_bool, check_choice, check_float, check_int, check_int_tuple
from policies.pi05.config import CAMERA_SLOTS, Pi05Config
from policies.pi05.image_ops import RESIZE_MODES, resize_cameras
from policies.pi05.inputs import ModelInputs
from policies.pi05.lerobot_processor import read_lerobot_normalization
from policies.pi05.normalize import (
    EPS_RULES,
    NORM_MODES,
    STATS_FILE,
    Normalizer,
    NormStats,
    find_openpi_stats,
    load_norm_stats,
    read_openpi_stats,
    save_norm_stats,
    stats_from_dict,
)
from policies.pi05.presets import Preset, get_preset, infer_preset
from policies.pi05.prompt import DEFAULT_BUCKETS, PROMPT_FORMATS, PromptBuilder, capped_buckets, clean_task
from policies.pi05.tokenizer import (
    DEFAULT_TOKENIZER,
    PALIGEMMA_VOCAB_SIZE,
    PromptTokenizer,
    check_vocab,
    load_tokenizer,
)

CONFIG_FILE = "processor_config.json"
"""File written by `Pi05Processor.save_pretrained`."""
GRIPPER_MAPS: tuple[str, ...] = ("none", "binary", "invert")
"""``binary``: g -> +1 if g > threshold else -1 (RLinf ManiSkill); ``invert``: g -> -g."""

_STATS_FIELDS = ("state_stats", "action_stats")


@dataclass
class ProcessorConfig:
    """Every option of `Pi05Processor`; saved as ``processor_config.json`` (statistics in ``norm_stats.json``).

    Example:
        >>> cfg = ProcessorConfig(camera_map={"image": "base_0_rgb"}, prompt_format="text", action_dim=7)
        >>> ProcessorConfig.from_dict(cfg.to_dict()) == cfg
        True
        >>> ProcessorConfig.from_preset("openpi_pi05_libero").resize_mode
        'antialias'
    """

    camera_map: dict[str, str] = field(default_factory=lambda: {s: s for s in CAMERA_SLOTS})
    """Env camera name -> model slot name; slots no camera maps to are not computed."""
    camera_slots: tuple[str, ...] = CAMERA_SLOTS
    """Model slots in prefix order (`ModelInputs.slots` indexes this)."""
    image_size: int = 224
    """Model image resolution S."""
    resize_mode: str = "antialias"
    """``"antialias"`` (PIL-compatible, openpi) or ``"bilinear"`` (torch, LeRobot/phyai)."""
    rotate180: bool = False
    """Rotate every image by 180 degrees (for sources whose adapter does not; LIBERO adapters already do)."""
    hflip: bool = False
    """Mirror every image left-right."""
    prompt_format: str = "state"
    """``"state"``, ``"lerobot_no_state"`` or ``"text"``."""
    max_token_len: int = 200
    """Maximum prompt length; longer prompts are truncated with a one-time warning."""
    prompt_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    """Prompt lengths L a call may return (capped at max_token_len)."""
    norm_mode: str = "quantile"
    """State mode (and the action mode unless `action_norm_mode` is set): one of `NORM_MODES`."""
    action_norm_mode: str | None = None
    """Action mode when it differs from the state's (LeRobot sets each feature type apart); None: `norm_mode`."""
    eps_rule: str = "openpi"
    """``"openpi"`` (+1e-6), ``"lerobot"`` (eps only where the range is 0) or ``"phyai"`` (+1e-8)."""
    norm_eps: float | None = None
    """Epsilon of the rule (None: the rule's own, 1e-6 openpi / 1e-8 otherwise); LeRobot files carry theirs."""
    state_stats: NormStats | None = None
    """Statistics of the env state (None: the state is used as is)."""
    action_stats: NormStats | None = None
    """Statistics of the env actions (None: actions are not un-normalised)."""
    state_dim: int | None = None
    """Expected state width (None: any; statistics, when present, fix it)."""
    action_dim: int = 32
    """Env action dims A kept from the model's dims."""
    model_action_dim: int = 32
    """Padded model action dims."""
    gripper_map: str = "none"
    """Post-processing of the gripper action: ``"none"``, ``"binary"`` or ``"invert"``."""
    gripper_index: int = -1
    """Env action index of the gripper."""
    gripper_threshold: float = 0.5
    """Threshold of the ``"binary"`` gripper map."""
    tokenizer: str = DEFAULT_TOKENIZER
    """Tokenizer hub id or local folder (never replaced by the stand-in)."""
    vocab_size: int = PALIGEMMA_VOCAB_SIZE
    """Model embedding rows; a tokenizer with more tokens is refused."""
    check_finite_on_device: bool = False
    """Also reject NaN/Inf in states that arrive on an accelerator (costs a device-to-host sync)."""
    action_horizon: int | None = None
    """Preset's model horizon H (read by the policy; None: the model config decides)."""
    action_chunk: int | None = None
    """Preset's default executed chunk C (read by the policy; None: the policy decides)."""
    num_steps: int | None = None
    """Preset's default denoise steps K (read by the policy; None: the model config decides)."""
    preset: str | None = None
    """Name of the preset this config came from (informational; used to infer it on reload)."""

    def __post_init__(self) -> None:
        name = "ProcessorConfig"
        if not isinstance(self.camera_map, Mapping):
            raise TypeError(bad_input(f"{name}.camera_map", "a dict env camera -> model slot", self.camera_map))
        self.camera_map = {str(k): str(v) for k, v in dict(self.camera_map).items()}
        if isinstance(self.camera_slots, str) or not all(isinstance(c, str) for c in self.camera_slots):
            raise TypeError(bad_input(f"{name}.camera_slots", "a sequence of slot names", self.camera_slots))
        self.camera_slots = tuple(self.camera_slots)
        self.prompt_buckets = check_int_tuple(f"{name}.prompt_buckets", self.prompt_buckets, minimum=1)
        for key in _STATS_FIELDS:
            value = getattr(self, key)
            if isinstance(value, Mapping):
                setattr(self, key, stats_from_dict(dict(value), f"{name}.{key}"))
            elif value is not None and not isinstance(value, NormStats):
                raise TypeError(bad_input(f"{name}.{key}", "NormStats, a dict of statistics or None", value))
        choices = {
            "resize_mode": RESIZE_MODES,
            "prompt_format": PROMPT_FORMATS,
            "norm_mode": NORM_MODES,
            "eps_rule": EPS_RULES,
            "gripper_map": GRIPPER_MAPS,
        }
        for key, allowed in choices.items():
            check_choice(f"{name}.{key}", getattr(self, key), allowed)
        if self.action_norm_mode is not None:
            check_choice(f"{name}.action_norm_mode", self.action_norm_mode, NORM_MODES, "or None for norm_mode's")
        if self.norm_eps is not None:
            self.norm_eps = check_float(f"{name}.norm_eps", self.norm_eps, 0.0, exclusive_minimum=True)
        for key in ("rotate180", "hflip", "check_finite_on_device"):
            setattr(self, key, check_bool(f"{name}.{key}", getattr(self, key)))
        self.image_size = check_int(f"{name}.image_size", self.image_size, 1)
        self.max_token_len = check_int(f"{name}.max_token_len", self.max_token_len, 2)
        self.vocab_size = check_int(f"{name}.vocab_size", self.vocab_size, 1)
        self.model_action_dim = check_int(f"{name}.model_action_dim", self.model_action_dim, 1)
        fix = f"keep 1..model_action_dim ({self.model_action_dim}) env action dims"
        self.action_dim = check_int(f"{name}.action_dim", self.action_dim, 1, self.model_action_dim, fix=fix)
        self.gripper_index = check_int(f"{name}.gripper_index", self.gripper_index, -self.action_dim,
                                       self.action_dim - 1)  # fmt: skip
        self.gripper_threshold = check_float(f"{name}.gripper_threshold", self.gripper_threshold)
        for key in ("state_dim", "action_horizon", "action_chunk", "num_steps"):
            if getattr(self, key) is not None:
                setattr(self, key, check_int(f"{name}.{key}", getattr(self, key), 1, fix="or None"))
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise TypeError(bad_input(f"{name}.tokenizer", "a tokenizer hub id or folder (str)", self.tokenizer))
        if not isinstance(self.preset, str | None):
            raise TypeError(bad_input(f"{name}.preset", "a preset name or None", self.preset))
        if not self.camera_map:
            raise ValueError("ProcessorConfig.camera_map: expected at least one camera -> slot entry, got {}.")
        unknown = sorted(set(self.camera_map.values()) - set(self.camera_slots))
        if unknown:
            raise ValueError(
                f"ProcessorConfig.camera_map: slots {unknown} are not model slots; expected names from "
                f"{self.camera_slots}."
            )
        if len(set(self.camera_map.values())) != len(self.camera_map):
            raise ValueError(
                f"ProcessorConfig.camera_map: two cameras map to the same slot in {self.camera_map}; "
                "each slot takes one camera."
            )
        capped_buckets(self.prompt_buckets, self.max_token_len)
        if self.state_stats is not None and self.norm_mode != "identity":
            self.state_stats.require(self.norm_mode, "state")
            if self.state_dim is not None and self.state_stats.width != self.state_dim:
                raise ValueError(
                    f"ProcessorConfig: state_stats cover {self.state_stats.width} dims but state_dim is "
                    f"{self.state_dim}; give matching statistics or state_dim=None."
                )
        if self.action_stats is not None and self.action_mode != "identity":
            self.action_stats.require(self.action_mode, "action")

    @property
    def action_mode(self) -> str:
        """The mode the actions are un-normalised with (`action_norm_mode`, else `norm_mode`)."""
        return self.action_norm_mode or self.norm_mode

    # ------------------------------------------------------------------------------------- serialising
    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every option except the statistics (those go to ``norm_stats.json``)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in _STATS_FIELDS:
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **stats: NormStats | None) -> ProcessorConfig:
        """Build from `to_dict()` output (plus optional ``state_stats=`` / ``action_stats=``)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                bad_input("ProcessorConfig", f"field names {sorted(known)}", f"unknown ProcessorConfig keys {unknown}",
                          f"remove them from {CONFIG_FILE} (or save the processor again)", raw=True)
            )  # fmt: skip
        return cls(**dict(data), **stats)

    @classmethod
    def from_preset(cls, preset: str | Preset, **overrides: Any) -> ProcessorConfig:
        """The processor options of a named preset, with `overrides` applied."""
        p = get_preset(preset) if isinstance(preset, str) else preset
        base: dict[str, Any] = dict(
            camera_map=dict(p.camera_map),
            resize_mode=p.resize_mode,
            prompt_format=p.prompt_format,
            max_token_len=p.max_token_len,
            norm_mode=p.norm_mode,
            eps_rule=p.eps_rule,
            state_dim=p.state_dim,
            action_dim=p.action_dim,
            tokenizer=p.tokenizer,
            action_horizon=p.action_horizon,
            action_chunk=p.action_chunk,
            num_steps=p.num_steps,
            preset=p.name,
        )
        base.update(overrides)
        return cls(**base)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(getattr(x, "shape", ()))


def _dtype_name(x: Any) -> str:
    dtype = getattr(x, "dtype", type(x).__name__)
    return str(dtype).replace("torch.", "")


def _check_rows(rows: dict[str, int]) -> None:
    """Every key of an observation has the same number of rows N; otherwise name the key(s) that differ."""
    if len(set(rows.values())) <= 1:
        return
    counts = sorted(rows.values(), key=list(rows.values()).count)
    n = counts[-1]  # the most common row count
    odd = [k for k, v in rows.items() if v != n]
    listed = ", ".join(f"{k} {v}" for k, v in rows.items())
    raise ValueError(
        bad_input(" and ".join(odd), f"{n} rows like the other keys (one per env)", f"row counts {listed}",
                  "give every key of obs one row per env (and one task string per env)", raw=True)
    )  # fmt: skip


class Pi05Processor:
    """Turns canonical observations into `ModelInputs` on a device, and model actions into env actions.

    Example:
        >>> import tempfile, numpy as np
        >>> from policies.pi05.tokenizer import build_standin_tokenizer
        >>> cfg = ProcessorConfig(camera_map={"image": "base_0_rgb"}, image_size=32,
        ...                       tokenizer=str(build_standin_tokenizer(tempfile.mkdtemp())), action_dim=7)
        >>> proc = Pi05Processor(cfg)
        >>> obs = {"images": {"image": np.zeros((2, 48, 64, 3), np.uint8)},
        ...        "state": np.zeros((2, 8), np.float32), "task": ["open the drawer", "close it"]}
        >>> x = proc(obs)
        >>> tuple(x.images.shape), x.slots, x.tokens.dtype
        ((2, 1, 3, 32, 32), (0,), torch.int32)
        >>> proc.postprocess(torch.zeros(2, 10, 32), action_chunk=5).shape
        torch.Size([2, 5, 7])
    """

    def __init__(
        self,
        config: ProcessorConfig,
        device: torch.device | str = "cpu",
        tokenizer: PromptTokenizer | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer)
        check_vocab(self.tokenizer, config.vocab_size)
        slot_index = {name: i for i, name in enumerate(config.camera_slots)}
        used = sorted((slot_index[slot], cam) for cam, slot in config.camera_map.items())
        self.slots: tuple[int, ...] = tuple(i for i, _ in used)
        """Model slot index of each used camera, in slot order."""
        self.cameras: tuple[str, ...] = tuple(cam for _, cam in used)
        """Env camera names in the order of `slots`."""
        rule, eps = config.eps_rule, config.norm_eps
        self.state_normalizer = Normalizer(config.state_stats, config.norm_mode, rule, self.device, eps)
        self.action_normalizer = Normalizer(config.action_stats, config.action_mode, rule, self.device, eps)
        self.prompt = PromptBuilder(
            self.tokenizer, config.prompt_format, config.max_token_len, config.prompt_buckets, self.device
        )
        if config.norm_mode != "identity" and config.prompt_format == "state" and config.state_stats is None:
            warnings.warn(
                f"Pi05Processor: norm_mode={config.norm_mode!r} but no state statistics; the raw state is "
                "discretised into the prompt. Pass state_stats (or load a checkpoint with norm stats).",
                stacklevel=2,
            )

    @classmethod
    def for_config(
        cls,
        model_config: Pi05Config,
        *,
        action_dim: int = 7,
        device: torch.device | str = "cpu",
        tokenizer: PromptTokenizer | str | Path | None = None,
        preset: str | None = None,
        **overrides: Any,
    ) -> Pi05Processor:
        """A processor matching a model geometry (image size, slots, prompt length, vocab, action dims).

        `tokenizer` is a loaded tokenizer or a name/folder (stored in the config); `preset` (optional)
        supplies the conventions; `overrides` replace any `ProcessorConfig` field.
        """
        if isinstance(tokenizer, str | Path):
            overrides["tokenizer"] = str(tokenizer)
            tokenizer = None
        geometry: dict[str, Any] = dict(
            camera_slots=tuple(model_config.camera_slots),
            image_size=model_config.vision.image_size,
            max_token_len=model_config.max_token_len,
            vocab_size=model_config.vocab_size,
            model_action_dim=model_config.action_dim,
            action_dim=action_dim,
        )
        geometry.update(overrides)
        if preset is not None:
            config = ProcessorConfig.from_preset(preset, **geometry)
        else:
            geometry.setdefault("camera_map", {s: s for s in model_config.camera_slots})
            config = ProcessorConfig(**geometry)
        return cls(config, device=device, tokenizer=tokenizer)

    # ------------------------------------------------------------------------------------- properties
    @property
    def prompt_buckets(self) -> tuple[int, ...]:
        """Prompt lengths L a call can return."""
        return self.prompt.buckets

    @property
    def action_dim(self) -> int:
        """A, env action dims returned by `postprocess`."""
        return self.config.action_dim

    @property
    def action_horizon(self) -> int | None:
        """Preset's horizon H, or None."""
        return self.config.action_horizon

    @property
    def action_chunk(self) -> int | None:
        """Preset's executed chunk C, or None."""
        return self.config.action_chunk

    # ------------------------------------------------------------------------------------- validation
    def _validate(self, obs: Mapping[str, Any]) -> tuple[list[str], dict[str, Any], Any]:
        """Check obs against C1 and this config; returns (tasks, images by camera, state or None)."""
        if not isinstance(obs, Mapping):
            raise TypeError(
                f"obs: expected a mapping with keys 'images', 'state', 'task' (DESIGN C1), got {type(obs).__name__}."
            )
        for key in ("images", "task"):
            if key not in obs:
                raise ValueError(
                    f"obs: missing key {key!r}; expected keys 'images', 'state', 'task', got {sorted(obs)}."
                )
        tasks = obs["task"]
        if isinstance(tasks, str) or not isinstance(tasks, Sequence | np.ndarray):
            raise TypeError(
                f"obs['task']: expected a sequence of N strings, got {type(tasks).__name__}; wrap a single task "
                "in a list: ['pick up the bowl']."
            )
        tasks = list(tasks)
        n = len(tasks)
        if n == 0:
            raise ValueError("obs['task']: expected N >= 1 task strings, got an empty sequence.")
        for i, t in enumerate(tasks):
            if not isinstance(t, str):
                raise TypeError(f"obs['task'][{i}]: expected str, got {type(t).__name__} ({t!r}).")
            if not clean_task(t):
                raise ValueError(
                    f"obs['task'][{i}]: expected a non-empty task description, got {t!r}; every env needs an "
                    "instruction."
                )
        images = obs["images"]
        if not isinstance(images, Mapping):
            raise TypeError(
                f"obs['images']: expected a dict camera -> (N, H, W, 3) uint8, got {type(images).__name__}."
            )
        picked: dict[str, Any] = {}
        rows = {"obs['task']": n}  # rows per key: every key needs the same N
        for cam in self.cameras:
            if cam not in images:
                raise ValueError(
                    f"obs['images']: missing camera {cam!r} required by camera_map {self.config.camera_map}; "
                    f"got cameras {sorted(images)}. Rename the camera in the adapter or change camera_map."
                )
            img = images[cam]
            key = f"obs['images'][{cam!r}]"
            if not isinstance(img, np.ndarray | torch.Tensor):
                raise TypeError(f"{key}: expected a numpy array or torch tensor, got {type(img).__name__}.")
            if img.dtype not in (np.uint8, torch.uint8):
                raise TypeError(
                    f"{key}: expected dtype uint8, got {_dtype_name(img)}; convert [0, 1] floats with "
                    "(x * 255).round() cast to uint8."
                )
            shape = _shape(img)
            if len(shape) != 4 or shape[-1] != 3:
                hint = " (channel-first? permute to (N, H, W, 3))" if len(shape) == 4 and shape[1] == 3 else ""
                raise ValueError(f"{key}: expected shape (N, H, W, 3) with 3 RGB channels last, got {shape}{hint}.")
            if shape[1] < 1 or shape[2] < 1:
                raise ValueError(bad_input(key, "an image of at least 1 x 1 pixels (N, H, W, 3)", f"shape {shape}",
                                           "check the camera's render size", raw=True))  # fmt: skip
            rows[key] = shape[0]
            picked[cam] = img
        state = obs.get("state")
        needs_state = self.config.prompt_format == "state"
        if state is None:
            if needs_state:
                raise ValueError(
                    "obs['state']: missing; prompt_format='state' puts the state into the prompt. Provide an "
                    "(N, S) float state or use prompt_format='text'."
                )
            _check_rows(rows)
            return tasks, picked, None
        if not isinstance(state, np.ndarray | torch.Tensor):
            state = np.asarray(state)
        shape = _shape(state)
        is_float = (
            state.is_floating_point() if isinstance(state, torch.Tensor) else np.issubdtype(state.dtype, np.floating)
        )
        if not is_float:
            raise TypeError(
                f"obs['state']: expected a float array, got dtype {_dtype_name(state)}; cast with .astype(np.float32)."
            )
        if len(shape) != 2:
            raise ValueError(f"obs['state']: expected shape (N, S), got {shape}.")
        rows["obs['state']"] = shape[0]
        _check_rows(rows)
        width = self.expected_state_dim
        if width is not None and shape[1] != width:
            raise ValueError(
                f"obs['state']: expected width {width} (state statistics / state_dim), got {shape[1]}; build the "
                "state the checkpoint was trained with or pass matching statistics."
            )
        on_host = isinstance(state, np.ndarray) or state.device.type == "cpu"
        if on_host or self.config.check_finite_on_device:
            finite = np.isfinite(state).all() if isinstance(state, np.ndarray) else bool(torch.isfinite(state).all())
            if not finite:
                values = state if isinstance(state, np.ndarray) else state.detach().cpu().numpy()
                row, col = (int(i) for i in np.argwhere(~np.isfinite(values))[0])
                v = values[row, col]
                word = "NaN" if np.isnan(v) else ("Inf" if v > 0 else "-Inf")
                raise ValueError(
                    bad_input("obs['state']", "finite values", f"{word} at row {row} (env {row}), "
                              f"column {col}", "check the simulator state of that env or reset it", raw=True)
                )  # fmt: skip
        return tasks, picked, state

    @property
    def expected_state_dim(self) -> int | None:
        """State width the processor requires (statistics or `state_dim`), or None."""
        if self.config.state_dim is not None:
            return self.config.state_dim
        if self.state_normalizer.width:
            return self.state_normalizer.width
        return None

    # -------------------------------------------------------------------------------------------- call
    def _to_device(self, x: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Host arrays go to a CUDA device through pinned staging memory, so the copy is asynchronous.

        `pin_memory()` draws from PyTorch's caching host allocator: a block is reused by later calls once the copy
        out of it has finished (no host wait, no allocation after the first calls). Images stay uint8 here; the
        resize and the state normalisation run on the device.
        """
        if isinstance(x, np.ndarray):
            if any(s < 0 for s in x.strides):
                x = np.ascontiguousarray(x)
            x = torch.from_numpy(x)
        if self.device.type == "cuda" and x.device.type == "cpu" and not x.is_pinned():
            x = x.pin_memory()
        return x.to(self.device, non_blocking=True)

    def __call__(self, obs: Mapping[str, Any]) -> ModelInputs:
        """Process a batch of canonical observations into `ModelInputs` on the processor's device."""
        tasks, images, state = self._validate(obs)
        n = len(tasks)
        cfg = self.config
        pixels = resize_cameras(
            [self._to_device(images[c]) for c in self.cameras],
            cfg.image_size,
            cfg.resize_mode,
            rotate180=cfg.rotate180,
            hflip=cfg.hflip,
        )  # (N, cams, 3, S, S) uint8
        state_norm = None
        if state is not None:
            state_norm = self.state_normalizer.normalize(self._to_device(state), out_dtype=None)
        tokens, lengths = self.prompt(tasks, state_norm)
        return ModelInputs(
            images=pixels,
            image_mask=torch.ones(n, len(self.slots), dtype=torch.bool, device=self.device),
            slots=self.slots,
            tokens=tokens,
            lengths=lengths,
            state=None if state_norm is None else state_norm.to(torch.float32),
        )

    def postprocess(self, model_actions: torch.Tensor, action_chunk: int | None = None) -> torch.Tensor:
        """(N, H, D) model actions -> (N, C, A) float32 env actions (un-normalised, sliced, gripper-mapped).

        Args:
            model_actions: normalised, padded model output.
            action_chunk: C, the leading steps to keep (default: all H).
        """
        if not isinstance(model_actions, torch.Tensor) or model_actions.ndim != 3:
            raise ValueError(
                f"postprocess: expected model_actions as a (N, H, D) tensor, got {type(model_actions).__name__} "
                f"of shape {_shape(model_actions)}."
            )
        _, horizon, dim = model_actions.shape
        cfg = self.config
        if dim < cfg.action_dim:
            raise ValueError(f"postprocess: model_actions has {dim} dims, fewer than action_dim={cfg.action_dim}.")
        chunk = horizon if action_chunk is None else int(action_chunk)
        if not 1 <= chunk <= horizon:
            raise ValueError(
                f"postprocess: action_chunk must be in 1..H={horizon}, got {action_chunk}; the model produced "
                f"{horizon} steps."
            )
        actions = self.action_normalizer.unnormalize(model_actions[:, :chunk, : cfg.action_dim])
        if cfg.gripper_map != "none":
            g = actions[..., cfg.gripper_index]
            if cfg.gripper_map == "binary":
                mapped = torch.where(g > cfg.gripper_threshold, 1.0, -1.0).to(actions.dtype)
            else:
                mapped = -g
            actions = actions.clone()
            actions[..., cfg.gripper_index] = mapped
        return actions

    # -------------------------------------------------------------------------------------- save/load
    def save_pretrained(self, folder: str | Path) -> Path:
        """Write ``processor_config.json`` (+ ``norm_stats.json`` when statistics exist) into `folder`."""
        root = Path(folder)
        root.mkdir(parents=True, exist_ok=True)
        (root / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2, sort_keys=True) + "\n")
        stats = {
            k: v
            for k, v in (("state", self.config.state_stats), ("actions", self.config.action_stats))
            if v is not None
        }
        if stats:
            save_norm_stats(root, stats)
        elif (root / STATS_FILE).exists():
            (root / STATS_FILE).unlink()
        return root

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        *,
        device: torch.device | str = "cpu",
        preset: str | None = None,
        asset_id: str | None = None,
        tokenizer: PromptTokenizer | None = None,
        **overrides: Any,
    ) -> Pi05Processor:
        """Load a processor saved by `save_pretrained`, or build one for a LeRobot/openpi checkpoint folder.

        A folder without ``processor_config.json`` takes its conventions from `preset` (inferred when None,
        see `infer_preset`) and its statistics from the checkpoint files. `overrides` replace config fields.
        """
        root = Path(folder)
        saved = root / CONFIG_FILE
        if saved.is_file() and preset is None:
            stats = load_norm_stats(root)
            try:
                data = json.loads(saved.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{saved}: not valid JSON ({err}); save the processor again.") from err
            if not isinstance(data, dict):
                raise ValueError(bad_input(str(saved), "an object of ProcessorConfig fields", data))
            try:
                config = ProcessorConfig.from_dict(
                    data, state_stats=stats.get("state"), action_stats=stats.get("actions")
                )
            except (TypeError, ValueError) as err:
                raise type(err)(f"{saved}: {err}") from err
        else:
            chosen = get_preset(preset) if preset is not None else infer_preset(root)
            openpi = find_openpi_stats(root, asset_id)
            lerobot = None if openpi else read_lerobot_normalization(root)
            stats = read_openpi_stats(openpi) if openpi else ({} if lerobot is None else lerobot.stats)
            extra: dict[str, Any] = {}
            if lerobot is not None:  # LeRobot's normaliser, per feature, with its formulas and epsilon
                extra.update(norm_mode=lerobot.state_mode, action_norm_mode=lerobot.action_mode,
                             eps_rule="lerobot", norm_eps=lerobot.eps)  # fmt: skip
            config = ProcessorConfig.from_preset(
                chosen, state_stats=stats.get("state"), action_stats=stats.get("actions"), **extra
            )
        if overrides:
            config = replace(config, **overrides)
        return cls(config, device=device, tokenizer=tokenizer)
