"""Vectorised resize-with-pad of camera images to the model resolution, on the images' device.

Two resampling modes (reference/pi05_model.md section 4.1):

- ``"antialias"``: PIL-compatible antialiased bilinear on uint8, as openpi's client does with
  ``Image.resize(BILINEAR)``. It is a separable triangle-filter resampling whose support widens with the
  downscale factor, computed with PIL's 22-bit fixed-point coefficients, horizontal pass first, the
  intermediate rounded to uint8 -- so it reproduces PIL's output (tests check within 1 uint8 level).
- ``"bilinear"``: torch bilinear without antialias on [0, 1] floats (LeRobot / phyai), rounded to uint8.

Both keep the aspect ratio: ``ratio = max(W / S, H / S)``, ``h' = int(H / ratio)``, ``w' = int(W / ratio)``,
centred zero padding with ``top = (S - h') // 2``. Results are uint8 so a rollout can store them
losslessly (DESIGN C5). Every op works on whole batches (N x cameras); there is no per-env loop.

Example:
    >>> import torch
    >>> imgs = torch.zeros(2, 256, 320, 3, dtype=torch.uint8)
    >>> resize_with_pad(imgs, 224, mode="antialias").shape
    torch.Size([2, 3, 224, 224])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

RESIZE_MODES: tuple[str, ...] = ("antialias", "bilinear")
"""Supported resampling modes."""

_PRECISION_BITS = 22
"""Fixed-point precision of PIL's 8-bit resampling coefficients (32 - 8 - 2)."""


def resized_shape(height: int, width: int, size: int) -> tuple[int, int]:
    """(h', w') of an image of `height` x `width` fitted into `size` x `size` keeping its aspect ratio."""
    ratio = max(width / size, height / size)
    return int(height / ratio), int(width / ratio)


