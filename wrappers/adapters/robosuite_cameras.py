"""`OnDemandCameras`: a robosuite env's cameras rendered only when their image is read, with the same pixels.

robosuite renders a camera inside its ``step()``, when the camera observable's sampling timer fires at one of
the control step's physics sub-steps (not necessarily the last one: after LIBERO's reset it is an earlier
one), so an image rendered after the step shows another state. To render on demand with unchanged images,
each camera's sensor is swapped, through robosuite's public ``modify_observable``, for one that

* while `render` is True, calls the real sensor (robosuite renders as before);
* while `render` is False, copies the MuJoCo data of that sub-step into a preallocated buffer (a memory copy,
  ~1000x cheaper than a software render) and returns the last image again;

and `render_missed()` renders the skipped images from that copy after the step, when the step turns out to be
read after all (an episode that ends with an unforeseen success). The sampling timers are untouched, so the
cameras sample at the same sub-steps whichever way they are rendered.

Example:
    >>> cameras = OnDemandCameras(["agentview_image"], image_shape=(224, 224, 3))  # doctest: +SKIP
    >>> cameras.install(robosuite_env)            # after every robosuite reset  # doctest: +SKIP
    >>> cameras.begin_step(render=False); raw = robosuite_env.step(action)[0]  # doctest: +SKIP
    >>> raw.update(cameras.render_missed())        # only if this step is read  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class OnDemandCameras:
    """Swaps a robosuite env's camera sensors for ones that render only while `render` is True.

    Args:
        names: the camera observables (robosuite's ``<camera>_image`` names).
        image_shape: (H, W, 3) of their images (returned before any image was rendered).
    """

    def __init__(self, names: Sequence[str], image_shape: tuple[int, int, int]) -> None:
        self.names = tuple(names)
        self.render = True
        self._blank = np.zeros(image_shape, np.uint8)
        self._real: dict[str, Callable[[dict[str, Any]], Any]] = {}
        self._lazy: dict[str, Callable[[dict[str, Any]], Any]] = {}
        self._last: dict[str, np.ndarray] = {}
        self._env: Any = None
        self._model: Any = None
        self._seen: Any = None  # MuJoCo data at the sub-step where the cameras sampled without rendering
        self._now: Any = None  # the current data while `render_missed` renders from `_seen`
        self._missed = False

    def install(self, env: Any) -> None:
        """Puts the lazy sensors in place; call after every reset of `env` (a hard reset rebuilds its sensors)."""
        import mujoco

        self._env = env
        model = env.sim.model._model  # robosuite's binding keeps the raw mujoco.MjModel/MjData here
        if model is not self._model:
            self._model, self._seen, self._now = model, mujoco.MjData(model), mujoco.MjData(model)
        render, self.render = self.render, False  # modify_observable calls the sensor once to check it
        try:
            for name in self.names:
                current = env._observables[name]._sensor
                if current is not self._lazy.get(name):  # a fresh robosuite sensor (first install or hard reset)
                    self._real[name] = current
                    self._lazy[name] = self._lazy_sensor(name, current)
                env.modify_observable(name, "sensor", self._lazy[name])
        finally:
            self.render = render

    def begin_step(self, render: bool) -> None:
        """Whether the cameras render during the coming robosuite step (or reset's observation update)."""
        self.render = bool(render)
        self._missed = False

    def render_missed(self) -> dict[str, np.ndarray]:
        """The images the cameras skipped since `begin_step`, rendered now from the data they would have seen.

        Returns {} when nothing was skipped. The env's MuJoCo data is restored afterwards.
        """
        if not self._missed:
            return {}
        import mujoco

        data = self._env.sim.data._data
        mujoco.mj_copyData(self._now, self._model, data)
        mujoco.mj_copyData(data, self._model, self._seen)
        try:
            images = {name: np.array(self._real[name]({})) for name in self.names}
        finally:
            mujoco.mj_copyData(data, self._model, self._now)
        self._last.update(images)
        self._missed = False
        return images

    def _lazy_sensor(self, name: str, real: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
        from robosuite.utils.observables import sensor

        @sensor(modality=real.__modality__)
        def camera(obs_cache: dict[str, Any]) -> np.ndarray:
            if self.render:
                self._last[name] = image = real(obs_cache)
                return image
            if not self._missed:  # every camera samples at the same sub-step: one copy serves all
                import mujoco

                mujoco.mj_copyData(self._seen, self._model, self._env.sim.data._data)
                self._missed = True
            return self._last.get(name, self._blank)

        return camera
