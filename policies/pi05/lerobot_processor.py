"""How a LeRobot checkpoint's processor files normalise: modes per feature, epsilon and statistics, read exactly.

LeRobot 0.6.1 saves a policy's processors as ``policy_preprocessor.json`` (its ``normalizer_processor`` step
normalises ``observation.state``) and ``policy_postprocessor.json`` (its ``unnormalizer_processor`` step
un-normalises ``action``), each step's statistics in a safetensors sidecar keyed ``<feature>.<stat>``. What
LeRobot applies, and so what this reader returns:

1. the mode of a feature is ``norm_map[<its feature type>]``, IDENTITY when the type is absent from the map,
   when the feature is not listed in ``features`` (state) or left out by ``normalize_observation_keys``;
   STATE and ACTION are independent;
2. a feature without statistics in the sidecar is passed through unchanged;
3. ``eps`` (default 1e-8) replaces a zero range and is added to std when normalising.

Anything this project cannot reproduce is refused with the file, the feature and the value: an unknown mode,
statistics a mode needs but the sidecar lacks, a visual feature normalised with statistics (PI0.5 scales
images itself), state and action epsilons that differ.

Example:
    >>> read_lerobot_normalization("/nonexistent") is None
    True
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checks import bad_input, check_float
from .normalize import MODE_STATS, NormStats, stats_from_dict

PREPROCESSOR = "policy_preprocessor.json"
"""LeRobot's pre-processing pipeline file (normalises the state)."""
POSTPROCESSOR = "policy_postprocessor.json"
"""LeRobot's post-processing pipeline file (un-normalises the actions)."""
LEROBOT_MODES: dict[str, str] = {
    "IDENTITY": "identity",
    "MEAN_STD": "mean_std",
    "QUANTILES": "quantile",
    "QUANTILE10": "quantile10",
    "MIN_MAX": "min_max",
}
"""LeRobot 0.6.1 `NormalizationMode` value -> our mode name."""
FEATURE_TYPES = ("STATE", "VISUAL", "ENV", "ACTION", "REWARD", "LANGUAGE")
"""LeRobot 0.6.1 `FeatureType` values (the keys of ``norm_map``)."""
STATE_KEY, ACTION_KEY = "observation.state", "action"
DEFAULT_EPS = 1e-8


@dataclass
class LerobotNormalization:
    """What a LeRobot checkpoint's processor files do to the state and the actions.

    Example:
        >>> LerobotNormalization().action_mode
        'identity'
    """

    state_mode: str = "identity"
    """Our name of the mode applied to ``observation.state``."""
    action_mode: str = "identity"
    """Our name of the mode applied (inverted) to ``action``."""
    eps: float = DEFAULT_EPS
    """The normaliser's epsilon."""
    stats: dict[str, NormStats] = field(default_factory=dict)
    """``{"state": ..., "actions": ...}``, the vectors that have statistics."""


@dataclass
class _Step:
    file: Path
    norm_map: dict[str, str]
    eps: float
    features: dict[str, dict[str, Any]]
    observation_keys: set[str] | None
    tensors: dict[str, dict[str, Any]]
    sidecar: Path | None


def read_lerobot_normalization(folder: str | Path) -> LerobotNormalization | None:
    """The normalisation of a LeRobot checkpoint folder, or None when it has no LeRobot processor files.

    Raises:
        ValueError: a file is unreadable or asks for something that cannot be reproduced (the message names
            the file, the feature and the value).
    """
    root = Path(folder)
    pre = _normalizer_step(root, PREPROCESSOR, "normalizer_processor")
    post = _normalizer_step(root, POSTPROCESSOR, "unnormalizer_processor")
    if pre is None and post is None:
        return None
    out = LerobotNormalization()
    if pre is not None:
        _refuse_visual(pre)
        feature = pre.features.get(STATE_KEY)
        if feature is not None and (pre.observation_keys is None or STATE_KEY in pre.observation_keys):
            out.state_mode, stats = _feature(pre, STATE_KEY, str(feature.get("type")))
            if stats is not None:
                out.stats["state"] = stats
        out.eps = pre.eps
    action_step = post if post is not None else pre
    if action_step is not None:
        out.action_mode, stats = _feature(action_step, ACTION_KEY, "ACTION")
        if stats is not None:
            out.stats["actions"] = stats
        both = out.state_mode != "identity" and out.action_mode != "identity"
        if pre is not None and post is not None and post.eps != pre.eps and both:
            raise ValueError(
                bad_input(f"{post.file}: config.eps", f"the eps of {pre.file.name} ({pre.eps})", post.eps,
                          "one epsilon for state and actions is supported; make the two files agree")
            )  # fmt: skip
        if post is not None and (pre is None or out.state_mode == "identity"):
            out.eps = post.eps
    return out


