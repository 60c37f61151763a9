"""`FrameRecorder`: every env step of chosen sub-envs as video frames, below `PolicyVectorEnv`.

`PolicyVectorEnv` executes C env steps per policy call, so the observations it returns show one frame per
chunk. Wrapped *under* it, this recorder sees every sub-step of the inner vector env: a clip of sub-env i
starts at a real reset of i (one that carries `THAW_OPTION`, which every reset of `PolicyVectorEnv` and of
`phyai_gym.evaluation` does) after `arm` chose it, gets one frame per env step, and ends with the terminal
frame of the episode. Frames are the canonical camera images side by side (uint8, H x W*cams x 3).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np
from gymnasium.vector import VectorEnv, VectorWrapper

from wrappers.freeze import THAW_OPTION, set_read_every

FINAL_OBS_KEYS = ("final_obs", "final_observation")
"""SAME_STEP keys of terminal observations (gymnasium 1.x, and the 0.29 naming ManiSkill keeps)."""


def _numpy(x: Any) -> np.ndarray:
    return np.asarray(x.cpu() if hasattr(x, "cpu") else x)


def _row(obs: Mapping[str, Any], index: int) -> dict[str, Any]:
    """Camera name -> (H, W, 3) image of sub-env `index`."""
    return {name: image[index] for name, image in obs["images"].items()}


class FrameRecorder(VectorWrapper):
    """Records the camera images of armed sub-envs at every env step (for MP4s at the env's frame rate).

    Args:
        env: a vector env yielding canonical observations (``obs["images"]``: camera -> (N, H, W, 3) uint8).
        fps: frames per second of the clips (None: the env's ``metadata["render_fps"]``, else 20).

    Example:
        >>> from wrappers.adapters.target_task import make_target_env
        >>> recorder = FrameRecorder(make_target_env(2))
        >>> recorder.arm(0, "episode 0")
        >>> _ = recorder.reset(seed=0, options={THAW_OPTION: True})
        >>> _ = recorder.step(np.zeros((2, 1), np.float32))   # the target task ends after one step
        >>> len(recorder.take("episode 0"))                     # the reset frame and the terminal frame
        2
        >>> recorder.close()
    """

    def __init__(self, env: VectorEnv, fps: float | None = None) -> None:
        super().__init__(env)
        self.fps = float(fps or env.metadata.get("render_fps") or 20)
        self._armed: dict[int, Hashable] = {}
        self._clips: dict[Hashable, list[np.ndarray]] = {}

    def arm(self, index: int, key: Hashable) -> None:
        """Record sub-env `index` as clip `key` from its next real reset until its episode ends."""
        if not 0 <= index < self.num_envs:
            raise ValueError(f"FrameRecorder.arm: index must be in [0, {self.num_envs}), got {index}.")
        self._armed[index] = key

    def take(self, key: Hashable) -> list[np.ndarray]:
        """The frames of clip `key` (finished or not), removed from the recorder; [] when none were taken."""
        return self._clips.pop(key, [])

    @staticmethod
    def frame(images: Mapping[str, Any]) -> np.ndarray:
        """One sub-env's cameras (name -> (H, W, 3)) side by side; cameras of another height are left out."""
        rows = [_numpy(image).astype(np.uint8, copy=False) for image in images.values()]
        return np.concatenate([i for i in rows if i.shape[0] == rows[0].shape[0]], axis=1)

    def set_read_every(self, chunk: int) -> None:
        """Keeps the env rendering every step whatever chunk the driver reads (`wrappers.freeze.set_read_every`)."""
        set_read_every(self.env, 1)

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Resets the env; armed sub-envs that really reset start a new clip with their reset frame."""
        options = dict(options or {})
        obs, info = self.env.reset(seed=seed, options=dict(options))  # Sync/AsyncVectorEnv pop "reset_mask"
        if self._armed and options.get(THAW_OPTION):
            mask = options.get("reset_mask")
            reset = np.ones(self.num_envs, bool) if mask is None else _numpy(mask).astype(bool)
            for index, key in self._armed.items():
                if reset[index]:
                    self._clips[key] = [self.frame(_row(obs, index))]
        return obs, info

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Steps the env; recording sub-envs get a frame, and their clip ends with the terminal frame."""
        obs, rewards, terminated, truncated, info = self.env.step(actions)
        if self._armed:
            done = _numpy(terminated).astype(bool) | _numpy(truncated).astype(bool)
            for index, key in list(self._armed.items()):
                if key not in self._clips:
                    continue  # armed, not yet reset
                images = self._terminal(info, index) if done[index] else None
                self._clips[key].append(self.frame(images or _row(obs, index)))
                if done[index]:
                    del self._armed[index]
        return obs, rewards, terminated, truncated, info

    @staticmethod
    def _terminal(info: Mapping[str, Any], index: int) -> Mapping[str, Any] | None:
        """The terminal images of sub-env `index` where a SAME_STEP env put them in the info, else None."""
        key = next((k for k in FINAL_OBS_KEYS if k in info), None)
        if key is None:
            return None  # NEXT_STEP / DISABLED: the step's own observation is the terminal one
        final = info[key]
        if isinstance(final, np.ndarray) and final.dtype == object:  # per-env dicts (Sync/Async)
            return None if final[index] is None else final[index]["images"]
        return _row(final, index)  # batched (ManiSkill)
