from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from policies.pi05.image_ops import resize_cameras, resize_with_pad, resized_shape


def _rand(shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def _pil_resize_with_pad(img: np.ndarray, size: int) -> np.ndarray:
    """openpi's client rule: PIL bilinear to (h', w'), centred zero padding; returns (3, S, S)."""
    h, w = resized_shape(img.shape[0], img.shape[1], size)
    resized = np.asarray(Image.fromarray(img).resize((w, h), resample=Image.BILINEAR))
    out = np.zeros((size, size, 3), dtype=np.uint8)
    top, left = (size - h) // 2, (size - w) // 2
    out[top : top + h, left : left + w] = resized
    return out.transpose(2, 0, 1)


@pytest.mark.parametrize("hw", [(40, 40), (48, 64), (64, 48), (20, 10), (100, 30), (33, 47), (32, 32)])
def test_antialias_matches_pil_within_one_level(hw):
    img = _rand((*hw, 3), seed=hw[0] * 1000 + hw[1])
    ours = resize_with_pad(torch.from_numpy(img)[None], 32, "antialias")[0].numpy()
    ref = _pil_resize_with_pad(img, 32)
    assert ours.shape == (3, 32, 32) and ours.dtype == np.uint8
    assert np.abs(ours.astype(int) - ref.astype(int)).max() <= 1


def test_aspect_rule_and_centred_padding():
    assert resized_shape(48, 64, 32) == (24, 32)
    assert resized_shape(256, 256, 224) == (224, 224)
    assert resized_shape(480, 640, 224) == (168, 224)
    img = np.full((1, 48, 64, 3), 200, dtype=np.uint8)
    out = resize_with_pad(torch.from_numpy(img), 32, "antialias")[0]
    top = (32 - 24) // 2
    assert (out[:, :top] == 0).all() and (out[:, top + 24 :] == 0).all()
    assert (out[:, top : top + 24] == 200).all()
    tall = resize_with_pad(torch.from_numpy(np.full((1, 64, 20, 3), 9, np.uint8)), 32, "bilinear")[0]
    h, w = resized_shape(64, 20, 32)
    left = (32 - w) // 2
    assert (tall[:, :, :left] == 0).all() and (tall[:, :, left + w :] == 0).all() and (tall[:, :, left] == 9).all()


def test_bilinear_is_torch_bilinear_without_antialias():
    img = _rand((2, 48, 64, 3), seed=3)
    ours = resize_with_pad(torch.from_numpy(img), 32, "bilinear")
    x = torch.from_numpy(img).permute(0, 3, 1, 2).float() / 255.0
    ref = torch.round(F.interpolate(x, size=(24, 32), mode="bilinear", align_corners=False).clamp(0, 1) * 255)
    assert torch.equal(ours[:, :, 4:28], ref.to(torch.uint8))


def test_batch_equals_single_calls_and_cameras():
    imgs = torch.from_numpy(_rand((3, 2, 40, 56, 3), seed=5))  # (N, cams, H, W, 3)
    for mode in ("antialias", "bilinear"):
        batch = resize_with_pad(imgs, 32, mode)
        assert batch.shape == (3, 2, 3, 32, 32)
        for i in range(3):
            for c in range(2):
                assert torch.equal(batch[i, c], resize_with_pad(imgs[i, c][None], 32, mode)[0])


def test_resize_cameras_mixed_resolutions():
    a = torch.from_numpy(_rand((2, 40, 40, 3), 1))
    b = torch.from_numpy(_rand((2, 24, 48, 3), 2))
    c = torch.from_numpy(_rand((2, 40, 40, 3), 3))
    out = resize_cameras([a, b, c], 32, "antialias")
    assert out.shape == (2, 3, 3, 32, 32)
    for j, img in enumerate((a, b, c)):
        assert torch.equal(out[:, j], resize_with_pad(img, 32, "antialias"))


def test_rotate_and_flip_options():
    img = torch.from_numpy(_rand((1, 40, 56, 3), 9))
    rot = resize_with_pad(img, 32, "antialias", rotate180=True)
    ref = resize_with_pad(torch.flip(img, dims=(1, 2)), 32, "antialias")
    assert torch.equal(rot, ref)
    flip = resize_with_pad(img, 32, "bilinear", hflip=True)
    assert torch.equal(flip, resize_with_pad(torch.flip(img, dims=(2,)), 32, "bilinear"))
    same = torch.from_numpy(_rand((1, 32, 32, 3), 4))
    assert torch.equal(resize_with_pad(same, 32, rotate180=True)[0], same[0].flip(0, 1).permute(2, 0, 1))


def test_passthrough_and_errors():
    img = torch.from_numpy(_rand((2, 32, 32, 3), 7))
    assert torch.equal(resize_with_pad(img, 32), img.permute(0, 3, 1, 2))
    with pytest.raises(ValueError, match="mode must be one of"):
        resize_with_pad(img, 32, "nearest")
    with pytest.raises(ValueError, match="uint8"):
        resize_with_pad(img.float(), 32)
