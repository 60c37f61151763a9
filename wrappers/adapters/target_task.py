"""A small image + state reaching task whose target changes every episode, for PPO tests and examples.

Each episode draws one of `num_targets` target positions in [-1, 1]. The target is visible twice: as the first state
entry (so a ``"state"`` prompt carries it as discretised bins) and as the colour of the image (`TARGET_COLOURS`; a
whole-image cue, because a randomly initialised model reads a small image detail too weakly to learn from it in a
few minutes). The action is one number, a position; the episode succeeds when the target is the position's nearest
target. An episode terminates on success or after `episode_length` steps: the elapsed fraction is in the state, so
the limit is part of the task and a failure there has no future to bootstrap (as a truncation, PPO would add the
critic's value of the end state to a failed return, worth almost a success once the critic has learned, and the
signal would shrink to the shaping term). A policy that ignores the observation succeeds about ``1 / num_targets``
of the time; one that reads it can always succeed, so the task shows quickly whether RL uses the observation.
"""

from __future__ import annotations

from typing import Any, Literal

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

from wrappers.adapters.scripted import canonical_observation_space
from wrappers.freeze import make_freezable_vector_env

TARGET_TASK = "move to the target"
"""The instruction every `TargetEnv` carries."""
TARGET_COLOURS: tuple[tuple[int, int, int], ...] = ((0, 0, 0), (255, 255, 255), (255, 0, 0), (0, 0, 255), (0, 255, 0))
"""Image colour of target index i (cycled): the image shows which target is active."""


def target_positions(num_targets: int) -> np.ndarray:
    """(k,) float32 target positions, evenly spaced and centred in [-1, 1] (k=2: -0.5 and 0.5)."""
    if num_targets < 2:
        raise ValueError(f"target_positions: num_targets must be >= 2, got {num_targets}.")
    return ((np.arange(num_targets) + 0.5) / num_targets * 2.0 - 1.0).astype(np.float32)


class TargetEnv(gym.Env):
    """Reach the target shown in the state and the image; the target is redrawn every episode.

    Observation (canonical, DESIGN C1): ``images["image"]`` (S, S, 3) uint8 in the target's colour,
    ``state`` (2,) = [target position, fraction of the episode elapsed], ``task`` = `TARGET_TASK`.
    Action: (1,) float32 in [-1, 1]. Reward: 1 on success, else ``-0.1 * |action - target|`` (a small
    shaping term). ``info["is_success"]`` marks success.

    Args:
        num_targets: k, the number of possible targets (the best constant action succeeds about 1/k of the time).
        episode_length: steps before the episode terminates without success (1 = a contextual bandit).
        image_size: S.

    Example:
        >>> env = TargetEnv(num_targets=2)
        >>> obs, _ = env.reset(seed=0)
        >>> target = float(obs["state"][0])
        >>> _, reward, terminated, truncated, info = env.step(np.array([target], np.float32))
        >>> reward, terminated, info["is_success"]
        (1.0, True, True)
    """

    metadata = {"render_modes": []}

    def __init__(self, num_targets: int = 2, episode_length: int = 1, image_size: int = 32) -> None:
        if episode_length < 1:
            raise ValueError(f"TargetEnv: episode_length must be >= 1, got {episode_length}.")
        self.positions = target_positions(num_targets)
        self.episode_length = int(episode_length)
        self.image_size = int(image_size)
        self.observation_space = canonical_observation_space({"image": (image_size, image_size)}, 2)
        self.action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
        self._target = 0
        self._t = 0

    def _obs(self) -> dict[str, Any]:
        colour = TARGET_COLOURS[self._target % len(TARGET_COLOURS)]
        image = np.broadcast_to(np.array(colour, np.uint8), (self.image_size, self.image_size, 3)).copy()
        state = np.array([self.positions[self._target], self._t / self.episode_length], np.float32)
        return {"images": {"image": image}, "state": state, "task": TARGET_TASK}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Draws a new target from `np_random`."""
        super().reset(seed=seed)
        self._target = int(self.np_random.integers(len(self.positions)))
        self._t = 0
        return self._obs(), {}

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Scores the position `action[0]` against the target."""
        position = float(np.clip(np.asarray(action, np.float32).reshape(-1)[0], -1.0, 1.0))
        target = float(self.positions[self._target])
        success = int(np.argmin(np.abs(self.positions - position))) == self._target
        self._t += 1
        reward = 1.0 if success else -0.1 * abs(position - target)
        terminated = success or self._t >= self.episode_length
        return self._obs(), reward, terminated, False, {"is_success": success}


def make_target_env(
    num_envs: int = 8,
    num_targets: int = 2,
    episode_length: int = 1,
    image_size: int = 32,
    vectorization: Literal["sync", "async"] = "sync",
    autoreset_mode: AutoresetMode | str = AutoresetMode.SAME_STEP,
) -> VectorEnv:
    """A freezable vector env of `TargetEnv`s (canonical observations, one action dim).

    Example:
        >>> venv = make_target_env(num_envs=2)
        >>> obs, _ = venv.reset(seed=0)
        >>> obs["state"].shape, obs["images"]["image"].shape
        ((2, 2), (2, 32, 32, 3))
        >>> venv.close()
    """
    fns = [lambda: TargetEnv(num_targets, episode_length, image_size) for _ in range(num_envs)]
    return make_freezable_vector_env(fns, vectorization=vectorization, autoreset_mode=autoreset_mode)
