"""Adapter contracts against the real simulators: no hangs, every `vectorization` honoured or refused, the goal
observable, Gymnasium's autoreset contract for plain users, long LIBERO episodes, and clear refusals."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv
from gymnasium.wrappers.vector import RecordEpisodeStatistics

from phyai_gym.make import make_env
from wrappers.bounded_async import WorkerTimeoutError

ROOT = Path(__file__).resolve().parents[3]
HAVE_MUJOCO = importlib.util.find_spec("mujoco") is not None
HAVE_MANISKILL = importlib.util.find_spec("mani_skill") is not None
HAVE_LIBERO = importlib.util.find_spec("libero") is not None
needs_mujoco = pytest.mark.skipif(not HAVE_MUJOCO, reason="MuJoCo is not installed (pip install 'phyai-gym[sim]')")
needs_maniskill = pytest.mark.skipif(not HAVE_MANISKILL, reason="ManiSkill3 is not installed (.ci/install_sims.sh)")
needs_libero = pytest.mark.skipif(not HAVE_LIBERO, reason="LIBERO is not installed (.ci/install_sims.sh)")


def _row(obs, i):
    return {"state": obs["state"][i], **{k: v[i] for k, v in obs["images"].items()}}


def _assert_rows_equal(a, b):
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


# ---------------------------------------------------------------------------------------------------------
# defect 1: async MuJoCo after the parent holds an EGL context


@needs_mujoco
@pytest.mark.slow
def test_async_mujoco_starts_after_the_parent_rendered():
    from wrappers.adapters.mujoco import make_mujoco_env

    sync = make_mujoco_env(num_envs=1, image_size=32)
    expected, _ = sync.reset(seed=4)  # renders: this process now holds an EGL context
    venv = make_mujoco_env(num_envs=2, image_size=32, vectorization="async", timeout=240)
    try:
        assert isinstance(venv, AsyncVectorEnv)
        obs, _ = venv.reset(seed=4)
        _assert_rows_equal(_row(obs, 0), _row(expected, 0))
    finally:
        venv.close(), sync.close()


@needs_mujoco
@pytest.mark.slow
def test_a_worker_that_cannot_start_raises_within_the_timeout():
    from wrappers.adapters.mujoco import make_mujoco_env

    sync = make_mujoco_env(num_envs=1, image_size=32)
    sync.reset(seed=0)
    try:
        with pytest.raises(WorkerTimeoutError, match=r"did not answer reset\(\) within timeout=20 s.*forkserver"):
            venv = make_mujoco_env(num_envs=1, image_size=32, vectorization="async", context="fork", timeout=20)
            venv.reset(seed=0)
    finally:
        sync.close()


# ---------------------------------------------------------------------------------------------------------
# defect 2: every vectorization honoured or refused


@pytest.mark.parametrize("name", ["scripted", "target"])
def test_test_envs_honour_or_refuse_vectorization(name):
    for value, kind in (("sync", SyncVectorEnv), ("async", AsyncVectorEnv)):
        venv = make_env(name, 2, vectorization=value)
        assert isinstance(venv, kind), (value, type(venv))
        venv.close()
    with pytest.raises(ValueError, match="vectorization must be 'sync' or 'async', got 'threads'"):
        make_env(name, 2, vectorization="threads")


@needs_maniskill
@pytest.mark.slow
def test_maniskill_async_is_async_and_matches_sync():
    sync = make_env("PickCube-v1", 1, image_size=32, vectorization="sync")
    venv = make_env("PickCube-v1", 1, image_size=32, vectorization="async")
    try:
        assert isinstance(sync, SyncVectorEnv) and isinstance(venv, AsyncVectorEnv)
        assert venv.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
        expected, _ = sync.reset(seed=2)
        obs, _ = venv.reset(seed=2)
        _assert_rows_equal(_row(obs, 0), _row(expected, 0))
        action = np.zeros((1, 7), np.float32)
        _assert_rows_equal(_row(venv.step(action)[0], 0), _row(sync.step(action)[0], 0))
    finally:
        venv.close(), sync.close()
    with pytest.raises(ValueError, match="vectorization must be 'auto', 'maniskill', 'sync' or 'async'"):
        make_env("PickCube-v1", 1, vectorization="threads")


# ---------------------------------------------------------------------------------------------------------
# defect 3: what the task needs is in the observation


def _goal_cases() -> list:
    from_wheel = [
        "PickCube-v1", "PushCube-v1", "PullCube-v1", "StackCube-v1", "PegInsertionSide-v1", "PlugCharger-v1",
        "LiftPegUpright-v1", "PokeCube-v1", "PlaceSphere-v1", "RollBall-v1", "PushT-v1",
    ]  # fmt: skip
    downloads = pytest.mark.skip(reason="needs the YCB assets (python -m mani_skill.utils.download_asset ycb)")
    return [*from_wheel, pytest.param("PickSingleYCB-v1", marks=downloads)]


def test_every_instructed_task_declares_where_its_goal_is_seen():
    from wrappers.adapters.maniskill import GOAL_OBSERVATION, MANISKILL_INSTRUCTIONS

    assert set(GOAL_OBSERVATION) == set(MANISKILL_INSTRUCTIONS)
    assert {where for where, _ in GOAL_OBSERVATION.values()} == {"state", "image"}
    assert {c if isinstance(c, str) else c.values[0] for c in _goal_cases()} == set(MANISKILL_INSTRUCTIONS)


@needs_maniskill
@pytest.mark.slow
@pytest.mark.parametrize("task", _goal_cases())
def test_the_goal_is_in_the_state_or_visible_in_the_image(task):
    """Segmentation of the very camera the adapter uses (at its default 224x224) tells which actors the policy
    can see, for several scene seeds."""
    from wrappers.adapters.maniskill import GOAL_OBSERVATION, make_maniskill_env

    where, attribute = GOAL_OBSERVATION[task]
    venv = make_maniskill_env(task, num_envs=1, sim_backend="cpu", vectorization="sync",
                              obs_mode="rgb+segmentation")  # fmt: skip
    try:
        pixels = []
        for seed in range(4):
            obs, _ = venv.reset(seed=seed)
            base = venv.envs[0].unwrapped
            goal = getattr(base, attribute)
            ids = np.asarray(goal.per_scene_id.cpu()).reshape(-1)
            raw = base.get_obs()
            seen = np.isin(raw["sensor_data"]["base_camera"]["segmentation"].cpu().numpy(), ids).sum()
            pixels.append(int(seen))
            if where == "image":
                assert seen >= 10, f"{task} seed {seed}: {attribute} covers {seen} pixels of base_camera"
            else:  # hidden from (or out of view of) the cameras on some seed, so the state carries it
                goal_pos = goal.pose.p[0].cpu().numpy()
                np.testing.assert_allclose(obs["state"][0][-3:], goal_pos, atol=1e-6)
        if where == "state":
            assert min(pixels) == 0, pixels  # the image alone would not show the goal on some seed
    finally:
        venv.close()


# ---------------------------------------------------------------------------------------------------------
# defect 4: a vector env from make_env keeps the autoreset contract it declares


def _plain_env(name: str, mode: AutoresetMode):
    if name == "Pusher-v5":
        return make_env(name, 2, image_size=32, max_episode_steps=3, autoreset_mode=mode)
    if name == "PushCube-v1":
        return make_env(name, 2, image_size=32, max_episode_steps=3, vectorization="sync", autoreset_mode=mode)
    return make_env(name, 2, image_size=32, max_episode_steps=3, task_ids=[0], autoreset_mode=mode)


_SIMS = [
    pytest.param("Pusher-v5", marks=needs_mujoco),
    pytest.param("PushCube-v1", marks=needs_maniskill),
    pytest.param("libero_spatial", marks=needs_libero),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.name)
@pytest.mark.parametrize("name", _SIMS)
def test_plain_vector_env_autoresets_as_declared(name, mode):
    """A hand-written Gymnasium loop: episodes of 3 steps keep coming, and a seeded reset is a fresh one."""
    venv = _plain_env(name, mode)
    try:
        assert venv.metadata["autoreset_mode"] == mode
        first, _ = venv.reset(seed=7)
        actions = np.zeros((2, *venv.single_action_space.shape), np.float32)
        if name == "libero_spatial":
            actions[:, -1] = -1.0
        ends = []
        for t in range(8):
            obs, reward, terminated, truncated, info = venv.step(actions)
            done = terminated | truncated
            if done.any():
                ends.append(t)
                if mode == AutoresetMode.SAME_STEP:  # the reset observation, the terminal one in final_obs
                    assert info["_final_obs"].all()
                    assert not np.array_equal(info["final_obs"][0]["state"], obs["state"][0])
            if mode == AutoresetMode.NEXT_STEP and ends and t == ends[-1] + 1:
                assert (reward == 0).all() and not done.any()  # the autoreset step
        expected = [2, 6] if mode == AutoresetMode.NEXT_STEP else [2, 5]
        assert ends == expected, ends  # a frozen sub-env would end once and never again
        again, _ = venv.reset(seed=7)
        _assert_rows_equal(_row(again, 1), _row(first, 1))
    finally:
        venv.close()


@needs_mujoco
@pytest.mark.slow
def test_record_episode_statistics_and_check_env_on_a_plain_env():
    from gymnasium.utils.env_checker import check_env

    from wrappers.freeze import FreezeOnDone

    venv = RecordEpisodeStatistics(make_env("Pusher-v5", 2, image_size=32, max_episode_steps=3))
    venv.reset(seed=0)
    for _ in range(12):
        venv.step(np.zeros((2, 7), np.float32))
    assert list(venv.length_queue) == [3] * 8  # SAME_STEP: an episode every 3 steps in each sub-env
    sub_env = venv.env.envs[0]
    assert isinstance(sub_env, FreezeOnDone) and isinstance(sub_env, gym.utils.RecordConstructorArgs)
    check_env(sub_env, skip_render_check=True)  # includes re-creating the env from its spec
    venv.close()


@needs_mujoco
@pytest.mark.slow
def test_policy_vector_env_still_freezes_the_plain_env():
    from policies.baseline import GaussianPolicy
    from wrappers import PolicyVectorEnv

    inner = make_env("Pusher-v5", 2, image_size=32, max_episode_steps=3)
    env = PolicyVectorEnv(inner, GaussianPolicy(7, action_horizon=4), action_chunk=4)
    try:
        assert all(inner.get_attr("freezing"))
        env.reset(seed=0)
        _, _, _, truncated, info = env.step()
        assert truncated.all() and info["substep_mask"].sum(1).tolist() == [3, 3]
    finally:
        env.close()


# ---------------------------------------------------------------------------------------------------------
# defect 5: LIBERO episodes longer than robosuite's default horizon


@needs_libero
@pytest.mark.slow
def test_libero_episode_longer_than_robosuite_horizon():
    from wrappers.adapters.libero import LiberoEnv, libero_tasks

    env = LiberoEnv(libero_tasks("libero_spatial")[0], max_episode_steps=1005, image_size=16)
    try:
        env.reset(seed=0)
        noop = np.array([0, 0, 0, 0, 0, 0, -1], np.float32)
        for step in range(1, 1006):
            _, _, terminated, truncated, info = env.step(noop)
            assert not terminated and truncated == (step == 1005), step
        assert info["elapsed_steps"] == 1005
    finally:
        env.close()


# ---------------------------------------------------------------------------------------------------------
# issue 21 items 5 and 10: refusals with the fix


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_simulator_without_cuda_is_refused_with_the_fix():
    from wrappers.adapters.maniskill import make_maniskill_env

    with pytest.raises(ValueError, match=r"sim_backend='gpu' .* no CUDA device.* Fix: pass sim_backend='cpu'"):
        make_maniskill_env("PickCube-v1", num_envs=4, sim_backend="gpu")


@needs_maniskill
@pytest.mark.slow
def test_missing_vulkan_driver_points_at_the_installer(tmp_path):
    icd = tmp_path / "broken_icd.json"
    icd.write_text('{"file_format_version": "1.0.0", "ICD": {"library_path": "/nonexistent/libvk.so", '
                   '"api_version": "1.3.0"}}')  # fmt: skip
    script = textwrap.dedent(
        """
        from wrappers.adapters.maniskill import make_maniskill_env
        try:
            make_maniskill_env("PushCube-v1", sim_backend="cpu", image_size=32)
        except RuntimeError as error:
            print("REFUSED:", error)
        """
    )
    env = {**os.environ, "VK_ICD_FILENAMES": str(icd), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "REFUSED: make_maniskill_env: SAPIEN found no working Vulkan driver" in out.stdout, out.stderr[-2000:]
    assert "ErrorIncompatibleDriver" in out.stdout and "bash .ci/install_sims.sh maniskill" in out.stdout


# ---------------------------------------------------------------------------------------------------------
# issue 23 item 7: RLinf's ManiSkill conventions, on a task that ships with the wheel


@needs_maniskill
@pytest.mark.slow
def test_rlinf_maniskill_protocol_conventions():
    """RLinf's own tasks (PutOnPlateInScene*, 3rd_view_camera) need asset downloads; PickCube ships with the wheel."""
    from phyai_gym.protocols import get_protocol

    kwargs = dict(get_protocol("rlinf_maniskill", "maniskill").env_kwargs)
    rlinf = make_env("PickCube-v1", 1, image_size=64, vectorization="sync", **kwargs)
    plain = make_env("PickCube-v1", 1, image_size=64, vectorization="sync")
    try:
        assert rlinf.envs[0].get_wrapper_attr("ignore_terminations")
        a, _ = rlinf.reset(seed=0)
        b, _ = plain.reset(seed=0)
        _assert_rows_equal(_row(a, 0), _row(b, 0))  # no 3rd_view_camera in PickCube: base_camera is the image
        for command, sent in ((0.7, 1.0), (0.3, -1.0), (0.5, -1.0)):
            action, expected = np.zeros((1, 7), np.float32), np.zeros((1, 7), np.float32)
            action[0, 2], expected[0, 2] = 0.5, 0.5
            action[0, -1], expected[0, -1] = command, sent
            a = rlinf.step(action)[0]
            b = plain.step(expected)[0]
            _assert_rows_equal(_row(a, 0), _row(b, 0))  # the simulator got 2 * [g > 0.5] - 1
    finally:
        rlinf.close(), plain.close()
    with pytest.raises(ValueError, match=r"camera must name a sensor of the task, expected one of \['3rd_view"):
        make_env("PickCube-v1", 1, image_size=32, vectorization="sync", camera="3rd_view_camera")
