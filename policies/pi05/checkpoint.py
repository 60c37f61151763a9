"""PI0.5 checkpoints: safetensors folders in the LeRobot / openpi-PyTorch key layouts, and our own.

One name mapping (`to_internal_name`) serves checkpoint loading and weight sync. Only safetensors is read:
pickle-based formats (.bin/.pt/.pth) can run code when loaded and are refused with a conversion hint.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..checks import bad_input
from .config import Pi05Config

# External prefix -> internal prefix. The first match wins; a leading "model." (LeRobot policy) is stripped first.
_PREFIXES: tuple[tuple[str, str], ...] = (
    ("paligemma_with_expert.paligemma.model.vision_tower.vision_model.", "vision."),
    ("paligemma_with_expert.paligemma.vision_tower.vision_model.", "vision."),
    ("paligemma_with_expert.paligemma.model.multi_modal_projector.linear.", "projector."),
    ("paligemma_with_expert.paligemma.multi_modal_projector.linear.", "projector."),
    ("paligemma_with_expert.paligemma.model.language_model.", "llm."),
    ("paligemma_with_expert.paligemma.language_model.model.", "llm."),
    ("paligemma_with_expert.paligemma.language_model.", "llm."),
    ("paligemma_with_expert.gemma_expert.model.", "expert."),
)
TIED_EMBEDDING = "paligemma_with_expert.paligemma.lm_head.weight"
"""The tied token embedding as stored in LeRobot / openpi files (safetensors de-duplicates tied tensors)."""
DEAD_KEYS = ("paligemma_with_expert.gemma_expert.lm_head.weight",)
"""Keys that exist in published files but feed nothing (the expert's unused LM head)."""
RL_HEAD_PREFIXES = ("value_head.", "noise_head.")
"""Parameters absent from SFT checkpoints; initialised and reported as such, not as missing."""
EXTERNAL_OF_INTERNAL = {internal: external for external, internal in _PREFIXES[::-1]}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
WEIGHTS_FILE = "model.safetensors"
"""The weights file of a single-file checkpoint."""
INDEX_FILE = "model.safetensors.index.json"
"""The index of a sharded checkpoint (``{"weight_map": {key: shard file}}``)."""


class CheckpointError(ValueError):
    """A checkpoint folder or file cannot be loaded as asked; the message lists what is wrong and the fix."""


@functools.lru_cache(maxsize=1 << 16)
def to_internal_name(name: str) -> str | None:
    """Map a LeRobot / openpi / own parameter name to ours; None for known dead keys.

    Memoised: a weight sync maps the same few hundred names on every update.

    Example:
        >>> to_internal_name("model.paligemma_with_expert.gemma_expert.model.layers.0.mlp.up_proj.weight")
        'expert.layers.0.mlp.up_proj.weight'
        >>> to_internal_name("paligemma_with_expert.paligemma.lm_head.weight")
        'llm.embed_tokens.weight'
        >>> to_internal_name("paligemma_with_expert.gemma_expert.lm_head.weight") is None
        True
    """
    if name.startswith("model."):
        name = name[len("model.") :]
    if name in DEAD_KEYS:
        return None
    if name == TIED_EMBEDDING:
        return "llm.embed_tokens.weight"
    for external, internal in _PREFIXES:
        if name.startswith(external):
            return internal + name[len(external) :]
    return name


def to_external_name(name: str) -> str:
    """Our parameter name -> the LeRobot / openpi-PyTorch name (without LeRobot's policy-level `model.`)."""
    for internal, external in (("vision.", _PREFIXES[0][0]), ("projector.", _PREFIXES[2][0])):
        if name.startswith(internal):
            return external + name[len(internal) :]
    if name.startswith("llm."):
        return _PREFIXES[4][0] + name[len("llm.") :]
    if name.startswith("expert."):
        return _PREFIXES[7][0] + name[len("expert.") :]
    return name


@dataclass
class LoadReport:
    """What a checkpoint load did.

    Attributes:
        loaded: internal names written from the file.
        missing: model parameters the file did not provide (RL heads excluded).
        unexpected: file keys that map to no parameter.
        mismatched: (name, expected shape, file shape).
        dropped: known dead keys skipped on purpose.
        initialized: RL head parameters absent from the file, left at their initialisation.
        embedding_source: which file key gave the token embedding.
    """

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    initialized: list[str] = field(default_factory=list)
    embedding_source: str | None = None

    @property
    def ok(self) -> bool:
        """True when nothing is missing, unexpected or mismatched."""
        return not (self.missing or self.unexpected or self.mismatched)

    def problems(self) -> str:
        """A readable list of what is wrong."""
        lines = []
        if self.missing:
            lines.append(f"missing keys ({len(self.missing)}): {self.missing[:20]}")
        if self.unexpected:
            lines.append(f"unexpected keys ({len(self.unexpected)}): {self.unexpected[:20]}")
        for name, want, got in self.mismatched[:20]:
            lines.append(f"shape mismatch for {name}: model expects {list(want)}, checkpoint has {list(got)}")
        return "\n".join(lines)


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint folder (single file, or shards listed in the index)."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"checkpoint path {str(root)!r} does not exist; pass a folder with model.safetensors.")
    if root.is_file():
        candidates = [root]
    else:
        index = root / INDEX_FILE
        single = root / WEIGHTS_FILE
        if index.exists():
            candidates = [root / s for s in _index_shards(index)]
        elif single.exists():
            candidates = [single]
        else:
            candidates = sorted(root.glob("*.safetensors"))
            if not candidates:
                pickled = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
                if pickled:
                    _refuse_pickle(root / pickled[0])
                raise CheckpointError(
                    f"checkpoint folder {str(root)!r} has no model.safetensors, sharded index or *.safetensors "
                    "file; save weights with safetensors (save_pretrained does)."
                )
    for candidate in candidates:
        if candidate.suffix in _PICKLE_SUFFIXES:
            _refuse_pickle(candidate)
        if not candidate.exists():
            raise CheckpointError(f"checkpoint shard {str(candidate)!r} listed in the index does not exist.")
    return candidates


def _index_shards(index: Path) -> list[str]:
    """The shard file names a ``model.safetensors.index.json`` lists (plain names in the same folder)."""
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{str(index)!r} is not valid JSON ({err}); restore the index file.") from err
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(bad_input(f"{index}: weight_map", "a non-empty object tensor name -> shard file",
                                        weight_map))  # fmt: skip
    shards = sorted(set(weight_map.values()), key=str)
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise CheckpointError(bad_input(f"{index}: weight_map shard", "a .safetensors file name in the same "
                                            "folder (no directories)", shard))  # fmt: skip
    return shards


def _refuse_pickle(path: Path, argument: str | None = None) -> None:
    where = f"{argument}: " if argument else ""
    raise CheckpointError(
        f"{where}refusing to load {str(path)!r}: only safetensors checkpoints are read, because pickle-based "
        "formats (.bin/.pt/.pth) can execute code when loaded. Convert it once in a trusted environment: "
        "python -c \"import torch; from safetensors.torch import save_file; "
        f"save_file(torch.load('{path.name}', weights_only=True), 'model.safetensors')\""
    )


def checkpoint_folder(path: str | os.PathLike, argument: str = "path") -> Path:
    """The checkpoint folder `path` names, or a `CheckpointError` saying what it is instead and the fix.

    Refused: a hub id (never fetched: download it first), a path to a file inside the folder (the folder is
    expected), a missing folder, a folder with only pickle weights (with the conversion command), a folder
    without safetensors weights or without config.json. `argument` is how the caller names the value
    (``"checkpoint"`` in `make_policy`, ``"--checkpoint"`` on the command line).

    Example:
        >>> checkpoint_folder("lerobot/pi05_libero", "checkpoint")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        policies.pi05.checkpoint.CheckpointError: checkpoint: expected a local checkpoint folder, got ...
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(bad_input(argument, "a checkpoint folder path (str or Path)", path))
    root = Path(path).expanduser()
    text = str(path)
    layout = f"config.json and {WEIGHTS_FILE} (written by Pi05Policy.save_pretrained, or a LeRobot/openpi export)"
    if not root.exists():
        if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) and not text.startswith((".", "~")):
            got = f"{text!r}, no local folder but a Hugging Face hub id by its look: hub ids are not fetched"
            fix = f"download it first (huggingface-cli download {text} --local-dir DIR) and pass DIR"
            raise CheckpointError(bad_input(argument, "a local checkpoint folder", got, fix, raw=True))
        raise CheckpointError(bad_input(argument, "an existing checkpoint folder", f"{text!r}: no such folder",
                                        f"pass a folder with {layout}", raw=True))  # fmt: skip
    if root.is_file():
        if root.suffix in _PICKLE_SUFFIXES:
            _refuse_pickle(root, argument)
        raise CheckpointError(bad_input(argument, "the checkpoint folder, not a file in it", f"the file {text!r}",
                                        f"pass its folder {str(root.parent)!r}", raw=True))  # fmt: skip
    has_weights = (root / WEIGHTS_FILE).is_file() or (root / INDEX_FILE).is_file() or any(root.glob("*.safetensors"))
    if not has_weights:
        pickled = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickled:
            _refuse_pickle(root / pickled[0], argument)
        got = f"{text!r} with no {WEIGHTS_FILE} (it holds {sorted(p.name for p in root.iterdir())[:8]})"
        fix = "point at the folder that holds the safetensors weights"
        raise CheckpointError(bad_input(argument, f"a folder with {WEIGHTS_FILE}", got, fix, raw=True))
    if not (root / "config.json").is_file():
        load_config(root)  # raises with the fix
    return root


def iter_tensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (file key, tensor) from every safetensors file of a checkpoint, one tensor at a time."""
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    yield key, handle.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(
                f"cannot read {str(file)!r} as safetensors ({err}); the file is truncated or corrupt — "
                "download or save it again."
            ) from err


def load_config(path: str | os.PathLike) -> Pi05Config:
    """Read config.json (ours, LeRobot's `"type": "pi05"`, or an openpi-converted reference config)."""
    file = Path(path) / "config.json"
    if not file.exists():
        raise CheckpointError(
            f"checkpoint folder {str(path)!r} has no config.json. Fix: copy the checkpoint's config.json into it, "
            "or write one with Pi05Config.save(folder / 'config.json') (Pi05Config.pi05_base() is the published "
            "geometry)."
        )
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{str(file)!r} is not valid JSON ({err}).") from err
    if not isinstance(data, dict):
        raise CheckpointError(bad_input(str(file), "a JSON object of Pi05Config fields", data))
    try:
        if "type" not in data and "paligemma_variant" in data:  # openpi converter's reference-only config
            return Pi05Config.pi05_base(action_horizon=data.get("action_horizon", 50),
                                        action_dim=data.get("action_dim", 32))  # fmt: skip
        return Pi05Config.from_dict(data)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{file}: {err}") from err


def load_weights(
    model: torch.nn.Module, path: str | os.PathLike, strict: bool = True
) -> LoadReport:
    """Copy checkpoint tensors into `model` in place (cast to each parameter's dtype) and report.

    The token embedding comes from `embed_tokens` when the file has it, else from the tied `lm_head`.
    With `strict`, any missing / unexpected / mismatched key raises `CheckpointError` listing them, and the
    model is left untouched (everything is validated before the first copy).
    """
    params = dict(model.named_parameters())
    report = LoadReport()
    staged: dict[str, torch.Tensor] = {}
    for key, tensor in iter_tensors(path):
        name = to_internal_name(key)
        if name is None:
            report.dropped.append(key)
            continue
        if name == "llm.embed_tokens.weight":
            if report.embedding_source is not None:  # both embed_tokens and the tied lm_head are stored
                tied_first = report.embedding_source.endswith("lm_head.weight")
                report.dropped.append(report.embedding_source if tied_first else key)
                if not tied_first:
                    continue
            report.embedding_source = key
        if name not in params:
            report.unexpected.append(key)
            continue
        if tuple(tensor.shape) != tuple(params[name].shape):
            report.mismatched.append((name, tuple(params[name].shape), tuple(tensor.shape)))
            continue
        staged[name] = tensor
    for name in params:
        if name in staged:
            continue
        if name.startswith(RL_HEAD_PREFIXES):
            report.initialized.append(name)
        else:
            report.missing.append(name)
    if strict and not report.ok:
        raise CheckpointError(f"checkpoint {str(path)!r} does not match the model (strict=True):\n{report.problems()}")
    with torch.no_grad():
        for name, tensor in staged.items():
            params[name].copy_(tensor.to(params[name].dtype))
            report.loaded.append(name)
    refresh = getattr(model, "refresh_fused_weights", None)  # a live Pi05Model's fused weight copies
    if refresh is not None:
        refresh()
    return report


def save_weights(model: torch.nn.Module, path: str | os.PathLike) -> Path:
    """Write the model's parameters to `path`/model.safetensors under LeRobot / openpi names (exact dtypes)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {to_external_name(n): p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    file = root / "model.safetensors"
    tmp = root / "model.safetensors.tmp"
    # one metadata key: safetensors writes several in hash-map order, so the same weights would differ in bytes
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(file)
    return file
