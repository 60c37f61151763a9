"""A tiny non-rendering env with scripted episode lengths and synthetic images, for semantics tests.

It yields the canonical observation of one env (DESIGN C1) and is cheap enough to run thousands of steps
per second, so the chunk/autoreset tests of `PolicyVectorEnv` run on it rather than on a simulator.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from typing import Any, Literal

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

from wrappers.freeze import make_freezable_vector_env

TEXT_CHARSET = string.ascii_letters + string.digits + string.punctuation + " "
"""Characters a task instruction may use in the canonical observation space."""


def canonical_observation_space(
    image_shapes: dict[str, tuple[int, int]], state_dim: int, max_task_length: int = 512
) -> spaces.Dict:
    """The single-env canonical observation space (DESIGN C1).

    Args:
        image_shapes: camera name -> (H, W).
        state_dim: S, the length of the state vector.
        max_task_length: longest instruction the Text space admits.

    Returns:
        ``Dict(images=Dict(cam=Box(0, 255, (H, W, 3), uint8)), state=Box((S,), float32), task=Text)``.
    """
    images = spaces.Dict({name: spaces.Box(0, 255, (h, w, 3), np.uint8) for name, (h, w) in image_shapes.items()})
    state = spaces.Box(-np.inf, np.inf, (state_dim,), np.float32)
    task = spaces.Text(max_length=max_task_length, min_length=0, charset=TEXT_CHARSET)
    return spaces.Dict({"images": images, "state": state, "task": task})


class ScriptedEnv(gym.Env):
    """A deterministic env whose episodes last a scripted number of steps.

    State (4,): [step in episode, episode index, reset noise drawn from `np_random`, running action sum].
    The reset noise makes a second (unwanted) reset visible in the observations. The image is a function of
    the state. Reward per step: ``1 + 0.1 * sum(action)``. ``info["is_success"]`` is True at the steps
    listed in `success_steps` (1-based within the episode; -1 = the last step).

    Args:
        episode_lengths: lengths of consecutive episodes, cycled.
        end_with: "terminated", "truncated", or "both" (alternating by episode, starting with terminated).
        action_dim: A.
        image_size: side of the square synthetic image.
        success_steps: steps at which ``info["is_success"]`` is True.
        task: the instruction.

    Example:
        >>> env = ScriptedEnv(episode_lengths=(2,))
        >>> obs, _ = env.reset(seed=0)
        >>> obs["state"][:2].tolist(), obs["images"]["image"].shape
        ([0.0, 0.0], (8, 8, 3))
        >>> env.step(np.zeros(3, np.float32))[2:4]
        (False, False)
        >>> env.step(np.zeros(3, np.float32))[2:4]
        (True, False)
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        episode_lengths: Sequence[int] = (5,),
        end_with: Literal["terminated", "truncated", "both"] = "terminated",
        action_dim: int = 3,
        image_size: int = 8,
        success_steps: Sequence[int] = (-1,),
        task: str = "reach the target",
    ) -> None:
        self.episode_lengths = tuple(int(n) for n in episode_lengths)
        self.end_with = end_with
        self.success_steps = tuple(success_steps)
        self.task = task
        self.observation_space = canonical_observation_space({"image": (image_size, image_size)}, 4)
        self.action_space = spaces.Box(-1.0, 1.0, (action_dim,), np.float32)
        self._state = np.zeros(4, np.float32)
        self._episode = -1

    def _obs(self) -> dict[str, Any]:
        t, ep, noise, acc = (float(v) for v in self._state)
        size = self.observation_space["images"]["image"].shape[0]
        ramp = np.arange(size * size * 3, dtype=np.int64).reshape(size, size, 3)
        base = int(t * 7 + ep * 13 + noise + round(acc * 10)) % 256
        image = ((ramp + base) % 256).astype(np.uint8)
        return {"images": {"image": image}, "state": self._state.copy(), "task": self.task}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Starts the next scripted episode."""
        super().reset(seed=seed)
        self._episode += 1
        noise = float(self.np_random.integers(0, 1000))
        self._state = np.array([0.0, self._episode, noise, 0.0], np.float32)
        return self._obs(), {"episode_index": self._episode}

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Advances one step; ends the episode after its scripted length."""
        length = self.episode_lengths[self._episode % len(self.episode_lengths)]
        action_sum = float(np.sum(action))
        self._state[0] += 1.0
        self._state[3] += action_sum
        t = int(self._state[0])
        ended = t >= length
        if self.end_with == "both":
            as_term = self._episode % 2 == 0
        else:
            as_term = self.end_with == "terminated"
        success = t in self.success_steps or (ended and -1 in self.success_steps)
        info = {"is_success": bool(success), "episode_index": self._episode}
        return self._obs(), 1.0 + 0.1 * action_sum, ended and as_term, ended and not as_term, info


def make_scripted_env(
    num_envs: int = 2,
    episode_lengths: Sequence[Sequence[int]] | Sequence[int] = (5,),
    vectorization: Literal["sync", "async"] = "sync",
    autoreset_mode: AutoresetMode | str = AutoresetMode.SAME_STEP,
    **env_kwargs: Any,
) -> VectorEnv:
    """A freezable vector env of `ScriptedEnv`s.

    Args:
        num_envs: N.
        episode_lengths: one cycle of lengths for all envs, or one cycle per env.
        vectorization: "sync" or "async".
        autoreset_mode: the inner autoreset mode.
        **env_kwargs: passed to every `ScriptedEnv`.

    Example:
        >>> venv = make_scripted_env(2, episode_lengths=[(1,), (2,)])
        >>> venv.num_envs
        2
        >>> venv.close()
    """
    per_env = list(episode_lengths)
    if not per_env or not isinstance(per_env[0], Sequence):
        per_env = [tuple(episode_lengths)] * num_envs  # type: ignore[arg-type]
    if len(per_env) != num_envs:
        raise ValueError(
            f"make_scripted_env: episode_lengths has {len(per_env)} per-env cycles, expected num_envs={num_envs}."
        )

    def factory(lengths: Sequence[int]) -> Callable[[], gym.Env]:
        return lambda: ScriptedEnv(episode_lengths=lengths, **env_kwargs)

    fns = [factory(lengths) for lengths in per_env]
    return make_freezable_vector_env(fns, vectorization=vectorization, autoreset_mode=autoreset_mode)
