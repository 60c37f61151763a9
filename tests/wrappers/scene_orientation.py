"""Orientation checks derived from the rendered scenes (shared by the adapter and end-to-end tests).

Each check takes one upright image as a person would look at it, (H, W, 3) uint8 (numpy or torch; channel-first
model pixels must be permuted first), and asserts a property of the scene that a flipped image fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _hwc(image: Any) -> np.ndarray:
    array = image.detach().cpu().numpy() if hasattr(image, "detach") else np.asarray(image)
    assert array.ndim == 3 and array.shape[-1] == 3, f"expected an (H, W, 3) image, got shape {array.shape}"
    return array.astype(np.float64)


def _warm(x: np.ndarray) -> float:
    return float((x[..., 0] - x[..., 2]).mean())  # red minus blue: wood is red-brown, floor and sky grey


def assert_libero_agentview_upright(image: Any) -> None:
    """LIBERO agent view: it looks over the (bright, warm wooden) table at the robot, which stands on the grey
    floor at the far side, so upright the table fills the bottom band and floor + robot the top band."""
    agent = _hwc(image)
    band = agent.shape[0] // 8
    top, bottom = agent[:band], agent[-band:]
    assert bottom.mean() > top.mean() + 30, (top.mean(), bottom.mean())
    assert _warm(bottom) > _warm(top) + 15, (_warm(top), _warm(bottom))


def assert_libero_wrist_upright(image: Any) -> None:
    """LIBERO eye-in-hand camera: the dark gripper fingers are at the bottom edge when upright."""
    wrist = _hwc(image)
    band = wrist.shape[0] // 8
    assert wrist[-band:].mean() < wrist[:band].mean() - 40, (wrist[:band].mean(), wrist[-band:].mean())


def assert_maniskill_upright(image: Any) -> None:
    """ManiSkill third-person camera: it looks down at the (warm, wooden) table with the grey floor and sky
    beyond it, so upright the table fills the bottom band and grey the top."""
    scene = _hwc(image)
    band = scene.shape[0] // 8
    top, bottom = scene[:band], scene[-band:]
    assert _warm(bottom) > _warm(top) + 30, (_warm(top), _warm(bottom))
