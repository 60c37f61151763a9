"""Gymnasium MuJoCo envs (e.g. Pusher-v5) as canonical, freezable vector envs (DESIGN C1, C2).

Each sub-env renders an RGB image (``render_mode="rgb_array"``) next to its state vector and carries a fixed
instruction. Rendering is on demand: after ``set_read_every(C)`` (which `PolicyVectorEnv` calls with its action
chunk) a sub-env renders only at resets, episode ends and every C-th step since its reset, the steps whose
observation is read (`wrappers.read_schedule`); until then it renders every step.

Rendering uses ``MUJOCO_GL=egl`` unless the variable is already set; on machines without EGL set
``MUJOCO_GL=osmesa`` (software rendering, needs libOSMesa) before the first import of mujoco. Software rendering
spends most of a frame on the shadow map (``model.vis.quality.shadowsize``, 4096 x 4096 in Pusher-v5):
``shadow_size=1024`` renders a 224 x 224 Pusher frame about 5x faster on llvmpipe and changes well under 0.1 % of its
pixels; the default keeps the model's value.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Literal

import gymnasium as gym
import numpy as np
from gymnasium.utils import RecordConstructorArgs
from gymnasium.vector import AutoresetMode, VectorEnv

from wrappers.adapters.scripted import canonical_observation_space
from wrappers.bounded_async import DEFAULT_TIMEOUT_S
from wrappers.freeze import READ_EVERY_KEY, make_freezable_vector_env
from wrappers.read_schedule import ReadSchedule


class MujocoCanonicalObservation(gym.ObservationWrapper, RecordConstructorArgs):
    """Maps a MuJoCo env's state vector to ``{"images": {camera: render()}, "state", "task"}``.

    Renders on demand once ``set_read_every(C)`` was called: steps that nobody reads (neither the end of an
    episode nor a C-th step since the reset) return the last rendered image again. Wrap it outside
    ``TimeLimit`` (as ``gym.make`` builds it) so that truncations count as episode ends.

    Args:
        env: a single env created with ``render_mode="rgb_array"``.
        task: the instruction.
        camera: the camera name in ``images``.

    Example:
        >>> env = MujocoCanonicalObservation(  # doctest: +SKIP
        ...     gym.make("Pusher-v5", render_mode="rgb_array", width=64, height=64), task="push")
        >>> env.reset(seed=0)[0]["images"]["image"].shape  # doctest: +SKIP
        (64, 64, 3)
    """

    def __init__(self, env: gym.Env, task: str, camera: str = "image") -> None:
        RecordConstructorArgs.__init__(self, task=task, camera=camera)
        gym.ObservationWrapper.__init__(self, env)
        if env.render_mode != "rgb_array":
            raise ValueError(
                f"MujocoCanonicalObservation: the env must render with render_mode='rgb_array', got "
                f"{env.render_mode!r}. Fix: gym.make(name, render_mode='rgb_array', width=..., height=...)."
            )
        frame = self._frame_shape(env)
        state_dim = int(np.prod(env.observation_space.shape))
        self.observation_space = canonical_observation_space({camera: frame}, state_dim)
        self.task = task
        self.camera = camera
        self.metadata = {**env.metadata, READ_EVERY_KEY: True}
        self._schedule = ReadSchedule()
        self._image: np.ndarray | None = None  # the last rendered frame (returned again on unread steps)
        self._render_thread: int | None = None  # the thread whose OpenGL context renders this env

    def set_read_every(self, chunk: int) -> None:
        """Renders only at resets, episode ends and every `chunk`-th step since a reset (`wrappers.freeze`)."""
        self._schedule.set_every(chunk)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Resets the env and renders its first frame."""
        obs, info = self.env.reset(seed=seed, options=options)
        self._schedule.reset()
        return self.observation(obs), info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        """Steps the env; renders only when the step is read (always before `set_read_every`)."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self._schedule.count_step(terminated or truncated):
            return self.observation(obs), reward, terminated, truncated, info
        return self._canonical(obs, self._image), reward, terminated, truncated, info

    @staticmethod
    def _frame_shape(env: gym.Env) -> tuple[int, int]:
        base = env.unwrapped
        return int(getattr(base, "height", 480)), int(getattr(base, "width", 480))

    def observation(self, observation: np.ndarray) -> dict[str, Any]:
        """The canonical observation of the current state (rendered now).

        Raises:
            RuntimeError: rendering from another thread than the first render's. MuJoCo's OpenGL context is current
                only in the thread that made it; elsewhere the frame would be stale or blank without any error.
        """
        thread = threading.get_ident()
        if self._render_thread is None:
            self._render_thread = thread
        elif thread != self._render_thread:
            raise RuntimeError(
                "MujocoCanonicalObservation: rendered from another thread than the one whose OpenGL context renders "
                "this env, which would return a stale or blank frame. Fix: step in-process MuJoCo envs from one "
                "thread, or use vectorization='async' (each sub-env renders in its own process), e.g. for "
                "PolicyVectorEnv groups."
            )
        self._image = np.ascontiguousarray(self.env.render(), dtype=np.uint8)
        return self._canonical(observation, self._image)

    def _canonical(self, observation: np.ndarray, image: np.ndarray | None) -> dict[str, Any]:
        state = np.asarray(observation, dtype=np.float32).reshape(-1)
        return {"images": {self.camera: image}, "state": state, "task": self.task}


def _make_single(
    name: str, image_size: int, task: str, shadow_size: int | None, env_kwargs: dict[str, Any]
) -> gym.Env:
    os.environ.setdefault("MUJOCO_GL", "egl")
    env = gym.make(name, render_mode="rgb_array", width=image_size, height=image_size, **env_kwargs)
    if shadow_size is not None:  # read when the first render makes the OpenGL context
        env.unwrapped.model.vis.quality.shadowsize = shadow_size
    return MujocoCanonicalObservation(env, task)


def _check_args(name: str, num_envs: int, image_size: int, shadow_size: int | None) -> None:
    """Validates `make_mujoco_env` arguments before any env is built (errors name argument, expected, received)."""
    if not isinstance(num_envs, int | np.integer) or num_envs < 1:
        raise ValueError(f"make_mujoco_env: num_envs must be an int >= 1, got {num_envs!r}.")
    if not isinstance(image_size, int | np.integer) or image_size < 1:
        raise ValueError(f"make_mujoco_env: image_size must be an int >= 1 (rendered image side), got {image_size!r}.")
    if shadow_size is not None and (not isinstance(shadow_size, int | np.integer) or shadow_size < 0):
        raise ValueError(
            f"make_mujoco_env: shadow_size must be None (the model's shadow map) or an int >= 0 (the shadow map's "
            f"side in pixels, 0 turns shadows off), got {shadow_size!r}. Fix: e.g. shadow_size=1024."
        )
    if not isinstance(name, str) or name not in gym.registry:
        known = sorted(k for k, s in gym.registry.items() if "mujoco" in str(s.entry_point) and k.endswith("-v5"))
        raise ValueError(
            f"make_mujoco_env: name must be a registered Gymnasium env id (a MuJoCo task, e.g. one of {known}), "
            f"got {name!r}."
        )


def make_mujoco_env(
    name: str = "Pusher-v5",
    num_envs: int = 4,
    vectorization: Literal["sync", "async"] = "sync",
    image_size: int = 224,
    task: str = "push the puck to the goal",
    seed: int | None = None,
    autoreset_mode: AutoresetMode | str = AutoresetMode.SAME_STEP,
    context: str = "forkserver",
    timeout: float | None = DEFAULT_TIMEOUT_S,
    shadow_size: int | None = None,
    **env_kwargs: Any,
) -> VectorEnv:
    """A freezable vector env of a Gymnasium MuJoCo task yielding the canonical observation.

    Observations: ``{"images": {"image": (N, S, S, 3) uint8}, "state": (N, D) float32, "task": N str}``.

    Args:
        name: a Gymnasium MuJoCo env id (``Pusher-v5`` has a 7-dim action and a 23-dim state).
        num_envs: N.
        vectorization: "sync" (in-process) or "async" (one process per env).
        image_size: S, the rendered image side.
        task: the instruction given to every env.
        seed: when given, the env is reset once with ``seed`` (env i gets seed + i).
        autoreset_mode: the inner autoreset mode (PolicyVectorEnv handles all three).
        context: multiprocessing start method for "async". "forkserver" (default) or "spawn": a worker forked
            from a process that already rendered (holds an EGL context) would wait forever in its first render.
        timeout: seconds an "async" worker may take to answer (start, reset, step) before a `WorkerTimeoutError`
            (None: wait forever).
        shadow_size: the shadow map's side in pixels (MuJoCo's ``vis.quality.shadowsize``; 0: no shadows); None
            keeps the model's. The cost of a software-rendered frame (``MUJOCO_GL=osmesa``) is mostly this map.
        **env_kwargs: passed to ``gym.make`` (e.g. ``max_episode_steps``).

    Example:
        >>> env = make_mujoco_env(num_envs=2, image_size=64)  # doctest: +SKIP
        >>> obs, _ = env.reset(seed=0)  # doctest: +SKIP
        >>> obs["images"]["image"].shape, obs["state"].shape, obs["task"]  # doctest: +SKIP
        ((2, 64, 64, 3), (2, 23), ('push the puck to the goal', 'push the puck to the goal'))
    """
    _check_args(name, num_envs, image_size, shadow_size)
    os.environ.setdefault("MUJOCO_GL", "egl")
    fns = [lambda: _make_single(name, image_size, task, shadow_size, env_kwargs) for _ in range(num_envs)]
    vector_kwargs: dict[str, Any] = {"context": context, "timeout": timeout} if vectorization == "async" else {}
    venv = make_freezable_vector_env(fns, vectorization=vectorization, autoreset_mode=autoreset_mode, **vector_kwargs)
    if seed is not None:
        venv.reset(seed=seed)
    return venv
