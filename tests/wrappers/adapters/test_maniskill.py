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

from policies.baseline import GaussianPolicy
from wrappers.adapters.maniskill import (
    ManiSkillFreezeWrapper,
    make_maniskill_env,
    maniskill_instruction,
)
from wrappers.freeze import FREEZABLE_KEY, READ_EVERY_KEY, THAW_OPTION, set_read_every, start_freezing
from wrappers.policy_vector_env import PolicyVectorEnv

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


# ---------------------------------------------------------------------------------------------------------
# render on demand (the CPU path captures its cameras itself; wrappers.freeze "Reading schedule")


@needs_maniskill
@pytest.mark.slow
def test_cpu_images_and_state_equal_obs_mode_rgb():
    """The sub-envs run in obs_mode="state_dict" and capture their cameras after the step: same pixels as "rgb"."""
    import gymnasium as gym

    from wrappers.adapters.maniskill import _import_maniskill

    _import_maniskill()
    ours = make_maniskill_env("PickCube-v1", sim_backend="cpu", vectorization="sync", image_size=64)
    kwargs = {"obs_mode": "rgb", "control_mode": "pd_ee_delta_pose", "sensor_configs": {"width": 64, "height": 64}}
    if not torch.cuda.is_available():
        kwargs["render_backend"] = "cpu"
    raw_env = gym.make("PickCube-v1", num_envs=1, sim_backend="physx_cpu", **kwargs)
    try:
        obs, _ = ours.reset(seed=5)
        raw, _ = raw_env.reset(seed=5)
        rng = np.random.default_rng(0)
        for _ in range(4):
            rgb = raw["sensor_data"]["base_camera"]["rgb"][0].numpy()
            np.testing.assert_array_equal(obs["images"]["image"][0], rgb)
            np.testing.assert_array_equal(obs["state"][0, :9], raw["agent"]["qpos"][0].numpy())
            action = rng.uniform(-1, 1, (1, 7)).astype(np.float32)
            obs = ours.step(action)[0]
            raw = raw_env.step(torch.as_tensor(action))[0]
    finally:
        ours.close()
        raw_env.close()


@needs_maniskill
@pytest.mark.slow
def test_on_demand_leaves_unread_images_stale(venv):
    assert venv.metadata[READ_EVERY_KEY] and set_read_every(venv, 2)
    try:
        obs, _ = venv.reset(seed=0)
        move = np.tile(np.array([1.0, 1.0, 1.0, 0, 0, 0, 1], np.float32), (2, 1))
        after_one = venv.step(move)[0]
        assert not np.array_equal(after_one["state"], obs["state"])
        np.testing.assert_array_equal(after_one["images"]["image"], obs["images"]["image"])  # not captured
        after_two = venv.step(move)[0]
        assert (after_two["images"]["image"] != obs["images"]["image"]).any(axis=(1, 2, 3)).all()
    finally:
        set_read_every(venv, 1)
        venv.reset(seed=0)


def _maniskill_reads(every_step: bool, chunk: int = 3, steps: int = 3) -> list:
    """Reset obs, then per PolicyVectorEnv step the obs, final_obs and done mask (episodes end mid-chunk)."""
    torch.manual_seed(0)  # ManiSkill's unseeded (chunk-boundary) resets place the goal with torch's global RNG
    env = make_maniskill_env(
        "PickCube-v1", num_envs=2, sim_backend="cpu", vectorization="sync", image_size=64, max_episode_steps=5
    )
    wrapper = PolicyVectorEnv(env, GaussianPolicy(7, action_horizon=chunk, std=0.5), action_chunk=chunk)
    if every_step:
        assert set_read_every(env, 1)
    try:
        obs, _ = wrapper.reset(seed=0)
        read = [obs]
        for _ in range(steps):
            obs, _, terms, truncs, info = wrapper.step()
            read += [obs, info["final_obs"], terms | truncs]
        return read
    finally:
        wrapper.close()


@needs_maniskill
@pytest.mark.slow
def test_on_demand_rendering_reads_what_rendering_every_step_reads():
    reference, on_demand = _maniskill_reads(every_step=True), _maniskill_reads(every_step=False)
    assert np.stack(reference[3::3]).any(0).all()  # every sub-env ended (at step 5, mid-chunk)
    for expected, got in zip(reference, on_demand):
        if isinstance(expected, dict):
            np.testing.assert_array_equal(expected["images"]["image"], got["images"]["image"])
            np.testing.assert_array_equal(expected["state"], got["state"])
        else:
            np.testing.assert_array_equal(expected, got)
