"""examples/sft_pi05.py: PI0.5's flow-matching loss falls on scripted target-task demos (tiny config, CPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

from phyai_gym.make import make_policy
from phyai_gym.train.demos import read_demos
from policies.pi05.normalize import NormStats

ROOT = Path(__file__).resolve().parents[2]


def _sft_module():
    spec = importlib.util.spec_from_file_location("sft_pi05", ROOT / "examples" / "sft_pi05.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sft_pi05"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_sft_loss_falls_on_scripted_demos_and_the_checkpoint_loads(tmp_path):
    sft = _sft_module()
    args = sft.Args(record_episodes=16, record_envs=8, demos=str(tmp_path / "demos.h5"), steps=60, batch_size=16,
                    log_every=20, csv=str(tmp_path / "sft.csv"), out=str(tmp_path / "out"), eval_episodes=0,
                    quiet=True)  # fmt: skip
    result = sft.train(args)
    curve = result["curve"]
    assert [row["step"] for row in curve] == [20, 40, 60]
    # the same batch, noise and times before and after 60 steps: the loss has fallen by more than 30 %
    assert curve[-1]["fixed_batch_loss"] < 0.7 * result["fixed_loss_start"], (result["fixed_loss_start"], curve)
    assert curve[-1]["loss"] < curve[0]["loss"]
    assert (tmp_path / "demos.h5").is_file() and (tmp_path / "demos.json").is_file()
    loaded = make_policy(tmp_path / "out")
    assert loaded.action_dim == 1
    demos = read_demos(tmp_path / "demos.h5")  # the checkpoint normalises with the demos' statistics (openpi's rule)
    assert loaded.processor.config.state_stats == NormStats.of(np.concatenate([e.state for e in demos]))
    assert loaded.processor.config.action_stats == NormStats.of(np.concatenate([e.actions for e in demos]))
    assert loaded.processor.config.norm_mode == "quantile" and loaded.processor.action_normalizer.width == 1


def test_sft_on_warp_push_cube_saves_a_checkpoint_that_reads_both_cameras_and_acts_in_chunks(tmp_path):
    """MuJoCo Warp on the CPU: expert demos recorded, the rendered cameras fill the model's slots, C and K saved."""
    import pytest

    pytest.importorskip("mujoco_warp")
    sft = _sft_module()
    args = sft.Args(env="mjwarp_push_cube", image_size=16, cameras="image,wrist_image", record_episodes=2,
                    record_envs=2, demos=str(tmp_path / "push.h5"), steps=2, batch_size=4, log_every=1,
                    action_chunk=5, denoise_steps=3, csv=None, out=str(tmp_path / "out"), eval_episodes=2,
                    quiet=True)  # fmt: skip
    result = sft.train(args)
    assert 0.0 <= result["success_rate"] <= 1.0
    loaded = make_policy(tmp_path / "out")
    assert loaded.action_dim == 7
    assert loaded.processor.config.camera_map == {"image": "base_0_rgb", "wrist_image": "left_wrist_0_rgb"}
    assert (loaded.rollout.action_chunk, loaded.rollout.num_steps) == (5, 3)


def test_sft_refuses_an_unknown_lr_schedule():
    import pytest

    sft = _sft_module()
    with pytest.raises(ValueError, match="--lr-schedule: expected 'cosine' or 'constant', got 'linear'"):
        sft.Args(lr_schedule="linear")


def test_sft_with_one_seed_writes_the_same_checkpoint_twice(tmp_path):
    sft = _sft_module()
    files = []
    for run in ("a", "b"):
        sft.train(sft.Args(record_episodes=8, record_envs=8, demos=str(tmp_path / f"{run}.h5"), steps=10,
                           batch_size=8, log_every=10, csv=None, out=str(tmp_path / run), eval_episodes=0,
                           quiet=True))  # fmt: skip
        files.append((tmp_path / run / "model.safetensors").read_bytes())
    assert files[0] == files[1]  # the weights, and the header too (so a checkpoint's hash identifies it)
