"""Demonstrations in ManiSkill's trajectory layout: recorded by a scripted expert, written, read back unchanged."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from phyai_gym.make import make_env
from phyai_gym.train.demos import ChunkSampler, read_demos, record_demos, target_expert, write_demos


def test_recorded_demos_round_trip_in_the_maniskill_layout(tmp_path):
    envs = make_env("target", 3, episode_length=2, num_targets=3)
    episodes = record_demos(envs, target_expert, 5, seed=7)
    envs.close()
    assert len(episodes) == 5 and all(e.success for e in episodes)  # the expert always reaches the target
    for e in episodes:
        assert e.state.shape[0] == e.length + 1 and e.images["image"].shape[0] == e.length + 1
        np.testing.assert_array_equal(e.actions[:, 0], e.state[:-1, 0])  # it moved to the target it was shown
    path = write_demos(tmp_path / "trajectory.h5", episodes, {"env_id": "target"})
    with h5py.File(path) as f:
        assert sorted(f["traj_0"]) == ["actions", "obs", "rewards", "success", "terminated", "truncated"]
        assert f["traj_0/obs/sensor_data/image/rgb"].dtype == np.uint8
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["env_info"] == {"env_id": "target"} and meta["episodes"][0]["task"] == "move to the target"
    back = read_demos(path)
    for a, b in zip(episodes, back):
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_array_equal(a.images["image"], b.images["image"])
        assert (a.task, a.success, a.seed) == (b.task, b.success, b.seed)


def test_chunks_are_padded_and_masked_past_the_episode_end(tmp_path):
    envs = make_env("target", 2, episode_length=3, num_targets=2)
    episodes = record_demos(envs, lambda obs: -target_expert(obs), 2, seed=0)  # the other target: never succeeds
    envs.close()
    assert [e.length for e in episodes] == [3, 3] and not any(e.success for e in episodes)
    batch = ChunkSampler(episodes, horizon=4).batch(np.array([2]))  # episode 0, frame 2: one real step
    assert batch.mask.tolist() == [[True, False, False, False]]
    assert batch.actions.shape == (1, 4, 1) and batch.obs["task"] == ["move to the target"]
    with pytest.raises(FileNotFoundError, match="record them first"):
        read_demos(tmp_path / "missing.h5")


def test_warp_push_cube_demos_record_and_read_back(tmp_path):
    """MuJoCo Warp (torch observations, NEXT_STEP autoreset) on the CPU: the scripted expert's episodes round-trip."""
    pytest.importorskip("mujoco_warp")
    from phyai_gym.train.demos import EXPERTS

    envs = make_env("mjwarp_push_cube", 2, image_size=16, cameras=("image",), device="cpu")
    episodes = record_demos(envs, EXPERTS["mjwarp_push_cube"](envs), 3, seed=100)
    envs.close()
    assert len(episodes) == 3 and any(e.success for e in episodes)  # the expert succeeds in ~90 % of episodes
    for e in episodes:
        assert e.actions.shape == (e.length, 7) and 1 <= e.length <= 50
        assert e.images["image"].shape == (e.length + 1, 16, 16, 3) and e.images["image"].dtype == np.uint8
        assert e.state.shape == (e.length + 1, 16) and np.abs(e.actions).max() <= 1.0
    assert {e.seed for e in episodes} <= {100, 101, None} and episodes[2].seed is None  # a second episode: no seed
    back = read_demos(write_demos(tmp_path / "push.h5", episodes, {"env_id": "mjwarp_push_cube"}))
    for a, b in zip(episodes, back):
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_array_equal(a.images["image"], b.images["image"])
        np.testing.assert_array_equal(a.state, b.state)
        assert (a.task, a.success, a.length) == (b.task, b.success, b.length) == (b.task, b.success, len(b.actions))
    assert back[0].task == "push the cube to the red target"


def test_dart_noise_perturbs_the_executed_actions_and_records_the_experts():
    def record(**kwargs):
        envs = make_env("target", 3, episode_length=2, num_targets=3)
        try:
            return record_demos(envs, target_expert, 6, seed=7, **kwargs)
        finally:
            envs.close()

    clean, noisy = record(), record(noise=0.5)
    for e in noisy:  # the labels are the expert's actions for the states the noisy run reached
        np.testing.assert_array_equal(e.actions[:, 0], e.state[:-1, 0])
    assert sum(e.rewards.sum() for e in noisy) < sum(e.rewards.sum() for e in clean)  # what ran was perturbed
    envs = make_env("target", 1)
    with pytest.raises(ValueError, match="noise must be a finite std"):
        record_demos(envs, target_expert, 1, noise=-0.1)
    envs.close()


@pytest.mark.parametrize("name", ["PickCube-v1", "PushCube-v1"])
def test_maniskill_cpu_demos_of_the_scripted_expert_succeed_and_read_back(tmp_path, name):
    """ManiSkill3 on its CPU simulator: the expert reads each sub-env's privileged state and finishes every episode."""
    pytest.importorskip("mani_skill", reason='ManiSkill3 is not installed (pip install "phyai-gym[maniskill]")')
    from phyai_gym.train.demos import EXPERTS

    envs = make_env(name, 2, image_size=32)
    episodes = record_demos(envs, EXPERTS[name](envs), 4, seed=3)
    envs.close()
    assert [e.success for e in episodes] == [True] * 4  # 50 of 50 seeds of each task succeed (docs/rl.md)
    for e in episodes:
        assert e.actions.shape == (e.length, 7) and e.length < 50 and np.abs(e.actions).max() <= 1.0
        assert e.images["image"].shape == (e.length + 1, 32, 32, 3)
    back = read_demos(write_demos(tmp_path / "demos.h5", episodes, {"env_id": name}))
    for a, b in zip(episodes, back, strict=True):
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_array_equal(a.state, b.state)
