"""State/action normalisation: modes, the three epsilon rules, and reading/writing statistics files.

Modes (LeRobot 0.6.1's `NormalizationMode` in our spelling): ``"identity"``, ``"mean_std"``, ``"quantile"``
(q01/q99 mapped to [-1, 1]), ``"quantile10"`` (q10/q90) and ``"min_max"`` (min/max). Epsilon rules
(reference/pi05_model.md section 4.2; the formulas keep each reference's operation order), with (lo, hi) the
mode's pair of statistics:

| rule | range modes | inverse | mean/std | inverse |
|---|---|---|---|---|
| ``openpi`` | (x-lo)/(hi-lo+1e-6)*2-1 | (y+1)/2*(hi-lo+1e-6)+lo | (x-mu)/(sd+1e-6) | y*(sd+1e-6)+mu |
| ``lerobot`` | 2*(x-lo)/d-1, d=hi-lo (eps if 0) | (y+1)*d/2+lo (min_max (y+1)/2*d+lo) | (x-mu)/(sd+eps) | y*sd+mu |
| ``phyai`` | (x-lo)/(hi-lo+1e-8)*2-1 | (y+1)/2*(hi-lo+1e-8)+lo | (x-mu)/(sd+1e-8) | y*(sd+1e-8)+mu |

The ``lerobot`` rule's eps is 1e-8 unless the checkpoint's processor JSON says otherwise (``eps=``).
openpi reads its JSON stats as float64 numpy arrays, so the ``openpi`` rule computes in float64 (then
returns float32); the others compute in float32. Stats shorter than the vector normalise the first dims and
leave the rest untouched; longer stats are cut to the vector (openpi's rule). Nothing is clipped.

Statistics files: openpi ``norm_stats.json`` (``{"norm_stats": {"state": {...}, "actions": {...}}}``, at the
folder root or under ``assets/<asset_id>/``) and LeRobot's ``policy_preprocessor.json`` /
``policy_postprocessor.json`` with safetensors sidecars (read by `policies.pi05.lerobot_processor`).

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

from ..checks import bad_input, check_choice, check_float

NORM_MODES: tuple[str, ...] = ("identity", "mean_std", "quantile", "quantile10", "min_max")
"""Supported normalisation modes (every mode of LeRobot 0.6.1)."""
MODE_STATS: dict[str, tuple[str, str]] = {
    "mean_std": ("mean", "std"),
    "quantile": ("q01", "q99"),
    "quantile10": ("q10", "q90"),
    "min_max": ("min", "max"),
}
"""The statistics each non-identity mode reads."""
EPS_RULES: tuple[str, ...] = ("openpi", "lerobot", "phyai")
"""Supported epsilon rules."""
DEFAULT_EPS: dict[str, float] = {"openpi": 1e-6, "lerobot": 1e-8, "phyai": 1e-8}
"""Each rule's epsilon."""
STATS_FILE = "norm_stats.json"
"""File name written by `save_norm_stats` (openpi layout)."""

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
    min: np.ndarray | None = None
    """Minimum per dimension."""
    max: np.ndarray | None = None
    """Maximum per dimension."""
    q10: np.ndarray | None = None
    """10th percentile per dimension."""
    q90: np.ndarray | None = None
    """90th percentile per dimension."""

    def __post_init__(self) -> None:
        widths: dict[str, int] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            try:
                value = np.asarray(value, dtype=np.float64)
            except (TypeError, ValueError) as err:
                raise ValueError(bad_input(f"NormStats.{f.name}", "a list of numbers", value, raw=False)) from err
            if value.ndim > 1 and sum(s > 1 for s in value.shape) > 1:
                raise ValueError(bad_input(f"NormStats.{f.name}", "a vector (one value per dimension)",
                                           f"shape {value.shape}", raw=True))  # fmt: skip
            value = value.reshape(-1)
            if value.size == 0:
                raise ValueError(bad_input(f"NormStats.{f.name}", "at least one value", "an empty list", raw=True))
            bad = np.flatnonzero(~np.isfinite(value))
            if bad.size:
                raise ValueError(bad_input(
                    f"NormStats.{f.name}", "finite values", f"{value[bad[0]]} at index {int(bad[0])}", raw=True,
                    fix="recompute the statistics; a NaN/Inf statistic makes every action NaN"))  # fmt: skip
            setattr(self, f.name, value)
            widths[f.name] = value.shape[0]
        if len(set(widths.values())) > 1:
            raise ValueError(bad_input("NormStats", "statistics of one length", f"lengths {widths}", raw=True))

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
        need = MODE_STATS.get(mode, ())
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
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def of(cls, values: Any) -> NormStats:
        """Every statistic of a dataset's vectors `values` (rows x dims), as openpi's compute_norm_stats gives them.

        Example:
            >>> NormStats.of(np.arange(101.0)[:, None]).q99.tolist()
            [99.0]
        """
        x = np.asarray(values, dtype=np.float64)
        if x.ndim != 2 or x.shape[0] == 0:
            raise ValueError(bad_input("NormStats.of: values", "a (rows, dims) array with rows", f"shape {x.shape}",
                                       raw=True))  # fmt: skip
        q = np.quantile(x, [0.01, 0.10, 0.90, 0.99], axis=0)
        return cls(mean=x.mean(0), std=x.std(0), q01=q[0], q99=q[3], min=x.min(0), max=x.max(0), q10=q[1], q90=q[2])




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
        eps: float | None = None,
    ) -> None:
        check_choice("norm_mode", mode, NORM_MODES)
        check_choice("eps_rule", eps_rule, EPS_RULES)
        self.mode = mode
        self.eps_rule = eps_rule
        self.eps = DEFAULT_EPS[eps_rule] if eps is None else check_float("eps", eps, 0.0, exclusive_minimum=True)
        """The rule's epsilon (1e-6 openpi, 1e-8 otherwise, unless given)."""
        self.stats = stats
        self.device = torch.device(device)
        self._dtype = torch.float64 if eps_rule == "openpi" else torch.float32
        self._t: dict[str, torch.Tensor] = {}
        if mode != "identity" and stats is not None and stats.width:
            stats.require(mode, "normalisation")
            for k in MODE_STATS[mode]:
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
        lo, hi = (v[:k] for v in self._t.values())  # (mean, std) or the mode's (low, high) pair
        eps = self.eps
        if self.mode == "mean_std":
            mean, std = lo, hi
            if inverse:
                y = head * std + mean if self.eps_rule == "lerobot" else head * (std + eps) + mean
            else:
                y = (head - mean) / (std + eps)
        elif self.eps_rule == "lerobot":
            d = hi - lo
            d = torch.where(d == 0, torch.full_like(d, eps), d)
            if not inverse:
                y = 2.0 * (head - lo) / d - 1.0
            elif self.mode == "min_max":  # LeRobot's MIN_MAX inverse has its own operation order
                y = (head + 1) / 2 * d + lo
            else:
                y = (head + 1.0) * d / 2.0 + lo
        else:
            y = (head + 1.0) / 2.0 * (hi - lo + eps) + lo if inverse else (head - lo) / (hi - lo + eps) * 2.0 - 1.0
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
    from .lerobot_processor import read_lerobot_normalization

    found = read_lerobot_normalization(root)
    return {} if found is None else found.stats


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
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); restore the file from the checkpoint.") from err
    table = data.get("norm_stats", data) if isinstance(data, dict) else data
    if not isinstance(table, dict):
        raise ValueError(bad_input(str(path), "{'norm_stats': {'state': {...}, 'actions': {...}}}", table))
    return {key: stats_from_dict(table[key], f"{path}: {key}") for key in ("state", "actions") if key in table}


def stats_from_dict(data: Any, where: str) -> NormStats:
    """`NormStats.from_dict` whose errors start with `where` (file and vector), e.g. ``"norm_stats.json: state"``."""
    if not isinstance(data, dict):
        raise ValueError(bad_input(where, "a dict of statistics (mean, std, q01, q99, ...)", data))
    try:
        return NormStats.from_dict(data)
    except ValueError as err:
        raise ValueError(f"{where} statistics: {err}") from err


def save_norm_stats(folder: str | Path, stats: dict[str, NormStats]) -> Path:
    """Write `stats` as an openpi-layout ``norm_stats.json`` in `folder`; returns the file path."""
    path = Path(folder) / STATS_FILE
    payload = {"norm_stats": {key: value.to_dict() for key, value in stats.items()}}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