@functools.lru_cache(maxsize=64)
def _pil_bilinear_coeffs(in_size: int, out_size: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Tap start and fixed-point weights of PIL's antialiased bilinear filter, (out_size, taps).

    Returns host tuples (cached per size pair): the first input index of each output sample and its
    integer weights (scaled by 2**22); unused taps carry weight 0.
    """
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support = 1.0 * filter_scale  # the triangle filter has support 1
    inv = 1.0 / filter_scale
    starts: list[int] = []
    rows: list[list[float]] = []
    for i in range(out_size):
        center = (i + 0.5) * scale
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        w = [max(0.0, 1.0 - abs((j + lo - center + 0.5) * inv)) for j in range(hi - lo)]
        total = sum(w)
        if total != 0.0:
            w = [v / total for v in w]
        starts.append(lo)
        rows.append(w)
    taps = max(len(r) for r in rows)
    one = 1 << _PRECISION_BITS
    fixed = tuple(
        tuple(int(math.trunc(0.5 + v * one)) if v >= 0 else int(math.trunc(-0.5 + v * one)) for v in r)
        + (0,) * (taps - len(r))
        for r in rows
    )
    return tuple(starts), fixed


@functools.cache
def _coeff_tensors(in_size: int, out_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Device tensors of `_pil_bilinear_coeffs`, built once per (sizes, device).

    Returns the (out * taps,) input index of every tap (clamped into the image; a clamped tap has weight 0) and the
    (out, taps) int32 weights.
    """
    starts, fixed = _pil_bilinear_coeffs(in_size, out_size)
    taps = len(fixed[0])
    index = [min(start + t, in_size - 1) for start in starts for t in range(taps)]
    return (
        torch.tensor(index, dtype=torch.int64, device=device),
        torch.tensor(fixed, dtype=torch.int32, device=device),
    )


def _antialias_pass(x: torch.Tensor, out_size: int, dim: int) -> torch.Tensor:
    """One PIL-style 1-D resampling pass of uint8 (B, H, W, 3) `x` along `dim` (2 = width, 1 = height).

    Every tap is gathered at once, weighted and summed in int32: a fixed number of kernels whatever the tap count.
    """
    index, weights = _coeff_tensors(x.shape[dim], out_size, x.device)  # (out * taps,), (out, taps)
    taps = weights.shape[1]
    gathered = x.index_select(dim, index)  # (B, out * taps, W, 3) or (B, H, out * taps, 3)
    shape = [*x.shape[:dim], out_size, taps, *x.shape[dim + 1 :]]
    w = weights.reshape(out_size, taps, *([1] * (x.ndim - dim - 1)))
    acc = (gathered.reshape(shape).to(torch.int32) * w).sum(dim=dim + 1, dtype=torch.int32)
    acc += 1 << (_PRECISION_BITS - 1)  # round half up, as PIL does
    return (acc >> _PRECISION_BITS).clamp_(0, 255).to(torch.uint8)


def _resize_antialias(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """PIL ``Image.resize((width, height), BILINEAR)`` of uint8 (B, H, W, 3) images -> (B, h, w, 3).

    Horizontal pass first, intermediate rounded to uint8, then the vertical pass (PIL's order). On CPU the
    batch is processed in chunks so that the int32 temporaries stay in cache.
    """
    if x.device.type == "cpu":
        per_image = x.shape[1] * max(x.shape[2], width) * 3
        chunk = max(1, (1 << 21) // per_image)
        if x.shape[0] > chunk:
            return torch.cat([_resize_antialias(part, height, width) for part in x.split(chunk)])
    if x.shape[2] != width:
        x = _antialias_pass(x, width, 2)
    if x.shape[1] != height:
        x = _antialias_pass(x, height, 1)
    return x


def _resize_bilinear(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """LeRobot's torch bilinear (no antialias) of uint8 (B, H, W, 3) as [0, 1] floats, rounded to uint8."""
    x_f = x.permute(0, 3, 1, 2).to(torch.float32) / 255.0  # (B, 3, H, W)
    y = F.interpolate(x_f, size=(height, width), mode="bilinear", align_corners=False)
    return torch.round(torch.clamp(y, 0.0, 1.0) * 255.0).to(torch.uint8).permute(0, 2, 3, 1)


def resize_with_pad(
    images: torch.Tensor,
    size: int,
    mode: str = "antialias",
    *,
    rotate180: bool = False,
    hflip: bool = False,
) -> torch.Tensor:
    """Resize (..., H, W, 3) uint8 images into (..., 3, size, size) uint8, keeping the aspect ratio.

    Args:
        images: uint8 channel-last images with any leading batch dims, on any device.
        size: side of the square output.
        mode: ``"antialias"`` (PIL-compatible) or ``"bilinear"`` (torch, no antialias).
        rotate180: rotate by 180 degrees (flip H and W) before resizing.
        hflip: mirror left-right before resizing.

    Returns:
        Channel-first uint8 tensor (..., 3, size, size) on the input's device, zero-padded and centred.
    """
    if mode not in RESIZE_MODES:
        raise ValueError(f"resize_with_pad: mode must be one of {RESIZE_MODES}, got {mode!r}.")
    if images.dtype != torch.uint8 or images.ndim < 3 or images.shape[-1] != 3:
        raise ValueError(
            f"resize_with_pad: expected uint8 (..., H, W, 3) images, got dtype {images.dtype} shape "
            f"{tuple(images.shape)}."
        )
    lead = images.shape[:-3]
    height, width = images.shape[-3], images.shape[-2]
    x = images.reshape(-1, height, width, 3)  # (B, H, W, 3)
    if rotate180:
        x = torch.flip(x, dims=(1, 2))
    if hflip:
        x = torch.flip(x, dims=(2,))
    if (height, width) == (size, size):
        return x.permute(0, 3, 1, 2).contiguous().reshape(*lead, 3, size, size)
    new_h, new_w = resized_shape(height, width, size)
    x = x.contiguous()
    resized = _resize_antialias(x, new_h, new_w) if mode == "antialias" else _resize_bilinear(x, new_h, new_w)
    out = torch.zeros(x.shape[0], 3, size, size, dtype=torch.uint8, device=x.device)
    top, left = (size - new_h) // 2, (size - new_w) // 2
    out[:, :, top : top + new_h, left : left + new_w] = resized.permute(0, 3, 1, 2)
    return out.reshape(*lead, 3, size, size)


def resize_cameras(
    images: Sequence[torch.Tensor],
    size: int,
    mode: str = "antialias",
    *,
    rotate180: bool = False,
    hflip: bool = False,
) -> torch.Tensor:
    """Resize a list of per-camera (N, H_c, W_c, 3) uint8 batches into one (N, cams, 3, size, size) tensor.

    Cameras that share a resolution are resized in one batched call.
    """
    if not images:
        raise ValueError("resize_cameras: at least one camera is required.")
    n = images[0].shape[0]
    device = images[0].device
    out = torch.empty(n, len(images), 3, size, size, dtype=torch.uint8, device=device)
    groups: dict[tuple[int, int], list[int]] = {}
    for j, img in enumerate(images):
        groups.setdefault((img.shape[1], img.shape[2]), []).append(j)
    for cams in groups.values():
        stacked = images[cams[0]][:, None] if len(cams) == 1 else torch.stack([images[j] for j in cams], dim=1)
        resized = resize_with_pad(stacked, size, mode, rotate180=rotate180, hflip=hflip)
        if len(cams) == len(images):
            return resized
        for k, j in enumerate(cams):
            out[:, j] = resized[:, k]
    return out
