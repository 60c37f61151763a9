"""openpi's LIBERO evaluation procedure reproduced by the adapter (render 256, resize-with-pad 224, seed once).

The reference is a raw-LIBERO script written from the procedure of openpi's ``examples/libero/main.py``:
``np.random.seed(7)``; per task an ``OffScreenRenderEnv`` at 256x256 and ``env.seed(7)``; episode k runs
``env.reset()``, ``set_init_state(initial_states[k])``, 10 no-op steps ``[0]*6 + [-1]``; images rotated by 180
degrees and resized with padding to 224 (PIL bilinear); state = eef pos + axis-angle + gripper qpos.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

HAVE_LIBERO = importlib.util.find_spec("libero") is not None
pytestmark = [
    pytest.mark.skipif(not HAVE_LIBERO, reason="LIBERO is not installed (bash .ci/install_sims.sh libero)"),
    pytest.mark.slow,
]
SUITE, TASK, SEED, STEPS_WAIT, RENDER, RESIZE = "libero_spatial", 0, 7, 10, 256, 224


def _axis_angle(quat: np.ndarray) -> np.ndarray:
    quat = quat.copy()
    quat[3] = min(1.0, max(-1.0, quat[3]))
    den = math.sqrt(1.0 - quat[3] * quat[3])
    return np.zeros(3) if math.isclose(den, 0.0) else quat[:3] * 2.0 * math.acos(quat[3]) / den


def _resize(image: np.ndarray) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(image).resize((RESIZE, RESIZE), resample=Image.BILINEAR))  # 256 -> 224: no pad


def _raw_openpi_episodes(num_episodes: int, policy_steps: int) -> list[dict[str, np.ndarray]]:
    """openpi's steps on the raw simulator; a few policy steps per episode, as a real evaluation would take."""
    from libero.libero import benchmark, get_libero_path
    from libero.libero.envs import OffScreenRenderEnv

    saved = np.random.get_state()
    np.random.seed(SEED)
    suite = benchmark.get_benchmark_dict()[SUITE]()
    task = suite.get_task(TASK)
    initial_states = suite.get_task_init_states(TASK)
    bddl = Path(get_libero_path("bddl_files")) / task.problem_folder / task.bddl_file
    env = OffScreenRenderEnv(bddl_file_name=str(bddl), camera_heights=RENDER, camera_widths=RENDER)
    env.seed(SEED)
    out = []
    try:
        for k in range(num_episodes):
            env.reset()
            obs = env.set_init_state(initial_states[k])
            for _ in range(STEPS_WAIT):
                obs, _, _, _ = env.step([0.0] * 6 + [-1.0])
            out.append(
                {
                    "image": _resize(np.ascontiguousarray(obs["agentview_image"][::-1, ::-1])),
                    "wrist_image": _resize(np.ascontiguousarray(obs["robot0_eye_in_hand_image"][::-1, ::-1])),
                    "state": np.concatenate(
                        [obs["robot0_eef_pos"], _axis_angle(obs["robot0_eef_quat"]), obs["robot0_gripper_qpos"]]
                    ),
                    "body_pos": env.env.sim.model.body_pos.copy(),
                }
            )
            for _ in range(policy_steps):
                env.step([0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    finally:
        env.close()
        np.random.set_state(saved)
    return out


def test_adapter_reproduces_openpi_scenes_and_images_in_any_order():
    from wrappers.adapters.libero import make_libero_env

    reference = _raw_openpi_episodes(num_episodes=3, policy_steps=3)
    venv = make_libero_env(SUITE, task_ids=[TASK], num_envs=1, preset="openpi", render_size=RENDER,
                           image_size=RESIZE, seed=SEED, seed_mode="once")  # fmt: skip
    try:
        assert venv.metadata["phyai_gym.libero"]["settle_steps"] == STEPS_WAIT
        assert venv.metadata["phyai_gym.libero"]["max_episode_steps"] == 220
        for k in (2, 0, 1):  # openpi plays them in order; the adapter gets the same scene in any order
            obs, info = venv.reset(seed=100 + k, options={"init_state_id": k})  # reset seeds do not move the RNG
            sim = venv.envs[0].env.sim_env.env.sim
            np.testing.assert_array_equal(sim.model.body_pos, reference[k]["body_pos"])  # same fixture placement
            np.testing.assert_array_equal(obs["state"][0], reference[k]["state"].astype(np.float32))
            for camera in ("image", "wrist_image"):
                diff = np.abs(obs["images"][camera][0].astype(int) - reference[k][camera].astype(int))
                assert diff.max() == 0, (k, camera, diff.max(), diff.mean())
            venv.step(np.array([[0.1, 0, 0, 0, 0, 0, 1.0]], np.float32))
    finally:
        venv.close()
