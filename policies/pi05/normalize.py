"""State/action normalisation: modes, the three epsilon rules, and reading/writing statistics files.

Modes: ``"identity"``, ``"mean_std"``, ``"quantile"`` (q01/q99 mapped to [-1, 1]). Epsilon rules
(reference/pi05_model.md section 4.2; the formulas keep each reference's operation order):

| rule | quantile | inverse | mean/std | inverse |
|---|---|---|---|---|
| ``openpi`` | (x-q01)/(q99-q01+1e-6)*2-1 | (y+1)/2*(q99-q01+1e-6)+q01 | (x-mu)/(sd+1e-6) | y*(sd+1e-6)+mu |
| ``lerobot`` | 2*(x-q01)/d-1, d=q99-q01 or 1e-8 where d==0 | (y+1)*d/2+q01 | (x-mu)/(sd+1e-8) | y*sd+mu |
| ``phyai`` | (x-q01)/(q99-q01+1e-8)*2-1 | (y+1)/2*(q99-q01+1e-8)+q01 | (x-mu)/(sd+1e-8) | y*(sd+1e-8)+mu |

openpi reads its JSON stats as float64 numpy arrays, so the ``openpi`` rule computes in float64 (then
returns float32); the others compute in float32. Stats shorter than the vector normalise the first dims and
leave the rest untouched; longer stats are cut to the vector (openpi's rule). Nothing is clipped.

Statistics files: openpi ``norm_stats.json`` (``{"norm_stats": {"state": {...}, "actions": {...}}}``, at the
folder root or under ``assets/<asset_id>/``) and LeRobot's ``policy_preprocessor.json`` /
``policy_postprocessor.json`` with safetensors sidecars keyed ``observation.state.<stat>`` / ``action.<stat>``.

Example:
    >>> import torch
    >>> stats = NormStats(q01=np.array([0.0, -1.0]), q99=np.array([2.0, 1.0]))
    >>> norm = Normalizer(stats, mode="quantile", eps_rule="phyai")
    >>> y = norm.normalize(torch.tensor([[1.0, 0.5]]))
    >>> torch.allclose(norm.unnormalize(y), torch.tensor([[1.0, 0.5]]))
    True
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

NORM_MODES: tuple[str, ...] = ("identity", "mean_std", "quantile")
"""Supported normalisation modes."""
EPS_RULES: tuple[str, ...] = ("openpi", "lerobot", "phyai")
"""Supported epsilon rules."""
STATS_FILE = "norm_stats.json"
"""File name written by `save_norm_stats` (openpi layout)."""

_LEROBOT_KEYS = {"state": "observation.state", "actions": "action"}


@dataclass
class NormStats:
    """Per-dimension statistics of one vector (state or actions); any field may be missing.

    Example:
        >>> s = NormStats(mean=np.zeros(3), std=np.ones(3))
        >>> s.width, NormStats.from_dict(s.to_dict()) == s
        (3, True)
    """

    mean: np.ndarray | None = None
    """Mean per dimension."""
    std: np.ndarray | None = None
    """Standard deviation per dimension."""
    q01: np.ndarray | None = None
    """1st percentile per dimension."""
    q99: np.ndarray | None = None
    """99th percentile per dimension."""

    def __post_init__(self) -> None:
        widths = set()
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                value = np.asarray(value, dtype=np.float64).reshape(-1)
                setattr(self, f.name, value)
                widths.add(value.shape[0])
        if len(widths) > 1:
            raise ValueError(f"NormStats: all statistics must have the same length, got lengths {sorted(widths)}.")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NormStats):
            return NotImplemented
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if (a is None) != (b is None) or (a is not None and not np.array_equal(a, b)):
                return False
        return True

    @property
    def width(self) -> int:
        """Number of dimensions the statistics cover (0 if empty)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                return int(value.shape[0])
        return 0

    def require(self, mode: str, what: str) -> None:
        """Raise if the statistics that `mode` needs are missing."""
        need = {"mean_std": ("mean", "std"), "quantile": ("q01", "q99")}.get(mode, ())
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(
                f"{what} statistics lack {missing}, needed by norm_mode={mode!r}; provide them in "
                f"{STATS_FILE} or choose another norm_mode."
            )

    def to_dict(self) -> dict[str, list[float]]:
        """JSON-able dict of the present statistics."""
        return {f.name: getattr(self, f.name).tolist() for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NormStats:
        """Build from a dict with any of mean/std/q01/q99 (extra keys are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: np.asarray(v, dtype=np.float64) for k, v in data.items() if k in names})


def _check_mode(mode: str, eps_rule: str) -> None:
    if mode not in NORM_MODES:
        raise ValueError(f"norm_mode must be one of {NORM_MODES}, got {mode!r}.")
    if eps_rule not in EPS_RULES:
        raise ValueError(f"eps_rule must be one of {EPS_RULES}, got {eps_rule!r}.")


class Normalizer:
    """Applies one normalisation mode and epsilon rule with statistics held on a device.

    Example:
        >>> n = Normalizer(NormStats(mean=np.array([1.0]), std=np.array([2.0])), "mean_std", "openpi")
        >>> n.normalize(torch.tensor([[3.0, 7.0]])).tolist()  # 2nd dim has no stats: untouched
        [[0.9999995231628418, 7.0]]
    """

    def __init__(
        self,
        stats: NormStats | None,
        mode: str = "quantile",
        eps_rule: str = "openpi",
        device: torch.device | str = "cpu",
    ) -> None:
        _check_mode(mode, eps_rule)
        self.mode = mode
        self.eps_rule = eps_rule
        self.stats = stats
        self.device = torch.device(device)
        self._dtype = torch.float64 if eps_rule == "openpi" else torch.float32
        self._t: dict[str, torch.Tensor] = {}
        if mode != "identity" and stats is not None and stats.width:
            stats.require(mode, "normalisation")
            keys = ("mean", "std") if mode == "mean_std" else ("q01", "q99")
            for k in keys:
                self._t[k] = torch.as_tensor(getattr(stats, k), dtype=self._dtype, device=self.device)

    @property
    def width(self) -> int:
        """Dimensions covered by the statistics (0 = identity)."""
        return next(iter(self._t.values())).shape[0] if self._t else 0

    def _apply(self, x: torch.Tensor, inverse: bool, out_dtype: torch.dtype | None) -> torch.Tensor:
        if not self._t:
            return x if out_dtype is None else x.to(out_dtype)
        k = min(self.width, x.shape[-1])
        head = x[..., :k].to(self._dtype)
        t = {name: v[:k] for name, v in self._t.items()}
        rule = self.eps_rule
        if self.mode == "quantile":
            q01, q99 = t["q01"], t["q99"]
            if rule == "lerobot":
                d = q99 - q01
                d = torch.where(d == 0, torch.full_like(d, 1e-8), d)
                y = (head + 1.0) * d / 2.0 + q01 if inverse else 2.0 * (head - q01) / d - 1.0
            else:
                eps = 1e-6 if rule == "openpi" else 1e-8
                y = (
                    (head + 1.0) / 2.0 * (q99 - q01 + eps) + q01
                    if inverse
                    else (head - q01) / (q99 - q01 + eps) * 2.0 - 1.0
                )
        else:
            mean, std = t["mean"], t["std"]
            eps = 1e-6 if rule == "openpi" else 1e-8
            if inverse:
                y = head * std + mean if rule == "lerobot" else head * (std + eps) + mean
            else:
                y = (head - mean) / (std + eps)
        if k < x.shape[-1]:
            y = torch.cat([y, x[..., k:].to(y.dtype)], dim=-1)
        return y if out_dtype is None else y.to(out_dtype)

    def normalize(self, x: torch.Tensor, out_dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Map raw values (..., D) to model space (`out_dtype=None` keeps the rule's compute dtype)."""
        return self._apply(x, inverse=False, out_dtype=out_dtype)

    def unnormalize(self, y: torch.Tensor, out_dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Map model-space values (..., D) back to raw units (`out_dtype=None` keeps the compute dtype)."""
        return self._apply(y, inverse=True, out_dtype=out_dtype)


# --------------------------------------------------------------------------------------------- files
def load_norm_stats(folder: str | Path, asset_id: str | None = None) -> dict[str, NormStats]:
    """Read ``{"state": NormStats, "actions": NormStats}`` (keys present in the files) from a checkpoint folder.

    Looks, in order, for ``norm_stats.json`` at the root, ``assets/<asset_id>/norm_stats.json`` (any single
    asset when `asset_id` is None), then LeRobot's ``policy_preprocessor.json``/``policy_postprocessor.json``.
    Returns an empty dict when the folder has no statistics.

    Raises:
        ValueError: several asset folders and no `asset_id`, or a malformed file.
    """
    root = Path(folder)
    path = find_openpi_stats(root, asset_id)
    if path is not None:
        return read_openpi_stats(path)
    return read_lerobot_stats(root)


def find_openpi_stats(root: Path, asset_id: str | None = None) -> Path | None:
    """Path of the openpi ``norm_stats.json`` in `root`, or None."""
    if asset_id is not None:
        path = root / "assets" / asset_id / STATS_FILE
        if not path.is_file():
            raise ValueError(f"load_norm_stats: asset_id={asset_id!r} given but {path} does not exist.")
        return path
    if (root / STATS_FILE).is_file():
        return root / STATS_FILE
    found = sorted((root / "assets").glob(f"**/{STATS_FILE}")) if (root / "assets").is_dir() else []
    if len(found) > 1:
        ids = [str(p.parent.relative_to(root / "assets")) for p in found]
        raise ValueError(f"load_norm_stats: {root} has several asset folders {ids}; pass asset_id= to pick one.")
    return found[0] if found else None


def read_openpi_stats(path: Path) -> dict[str, NormStats]:
    """Parse an openpi ``norm_stats.json``."""
    data = json.loads(Path(path).read_text())
    table = data.get("norm_stats", data)
    if not isinstance(table, dict):
        raise ValueError(f"{path}: expected {{'norm_stats': {{'state': ..., 'actions': ...}}}}, got {type(table)}.")
    return {key: NormStats.from_dict(table[key]) for key in ("state", "actions") if key in table}


def read_lerobot_stats(root: Path) -> dict[str, NormStats]:
    """Statistics from LeRobot processor JSON files and their safetensors sidecars (empty if none)."""
    from safetensors.numpy import load_file

    out: dict[str, NormStats] = {}
    for name in ("policy_preprocessor.json", "policy_postprocessor.json"):
        path = root / name
        if not path.is_file():
            continue
        steps = json.loads(path.read_text()).get("steps", [])
        for step in steps:
            state_file = step.get("state_file")
            if "normalizer" not in str(step.get("registry_name", "")) or not state_file:
                continue
            tensors = load_file(str(root / state_file))
            for key, prefix in _LEROBOT_KEYS.items():
                found = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
                if found and key not in out:
                    out[key] = NormStats.from_dict(found)
    return out


def save_norm_stats(folder: str | Path, stats: dict[str, NormStats]) -> Path:
    """Write `stats` as an openpi-layout ``norm_stats.json`` in `folder`; returns the file path."""
    path = Path(folder) / STATS_FILE
    payload = {"norm_stats": {key: value.to_dict() for key, value in stats.items()}}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def lerobot_norm_mode(root: Path) -> str | None:
    """The STATE normalisation mode named in LeRobot's ``policy_preprocessor.json`` (our spelling), or None."""
    path = Path(root) / "policy_preprocessor.json"
    if not path.is_file():
        return None
    for step in json.loads(path.read_text()).get("steps", []):
        mode = step.get("config", {}).get("norm_map", {}).get("STATE")
        if mode is not None:
            return {"QUANTILES": "quantile", "MEAN_STD": "mean_std", "IDENTITY": "identity"}.get(mode)
    return None