def _normalizer_step(root: Path, name: str, registry_name: str) -> _Step | None:
    """The (un)normaliser step of one pipeline file, or None when the file or the step is absent."""
    path = root / name
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); restore the file from the checkpoint.") from err
    steps = data.get("steps") if isinstance(data, dict) else None
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise ValueError(bad_input(f"{path}: steps", "a list of step objects (LeRobot's pipeline layout)", steps))
    found = [s for s in steps if s.get("registry_name") == registry_name]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(bad_input(f"{path}: steps", f"at most one {registry_name!r} step", f"{len(found)}",
                                   raw=True))  # fmt: skip
    step = found[0]
    config = step.get("config", {})
    if not isinstance(config, dict):
        raise ValueError(bad_input(f"{path}: {registry_name}.config", "an object", config))
    norm_map = config.get("norm_map", {})
    if not isinstance(norm_map, dict):
        raise ValueError(bad_input(f"{path}: norm_map", "an object feature type -> mode", norm_map))
    for kind, mode in norm_map.items():
        if kind not in FEATURE_TYPES:
            raise ValueError(bad_input(f"{path}: norm_map key", f"one of LeRobot's feature types {FEATURE_TYPES}",
                                       kind))  # fmt: skip
        if mode not in LEROBOT_MODES:
            raise ValueError(
                bad_input(f"{path}: norm_map[{kind!r}]", f"one of LeRobot's modes {tuple(LEROBOT_MODES)}", mode,
                          "this checkpoint uses a normalisation this project does not implement; convert its "
                          "statistics to one of the listed modes")
            )  # fmt: skip
    eps = check_float(f"{path}: config.eps", config.get("eps", DEFAULT_EPS), 0.0, exclusive_minimum=True)
    features = config.get("features", {})
    if not isinstance(features, dict) or not all(isinstance(v, dict) for v in features.values()):
        raise ValueError(bad_input(f"{path}: features", "an object key -> {type, shape}", features))
    for key, feature in features.items():
        if feature.get("type") not in FEATURE_TYPES:
            raise ValueError(bad_input(f"{path}: features[{key!r}].type", f"one of {FEATURE_TYPES}",
                                       feature.get("type")))  # fmt: skip
    keys = config.get("normalize_observation_keys")
    if keys is not None and (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)):
        raise ValueError(bad_input(f"{path}: normalize_observation_keys", "a list of feature keys", keys))
    tensors, sidecar = _sidecar(root, path, step.get("state_file"))
    return _Step(path, dict(norm_map), eps, features, None if keys is None else set(keys), tensors, sidecar)


def _sidecar(root: Path, path: Path, state_file: Any) -> tuple[dict[str, dict[str, Any]], Path | None]:
    """Sidecar tensors grouped ``{feature: {stat: array}}`` (empty without a state file)."""
    if state_file is None:
        return {}, None
    if not isinstance(state_file, str) or not state_file.endswith(".safetensors") or "/" in state_file:
        raise ValueError(bad_input(f"{path}: state_file", "a .safetensors file name in the same folder",
                                   state_file))  # fmt: skip
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    sidecar = root / state_file
    if not sidecar.is_file():
        raise ValueError(bad_input(f"{path}: state_file", "an existing file", str(sidecar),
                                   "copy the statistics file that belongs to this processor JSON"))  # fmt: skip
    try:
        flat = load_file(str(sidecar))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{sidecar}: cannot be read as safetensors ({err}); it is truncated or corrupt.") from err
    grouped: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        feature, _, stat = key.rpartition(".")
        grouped.setdefault(feature, {})[stat] = value
    return grouped, sidecar


def _feature(step: _Step, key: str, kind: str) -> tuple[str, NormStats | None]:
    """(our mode, statistics or None) that `step` applies to feature `key` of type `kind`."""
    mode = LEROBOT_MODES[step.norm_map.get(kind, "IDENTITY")]
    found = step.tensors.get(key)
    if mode == "identity" or not found:
        return "identity", None  # LeRobot passes a feature without statistics through unchanged
    where = f"{step.sidecar}: {key}"
    missing = [s for s in MODE_STATS[mode] if s not in found]
    if missing:
        raise ValueError(
            bad_input(where, f"statistics {list(MODE_STATS[mode])} (norm_map[{kind!r}] is "
                      f"{step.norm_map[kind]!r})", f"only {sorted(found)}",
                      "recompute the statistics for that mode or change the mode in the JSON", raw=True)
        )  # fmt: skip
    stats = stats_from_dict(found, where)
    shape = step.features.get(key, {}).get("shape")
    if isinstance(shape, list) and len(shape) == 1 and shape[0] != stats.width:
        raise ValueError(bad_input(where, f"{shape[0]} values per statistic ({step.file.name} gives shape {shape})",
                                   f"{stats.width}", raw=True))  # fmt: skip
    return mode, stats


def _refuse_visual(step: _Step) -> None:
    """PI0.5 maps images to [-1, 1] itself; a LeRobot file that normalises images with statistics is refused."""
    mode = step.norm_map.get("VISUAL", "IDENTITY")
    for key, feature in step.features.items():
        if feature.get("type") == "VISUAL" and mode != "IDENTITY" and step.tensors.get(key):
            raise ValueError(
                bad_input(f"{step.file}: norm_map['VISUAL'] for {key!r}", "'IDENTITY' (PI0.5 scales images to "
                          "[-1, 1] itself)", mode, "set VISUAL to IDENTITY; this processor does not normalise images "
                          "with dataset statistics")
            )  # fmt: skip
