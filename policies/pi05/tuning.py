"""Tuned dispatch thresholds as data: one entry per GPU name in `data/tuned_thresholds.json`, and a default.

A threshold picks between two kernels that compute the same thing, where the faster one depends on the GPU. The
values live in the JSON beside the benchmark rows that justify them; a new GPU gets its own entry after its rows
are measured, and any device without one (CPU included) uses ``default``.

Example:
    >>> import torch
    >>> thresholds(torch.device("cpu")).geglu_min_waves
    4
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch

TABLE = Path(__file__).resolve().parent / "data" / "tuned_thresholds.json"
"""The per-GPU table."""


@dataclass(frozen=True)
class Thresholds:
    """The tuned thresholds of one device."""

    gemm_max_scores: int
    """Above this many score elements (B * Nh * T * S) the "gemm" attention backend hands the call to SDPA: its
    float32 score tensor then costs more memory traffic than SDPA's fused kernel loses to poor occupancy."""
    flash_min_scores: int
    """At or above this many score elements "flash_large" and "triton_flash" run FlashAttention-4 (where it runs);
    below it SDPA, respectively the Triton kernel, whose key splits keep small calls busy."""
    geglu_min_waves: int
    """The GeGLU GEMM kernel serves calls of at least this many output tiles a program (one program per SM); below
    it one cuBLAS GEMM over the gate/up stack and the GeGLU kernel are faster."""


@functools.cache
def _entries() -> dict[str, Thresholds]:
    """Every entry of the table (read once; the file is package data)."""
    table = json.loads(TABLE.read_text())
    names = [f.name for f in fields(Thresholds)]
    return {gpu: Thresholds(**{n: int(entry[n]["value"]) for n in names})
            for gpu, entry in table.items() if isinstance(entry, dict)}  # fmt: skip


def thresholds(device: torch.device | str | None = None) -> Thresholds:
    """The thresholds of `device`: its GPU's entry, else the default (None and CPU devices: the default)."""
    return _for_device(None if device is None else torch.device(device))


@functools.cache
def _for_device(device: torch.device | None) -> Thresholds:
    """The entry of `device`'s GPU name (a lookup per device, cached: it runs on every attention call)."""
    entries = _entries()
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return entries["default"]
    return entries.get(torch.cuda.get_device_name(device), entries["default"])
