"""ManiSkill3's GPU simulator (PhysX on CUDA, SAPIEN rendering on the GPU) under the freeze rules of DESIGN C2.

Run on a CUDA machine with mani_skill + sapien installed (`pip install "phyai-gym[maniskill]"`). Skipped without
CUDA or without ManiSkill. Observations returned by the GPU renderer may be views of SAPIEN's render buffer,
which the next render overwrites, so the tests clone what they compare across steps.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from policies.baseline import ConstantPolicy
from wrappers import PolicyVectorEnv
from wrappers.freeze import THAW_OPTION

HAVE_MANISKILL = importlib.util.find_spec("mani_skill") is not None


def _physx_gpu_library() -> Path | None:
    """SAPIEN's PhysX GPU library, which ``sapien.physx.enable_gpu()`` would download (None: not there)."""
    if not HAVE_MANISKILL:
        return None
    import sapien.physx

    path = Path.home() / ".sapien" / "physx" / sapien.physx.version() / "libPhysXGpu_64.so"
    return path if path.is_file() else None


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ManiSkill's GPU simulator)"),
    pytest.mark.skipif(not HAVE_MANISKILL, reason="ManiSkill3 is not installed (pip install \"phyai-gym[maniskill]\")"),
    pytest.mark.skipif(
        torch.cuda.is_available() and _physx_gpu_library() is None,
        reason="SAPIEN's PhysX GPU library is missing (~/.sapien/physx/<version>/libPhysXGpu_64.so; SAPIEN downloads "
        "it from GitHub on first use: run `python -c 'import sapien.physx as p; p.enable_gpu()'` once online)",
    ),
]
SIZE = 64


def _make(num_envs: int, max_episode_steps: int, task: str = "PushCube-v1"):
    from wrappers.adapters.maniskill import ManiSkillFreezeWrapper, make_maniskill_env

    env = make_maniskill_env(
        task, num_envs=num_envs, sim_backend="gpu", image_size=SIZE, max_episode_steps=max_episode_steps
    )
    assert isinstance(env, ManiSkillFreezeWrapper)
    return env


def _snapshot(obs) -> dict[str, torch.Tensor]:
    return {"image": obs["images"]["image"].clone(), "state": obs["state"].clone()}


def test_observations_are_cuda_tensors_end_to_end():
    env = _make(4, 50, task="PickCube-v1")
    venv = PolicyVectorEnv(env, ConstantPolicy([0.0] * 7, action_horizon=5, device="cuda"), action_chunk=5)
    try:
        obs, _ = venv.reset(seed=0)
        for _ in range(2):
            obs, reward, terminated, truncated, info = venv.step()
        image, state = obs["images"]["image"], obs["state"]
        assert image.is_cuda and image.dtype == torch.uint8 and tuple(image.shape) == (4, SIZE, SIZE, 3)
        assert state.is_cuda and state.dtype == torch.float32 and tuple(state.shape) == (4, 16)
        assert 20 < float(image.float().mean()) < 235 and float(image.float().std()) > 10  # a rendered scene
        assert reward.is_cuda and terminated.is_cuda and truncated.is_cuda
        assert info["final_obs"]["images"]["image"].is_cuda and info["substep_mask"].is_cuda
        assert info["policy"]["actions"].is_cuda
    finally:
        venv.close()


def test_frozen_env_replays_its_terminal_transition_and_partial_reset_uses_env_idx():
    """Freeze wrapper alone: envs 1..3 truncate two steps before env 0 (made younger by a partial reset)."""
    env = _make(4, 4)
    try:
        env.reset(seed=0)
        action = torch.zeros(4, 7, device="cuda")
        action[:, 2] = 0.5  # the TCP rises, away from the cube: no success can end an episode early
        for _ in range(2):
            env.step(action)
        base = env.unwrapped
        obs, _ = env.reset(options={"reset_mask": np.array([True, False, False, False]), THAW_OPTION: True})
        assert base.elapsed_steps.tolist() == [0, 2, 2, 2]  # ManiSkill's own partial reset (env_idx)
        env.step(action)
        obs, reward, terminated, truncated, _ = env.step(action)
        assert truncated.tolist() == [False, True, True, True] and env.frozen.tolist() == [False, True, True, True]
        terminal = _snapshot(obs)
        obs, reward, terminated, truncated, _ = env.step(action)  # envs 1..3 frozen: terminal rows replayed
        assert torch.equal(obs["state"][1:], terminal["state"][1:])
        assert torch.equal(obs["images"]["image"][1:], terminal["image"][1:])
        assert not torch.equal(obs["state"][0], terminal["state"][0])  # env 0 still moves
        assert reward[1:].abs().sum() == 0 and not truncated[1:].any()
        live0 = obs["state"][0].clone()
        obs, _ = env.reset(options={"reset_mask": np.array([False, True, True, True])})  # no thaw: ignored
        assert torch.equal(obs["state"][1:], terminal["state"][1:]) and env.frozen[1:].all()
        obs, _ = env.reset(options={"reset_mask": np.array([False, True, True, True]), THAW_OPTION: True})
        assert env.frozen.tolist() == [False] * 4
        assert base.elapsed_steps[1:].tolist() == [0, 0, 0]
        assert torch.equal(obs["state"][0], live0)  # the live env is untouched by the others' reset
    finally:
        env.close()


def test_policy_vector_env_freezes_mid_chunk_and_resets_at_the_chunk_boundary():
    """C2 on the GPU simulator: env 1 ends at sub-step 2 of a 4-step chunk, stays frozen for sub-steps 3-4,
    and is reset (through ManiSkill's env_idx) only after the chunk; env 0 runs the whole chunk."""
    env = _make(2, 6)
    recorded: list[dict[str, torch.Tensor]] = []
    step = env.step

    def recording_step(actions):
        out = step(actions)
        recorded.append(_snapshot(out[0]))
        return out

    env.step = recording_step
    action = [0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 1.0]  # the TCP rises: the episodes end by truncation only
    venv = PolicyVectorEnv(env, ConstantPolicy(action, action_horizon=4, device="cuda"), action_chunk=4)
    try:
        venv.reset(seed=0)
        venv.step()  # 4 sub-steps: both envs at elapsed 4
        venv.reset(options={"reset_mask": np.array([True, False])})  # env 0 back to 0
        recorded.clear()
        obs, reward, terminated, truncated, info = venv.step()
        assert truncated.tolist() == [False, True] and not terminated.any()
        assert info["substep_mask"].tolist() == [[True] * 4, [True, True, False, False]]
        assert info["substep_rewards"][1, 2:].abs().sum() == 0
        # frozen after sub-step 2: sub-steps 3 and 4 replay env 1's terminal observation
        assert torch.equal(recorded[2]["state"][1], recorded[1]["state"][1])
        assert torch.equal(recorded[3]["image"][1], recorded[1]["image"][1])
        assert torch.equal(info["final_obs"]["state"][1], recorded[1]["state"][1])
        # reset at the chunk boundary: env 1 starts a new episode, env 0 keeps its state from sub-step 4
        assert env.unwrapped.elapsed_steps.tolist() == [4, 0]
        assert not torch.equal(obs["state"][1], recorded[1]["state"][1])
        assert torch.equal(obs["state"][0], recorded[3]["state"][0])
        assert obs["state"].is_cuda and info["final_obs"]["state"].is_cuda
    finally:
        venv.close()
