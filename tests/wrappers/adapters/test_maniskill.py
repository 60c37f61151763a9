"""make_maniskill_env against the real ManiSkill3 simulator (CPU PhysX, SAPIEN on Mesa lavapipe).

Installed by `.ci/install_sims.sh` (which also unpacks the Mesa >= 24.3 Vulkan driver SAPIEN needs without a
GPU); the simulator tests skip only when `mani_skill` is absent.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch
from scene_orientation import assert_maniskill_upright

from wrappers.adapters.maniskill import (
    ManiSkillFreezeWrapper,
    make_maniskill_env,
    maniskill_instruction,
)
from wrappers.freeze import FREEZABLE_KEY, THAW_OPTION, start_freezing

HAVE_MANISKILL = importlib.util.find_spec("mani_skill") is not None
WHY = 'ManiSkill3 is not installed (pip install "phyai-gym[maniskill]" or bash .ci/install_sims.sh maniskill)'
if not HAVE_MANISKILL:
    print(f"test_maniskill_adapter: simulator tests skipped: {WHY}", file=sys.stderr)
needs_maniskill = pytest.mark.skipif(not HAVE_MANISKILL, reason=WHY)
PICK = "pick up the red cube and move it to the goal position"


@pytest.fixture(scope="module")
def venv():
    env = make_maniskill_env("PickCube-v1", num_envs=2, sim_backend="cpu", vectorization="sync")
    yield env
    env.close()


def _base(venv, i):
    return venv.envs[i].unwrapped


def test_instructions():
    assert maniskill_instruction("PickCube-v1") == PICK
    assert maniskill_instruction("PickCube-v1", "grab it") == "grab it"
    assert maniskill_instruction("OpenCabinetDrawer-v1") == "open cabinet drawer"


def test_missing_package_names_the_extra(monkeypatch):
    for name in ("mani_skill", "mani_skill.envs", "sapien"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"phyai-gym\[maniskill\]"):
        make_maniskill_env("PickCube-v1", sim_backend="cpu")


@needs_maniskill
@pytest.mark.slow
def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown ManiSkill task 'NoSuchTask-v9'"):
        make_maniskill_env("NoSuchTask-v9", sim_backend="cpu")
    with pytest.raises(ValueError, match="one env per process"):
        make_maniskill_env("PickCube-v1", num_envs=2, sim_backend="cpu", vectorization="maniskill")
    with pytest.raises(ValueError, match="sim_backend"):
        make_maniskill_env("PickCube-v1", sim_backend="tpu")


@needs_maniskill
@pytest.mark.slow
def test_observation_contract(venv):
    obs, info = venv.reset(seed=0, options={THAW_OPTION: True})
    assert venv.metadata[FREEZABLE_KEY]
    assert set(obs) == {"images", "state", "task"} and set(obs["images"]) == {"image"}
    image = obs["images"]["image"]
    assert image.shape == (2, 224, 224, 3) and image.dtype == np.uint8
    assert 20 < image.mean() < 235 and image.std() > 10
    assert obs["state"].shape == (2, 19) and obs["state"].dtype == np.float32  # qpos 9, tcp pose 7, goal 3
    assert list(obs["task"]) == [PICK, PICK]
    assert venv.single_action_space.shape == (7,)
    assert "success" in info or "elapsed_steps" in info


@needs_maniskill
@pytest.mark.slow
def test_image_is_upright(venv):
    """Property of the scene: the camera looks down at the (warm, wooden) table with the grey floor and
    sky beyond it, so upright the table fills the bottom of the image and grey the top."""
    obs, _ = venv.reset(seed=0, options={THAW_OPTION: True})
    assert_maniskill_upright(obs["images"]["image"][0])


@needs_maniskill
@pytest.mark.slow
def test_state_is_qpos_tcp_pose_and_hidden_goal(venv):
    obs, _ = venv.reset(seed=0, options={THAW_OPTION: True})
    for i in range(2):
        base = _base(venv, i)
        qpos = base.agent.robot.get_qpos()[0].cpu().numpy()
        tcp = base.agent.tcp.pose.raw_pose[0].cpu().numpy()
        goal = base.goal_site.pose.p[0].cpu().numpy()
        assert np.allclose(obs["state"][i], np.concatenate([qpos, tcp, goal]), atol=1e-6)


@needs_maniskill
@pytest.mark.slow
def test_actions_move_the_tcp(venv):
    obs, _ = venv.reset(seed=0, options={THAW_OPTION: True})
    start = obs["state"][:, 9:12].copy()
    actions = np.zeros((2, 7), np.float32)
    actions[0, 0], actions[1, 0] = 1.0, -1.0
    actions[:, 6] = 1.0  # gripper open
    for _ in range(5):
        obs, reward, terminated, truncated, info = venv.step(actions)
    moved = obs["state"][:, 9:12] - start
    assert moved[0, 0] > 0.02 and moved[1, 0] < -0.02, moved
    assert np.abs(moved[:, 1:]).max() < 0.02, moved


@needs_maniskill
@pytest.mark.slow
def test_seeded_reset_reproduces(venv):
    a, _ = venv.reset(seed=3, options={THAW_OPTION: True})
    venv.step(np.ones((2, 7), np.float32))
    b, _ = venv.reset(seed=3, options={THAW_OPTION: True})
    c, _ = venv.reset(seed=4, options={THAW_OPTION: True})
    assert np.array_equal(a["state"], b["state"]) and np.array_equal(a["images"]["image"], b["images"]["image"])
    assert not np.array_equal(a["images"]["image"][0], c["images"]["image"][0])  # the cube moved


@needs_maniskill
@pytest.mark.slow
def test_success_on_a_scripted_pick():
    """A scripted grasp through the adapter's 7-dim pd_ee_delta_pose actions (targets read from the simulator)
    must end in ManiSkill's own success, terminate, and then freeze. (ManiSkill's motion-planning solution
    solvePickCube needs mplib 0.1.1, which segfaults in Planner() here, so the test scripts the pick.)"""
    env = make_maniskill_env("PickCube-v1", sim_backend="cpu", image_size=64, max_episode_steps=200)
    start_freezing(env)  # as PolicyVectorEnv does; a plain env would autoreset instead
    try:
        env.reset(seed=11)
        base = env.envs[0].unwrapped

        def move(target, grip):
            tcp = base.agent.tcp.pose.p[0].cpu().numpy()
            action = np.zeros(7, np.float32)
            action[:3] = np.clip((target - tcp) / 0.1, -1, 1)  # +-1 = +-10 cm per step
            action[6] = grip  # 1 open, -1 close
            return action, np.linalg.norm(target - tcp)

        phase, hold, done_at = 0, 0, None
        for k in range(150):
            cube, goal = base.cube.pose.p[0].cpu().numpy(), base.goal_site.pose.p[0].cpu().numpy()
            if phase == 0:  # above the cube
                action, dist = move(cube + np.array([0, 0, 0.05]), 1)
                phase += dist < 0.01
            elif phase == 1:  # down to it
                action, dist = move(cube, 1)
                phase += dist < 0.005
            elif phase == 2:  # close the gripper
                action, _ = move(cube, -1)
                hold += 1
                phase += hold > 6
            else:  # carry it to the goal and hold still
                action, _ = move(goal, -1)
            obs, reward, terminated, truncated, info = env.step(action[None])
            assert not truncated[0]
            if terminated[0]:
                done_at = k
                break
        assert done_at is not None and phase == 3, f"no success (phase {phase})"
        assert info["success"][0] and info["is_success"][0]
        terminal = obs["state"].copy()
        obs, reward, terminated, truncated, info = env.step(action[None])
        assert np.array_equal(obs["state"], terminal) and reward[0] == 0 and not terminated[0]
    finally:
        env.close()


@needs_maniskill
@pytest.mark.slow
def test_batched_maniskill_vector_env_freezes_and_partially_resets():
    """The GPU-path wrapper (ManiSkillVectorEnv + ManiSkillFreezeWrapper), run on the CPU simulator (1 env)."""
    env = make_maniskill_env("PushCube-v1", sim_backend="cpu", vectorization="maniskill", max_episode_steps=2)
    try:
        assert isinstance(env, ManiSkillFreezeWrapper) and env.metadata[FREEZABLE_KEY]
        start_freezing(env)
        obs, _ = env.reset(seed=1)
        assert isinstance(obs["images"]["image"], torch.Tensor) and obs["images"]["image"].dtype == torch.uint8
        assert obs["state"].shape == (1, 16) and obs["task"] == ("push the cube to the red and white target",)
        action = torch.zeros(1, 7)
        action[0, 2] = 1.0
        _, _, terminated, truncated, _ = env.step(action)
        assert not truncated[0]
        obs, _, terminated, truncated, _ = env.step(action)
        assert truncated[0] and env.frozen[0]
        terminal = obs["state"].clone()
        obs, reward, terminated, truncated, _ = env.step(action)  # frozen: terminal transition replayed
        assert torch.equal(obs["state"], terminal) and reward[0] == 0 and not truncated[0]
        obs, _ = env.reset(options={"reset_mask": np.array([True])})  # no thaw: ignored
        assert torch.equal(obs["state"], terminal) and env.frozen[0]
        obs, info = env.reset(options={"reset_mask": np.array([True]), THAW_OPTION: True})
        assert not env.frozen[0] and not torch.equal(obs["state"], terminal)
        assert int(info["elapsed_steps"][0]) == 0
    finally:
        env.close()
