"""ManiSkill3 adapter: freezable vector envs over ManiSkill tasks that yield the canonical observation (C1).

Two ways to vectorise, both freezable (DESIGN C2):

* ``vectorization="maniskill"`` (the default on the GPU simulator): one batched ManiSkill env inside
  ``ManiSkillVectorEnv(auto_reset=False)``, wrapped in `ManiSkillFreezeWrapper`, which keeps finished envs
  frozen (their terminal observation and info replayed, reward 0) and resets only the envs a
  ``reset_mask``/thaw reset names, through ManiSkill's partial reset ``reset(options={"env_idx": ...})``.
  Observations stay torch tensors on the simulation device.
* ``vectorization="sync" | "async"`` (the default on the CPU simulator, which refuses ``num_envs > 1``): one
  ``CPUGymWrapper`` env per sub-env inside `wrappers.freeze.make_freezable_vector_env`; numpy observations.
  Its cameras render on demand: ManiSkill captures every sensor inside ``step()`` in a visual obs_mode and offers
  no per-step switch, so each sub-env is built with ``obs_mode="state_dict"`` (no capture in ``step()``) and
  `ManiSkillObservation` captures the cameras itself (ManiSkill's ``get_sensor_images()``, the same pixels as
  ``obs_mode="rgb"``) after the steps whose observation is read: every step, or after ``set_read_every(C)``
  only resets, episode ends and every C-th step. The batched GPU env still captures every step.

Canonical observation: ``images["image"]`` = the task's ``base_camera`` RGB (``images["wrist_image"]`` =
``hand_camera`` with ``robot_uids="panda_wristcam"``), uint8 (N, S, S, 3), upright as ManiSkill renders it;
``state`` = ``agent/qpos`` (9 for Panda) + ``extra/tcp_pose`` (position 3 + quaternion wxyz 4), then the
goal position (3) for the tasks whose goal the cameras do not show: PickCube-v1 and PickSingleYCB-v1 hide
their goal marker from the sensors, and RollBall-v1's goal region is often outside ``base_camera``'s view;
float32. Every other task in `MANISKILL_INSTRUCTIONS` shows its goal in the image (`GOAL_OBSERVATION` says
which, per task). ``task`` = the instruction per env. Success comes from ``info["success"]`` (also reported as
``info["is_success"]``); an episode terminates on success and is truncated at the task's step limit.

Rendering without a GPU needs Vulkan: SAPIEN accepts Mesa >= 24.3 lavapipe. ``.ci/install_sims.sh``
unpacks one privately and writes ``~/.cache/phyai-gym/sim_env.json``; when ``VK_ICD_FILENAMES`` is unset and
no CUDA device is present, this module applies that file before SAPIEN is imported.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from gymnasium.utils import RecordConstructorArgs
from gymnasium.vector import AutoresetMode, VectorEnv, VectorWrapper

from wrappers.freeze import FREEZABLE_KEY, READ_EVERY_KEY, THAW_OPTION, make_freezable_vector_env
from wrappers.read_schedule import ReadSchedule

__all__ = [
    "MANISKILL_INSTALL_HINT",
    "GOAL_OBSERVATION",
    "MANISKILL_INSTRUCTIONS",
    "ManiSkillFreezeWrapper",
    "ManiSkillObservation",
    "apply_renderer_env",
    "binarize_gripper",
    "camera_map",
    "make_maniskill_env",
    "maniskill_instruction",
]

MANISKILL_INSTALL_HINT = (
    'pip install "phyai-gym[maniskill]" (mani_skill + sapien; without a GPU also a Mesa >= 24.3 Vulkan '
    "driver: run `bash .ci/install_sims.sh maniskill`)"
)
MANISKILL_INSTRUCTIONS: dict[str, str] = {
    "PickCube-v1": "pick up the red cube and move it to the goal position",
    "PushCube-v1": "push the cube to the red and white target",
    "PullCube-v1": "pull the cube to the red and white target",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "PegInsertionSide-v1": "insert the peg into the hole on the side of the box",
    "PlugCharger-v1": "plug the charger into the wall receptacle",
    "LiftPegUpright-v1": "lift the peg and stand it upright",
    "PokeCube-v1": "use the peg to push the cube to the goal",
    "PlaceSphere-v1": "place the sphere into the bin",
    "RollBall-v1": "roll the ball to the goal region",
    "PushT-v1": "push the T-shaped block onto the target pose",
    "PickSingleYCB-v1": "pick up the object and move it to the goal position",
}
"""Task id -> instruction. Other ids get one made from the id (see `maniskill_instruction`)."""
GOAL_OBSERVATION: dict[str, tuple[str, str]] = {
    "PickCube-v1": ("state", "goal_site"),
    "PushCube-v1": ("image", "goal_region"),
    "PullCube-v1": ("image", "goal_region"),
    "StackCube-v1": ("image", "cubeB"),
    "PegInsertionSide-v1": ("image", "box"),
    "PlugCharger-v1": ("image", "receptacle"),
    "LiftPegUpright-v1": ("image", "peg"),
    "PokeCube-v1": ("image", "goal_region"),
    "PlaceSphere-v1": ("image", "bin"),
    "RollBall-v1": ("state", "goal_region"),
    "PushT-v1": ("image", "goal_tee"),
    "PickSingleYCB-v1": ("state", "goal_site"),
}
"""Task id -> (where the policy sees the goal, the task's goal actor attribute). "state": the cameras do not
show the goal (a marker hidden from the sensors, or out of view), so the actor's position ends the state vector
(for PickCube it equals ``extra/goal_pos``); "image": the actor is in the camera images (LiftPegUpright's goal
is the peg's own orientation). Tasks not listed get qpos + tcp pose only."""
GOAL_STATE_DIM = 3
CAMERAS: dict[str, str] = {"base_camera": "image", "hand_camera": "wrist_image"}
"""ManiSkill sensor name -> canonical camera name (other sensors keep their own name)."""
TASK_CHARSET = frozenset(string.printable)
MAX_TASK_LENGTH = 512
SIM_ENV_FILE = Path(os.environ.get("PHYAI_GYM_CACHE", Path.home() / ".cache" / "phyai-gym")) / "sim_env.json"


def maniskill_instruction(task: str, instruction: str | None = None) -> str:
    """The instruction for a ManiSkill task id.

    Args:
        task: a ManiSkill env id, e.g. "PickCube-v1".
        instruction: returned as is when given.

    Returns:
        ``instruction``, else the entry of `MANISKILL_INSTRUCTIONS`, else words made from the id.

    Example:
        >>> maniskill_instruction("PushCube-v1")
        'push the cube to the red and white target'
        >>> maniskill_instruction("OpenCabinetDrawer-v1")
        'open cabinet drawer'
    """
    if instruction is not None:
        return instruction
    if task in MANISKILL_INSTRUCTIONS:
        return MANISKILL_INSTRUCTIONS[task]
    stem = re.sub(r"-v\d+$", "", task)
    return " ".join(w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", stem)) or task


def apply_renderer_env(path: str | os.PathLike[str] | None = None) -> bool:
    """Applies the CPU Vulkan renderer settings written by ``.ci/install_sims.sh``, if needed.

    Sets ``VK_ICD_FILENAMES`` and ``XDG_RUNTIME_DIR`` (only those not set already) from the env file, and only
    when no CUDA device is present (a GPU machine keeps its own Vulkan driver). Call it before SAPIEN is
    imported; `make_maniskill_env` does.

    Args:
        path: the JSON env file (default ``~/.cache/phyai-gym/sim_env.json``).

    Returns:
        True when the renderer settings are in effect (set here or before).

    Example:
        >>> apply_renderer_env("/nonexistent.json")
        False
    """
    if os.environ.get("VK_ICD_FILENAMES"):
        return True
    if torch.cuda.is_available():
        return False
    file = Path(path) if path is not None else SIM_ENV_FILE
    if not file.is_file():
        return False
    values = json.loads(file.read_text(encoding="utf-8"))
    icd = values.get("VK_ICD_FILENAMES")
    if not icd or not Path(icd).is_file():
        return False
    for key in ("VK_ICD_FILENAMES", "XDG_RUNTIME_DIR"):
        if values.get(key) and not os.environ.get(key):
            os.environ[key] = str(values[key])
    return True


def _import_maniskill() -> None:
    apply_renderer_env()
    try:
        importlib.import_module("sapien")
        importlib.import_module("mani_skill.envs")
    except ImportError as exc:
        raise ImportError(
            f"make_maniskill_env: ManiSkill3 is not installed ({exc}). Install it with {MANISKILL_INSTALL_HINT}."
        ) from exc


def _check_task(task: str) -> None:
    if task not in gym.registry:
        known = sorted(k for k in gym.registry if k.endswith("-v1") and k[0].isupper())
        raise ValueError(
            f"make_maniskill_env: unknown ManiSkill task {task!r}; e.g. {[k for k in known if 'Cube' in k][:8]} "
            f"({len(known)} registered)."
        )


def _single_obs_space(image_size: int, cameras: Sequence[str], state_dim: int) -> spaces.Dict:
    image = spaces.Box(0, 255, (image_size, image_size, 3), np.uint8)
    return spaces.Dict(
        {
            "images": spaces.Dict({name: image for name in cameras}),
            "state": spaces.Box(-np.inf, np.inf, (state_dim,), np.float32),
            "task": spaces.Text(MAX_TASK_LENGTH, charset=TASK_CHARSET),
        }
    )


def camera_map(raw_space: spaces.Dict, camera: str | Sequence[str] | None = None) -> dict[str, str]:
    """ManiSkill sensor name -> canonical camera name; `camera` picks the sensor shown as ``images["image"]``.

    Args:
        raw_space: the raw (unbatched) ManiSkill observation space.
        camera: a sensor name, or names in order of preference (the first the task has is used); None:
            ``base_camera``. Other sensors keep their names, ``hand_camera`` becomes ``wrist_image``.

    Raises:
        ValueError: the task has none of the sensors in `camera` (the message lists the ones it has).
    """
    sensors = [name for name, space in raw_space["sensor_data"].spaces.items() if "rgb" in space.spaces]
    wanted = [camera] if isinstance(camera, str) else list(camera or ["base_camera"])
    chosen = next((name for name in wanted if name in sensors), None)
    if chosen is None:
        raise ValueError(
            f"make_maniskill_env: camera must name a sensor of the task, expected one of {wanted}, the task has "
            f"{sensors}. Fix: pass camera= one of {sensors} (or a list of preferences ending with one of them)."
        )
    aliases = {name: CAMERAS.get(name, name) for name in sensors if name != chosen}
    return {chosen: "image", **{name: name if alias == "image" else alias for name, alias in aliases.items()}}


def _camera_names(cameras: Mapping[str, str]) -> list[str]:
    return list(cameras.values())


def _goal_reader(base: Any, task: str, first_row: bool) -> Any:
    """Reads the position (N, 3) of `task`'s goal actor, or its row 0 as numpy; None when the cameras show the goal.

    The actor is looked up on every call: a reconfiguring ManiSkill env builds new actors.
    """
    where, attribute = GOAL_OBSERVATION.get(task, ("image", ""))
    if where != "state":
        return None
    if first_row:
        return lambda: getattr(base, attribute).pose.p[0].cpu().numpy()
    return lambda: getattr(base, attribute).pose.p


def _canonical_parts(
    raw: Mapping[str, Any], tcp_pose: Any, cameras: Mapping[str, str], goal: Any = None
) -> tuple[dict[str, Any], Any]:
    images = {cameras[name]: data["rgb"] for name, data in raw["sensor_data"].items() if name in cameras}
    extra = raw.get("extra", {})
    tcp = extra["tcp_pose"] if "tcp_pose" in extra else tcp_pose()
    qpos = raw["agent"]["qpos"]
    parts = [tcp] + ([goal()] if goal is not None else [])
    if isinstance(qpos, torch.Tensor):
        state = torch.cat([qpos.float(), *(torch.as_tensor(p, device=qpos.device).float() for p in parts)], dim=-1)
    else:
        rows = qpos.shape[:-1] + (-1,)
        state = np.concatenate([qpos, *(np.asarray(p).reshape(rows) for p in parts)], axis=-1).astype(np.float32)
    return images, state


def _camera_space(base: Any) -> spaces.Dict:
    """The ``sensor_data`` part of an ``obs_mode="rgb"`` space (unbatched), for an env built without sensor obs."""
    from mani_skill.sensors.camera import Camera

    cameras = {
        name: spaces.Dict({"rgb": spaces.Box(0, 255, (sensor.config.height, sensor.config.width, 3), np.uint8)})
        for name, sensor in base.scene.sensors.items()
        if isinstance(sensor, Camera)
    }
    return spaces.Dict({"sensor_data": spaces.Dict(cameras)})


def _state_dim(raw_space: spaces.Dict, goal: Any) -> int:
    return raw_space["agent"]["qpos"].shape[-1] + 7 + (GOAL_STATE_DIM if goal is not None else 0)


PRIVILEGED_ACTORS = {"PickCubeEnv": ("cube", "goal_site"), "PushCubeEnv": ("obj", "goal_region")}
"""ManiSkill env class -> the attributes holding its cube and its goal (read by `ManiSkillObservation.task_state`)."""


class ManiSkillObservation(gym.ObservationWrapper, RecordConstructorArgs):
    """Turns one unbatched (``CPUGymWrapper``) ManiSkill env's observation into the canonical one (numpy).

    An env built with ``obs_mode="state_dict"`` has its cameras captured here, on demand: after every step until
    ``set_read_every(C)``, then only after resets, episode ends and every C-th step since a reset (other steps
    return the last images again). An env with sensor observations (``obs_mode="rgb"``) is read as it is.

    Example:
        >>> env = ManiSkillObservation(CPUGymWrapper(gym.make("PickCube-v1", obs_mode="rgb")), "pick")  # doctest: +SKIP
        >>> sorted(env.reset(seed=0)[0])  # doctest: +SKIP
        ['images', 'state', 'task']
    """

    def __init__(
        self, env: gym.Env, instruction: str, camera: str | Sequence[str] | None = None, gripper_binarize: bool = False
    ) -> None:
        RecordConstructorArgs.__init__(self, instruction=instruction, camera=camera, gripper_binarize=gripper_binarize)
        gym.ObservationWrapper.__init__(self, env)
        self.instruction = instruction
        self.gripper_binarize = bool(gripper_binarize)
        raw_space = env.observation_space
        self.capture = "sensor_data" not in raw_space.spaces  # no sensor obs: the cameras are captured here
        sensor_space = _camera_space(env.unwrapped) if self.capture else raw_space
        self.cameras = camera_map(sensor_space, camera)
        spec = env.unwrapped.spec
        self._goal = _goal_reader(env.unwrapped, spec.id if spec is not None else "", first_row=True)
        state_dim = _state_dim(raw_space, self._goal)
        size = next(iter(sensor_space["sensor_data"].values()))["rgb"].shape[-2]
        self.observation_space = _single_obs_space(size, _camera_names(self.cameras), state_dim)
        if self.capture:
            self.metadata = {**env.metadata, READ_EVERY_KEY: True}
        self._schedule = ReadSchedule()
        self._sensor_data: dict[str, dict[str, np.ndarray]] = {}  # the last captured images

    def set_read_every(self, chunk: int) -> None:
        """Captures the cameras only after resets, episode ends and every `chunk`-th step (`wrappers.freeze`)."""
        self._schedule.set_every(chunk)

    def _tcp_pose(self) -> np.ndarray:
        return self.env.unwrapped.agent.tcp.pose.raw_pose[0].cpu().numpy()

    def task_state(self) -> dict[str, np.ndarray]:
        """Privileged state of a cube task for scripted experts (`phyai_gym.train.demos.EXPERTS`), float32 numpy.

        ``tcp_pos`` (3), ``tcp_rot`` (3, 3), ``cube_pos`` (3), ``cube_quat`` (4, wxyz), ``goal`` (3), ``arm_qvel`` (7)
        and ``finger_gap`` () of PickCube-v1 or PushCube-v1; a vector env gathers them with
        ``envs.call("task_state")``. The policy never sees these (the cube only in the images).
        """
        base = self.env.unwrapped
        names = PRIVILEGED_ACTORS.get(type(base).__name__)
        if names is None:
            raise ValueError(
                f"task_state: expected a ManiSkill cube task ({', '.join(PRIVILEGED_ACTORS)}), got "
                f"{type(base).__name__}; a scripted expert for another task must read its own actors."
            )
        cube, goal = (getattr(base, name).pose for name in names)
        tcp, qpos, qvel = base.agent.tcp.pose, base.agent.robot.get_qpos()[0], base.agent.robot.get_qvel()[0]
        values = {"tcp_pos": tcp.p[0], "tcp_rot": tcp.to_transformation_matrix()[0, :3, :3], "cube_pos": cube.p[0],
                  "cube_quat": cube.q[0], "goal": goal.p[0], "arm_qvel": qvel[:7],
                  "finger_gap": qpos[7] + qpos[8]}  # fmt: skip
        return {name: value.cpu().numpy().astype(np.float32) for name, value in values.items()}

    def observation(self, observation: Mapping[str, Any]) -> dict[str, Any]:
        """Canonical observation of one env (its cameras captured now when the env does not capture them)."""
        return self._canonical(observation, read=True)

    def _canonical(self, observation: Mapping[str, Any], read: bool) -> dict[str, Any]:
        if self.capture:
            if read:
                sensors = self.env.unwrapped.get_sensor_images()  # (1, H, W, 3) uint8 per camera
                self._sensor_data = {name: {"rgb": sensors[name]["rgb"][0].cpu().numpy()} for name in self.cameras}
            observation = {**observation, "sensor_data": self._sensor_data}
        images, state = _canonical_parts(observation, self._tcp_pose, self.cameras, self._goal)
        return {
            "images": {k: np.asarray(v, dtype=np.uint8) for k, v in images.items()},
            "state": state,
            "task": self.instruction,
        }

    def step(self, action: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Steps the env (gripper binarised when asked); adds ``info["is_success"]``."""
        if self.gripper_binarize:
            action = np.array(action, dtype=np.float32)
            action[..., -1] = binarize_gripper(action[..., -1])
        obs, reward, terminated, truncated, info = self.env.step(action)
        terminated, truncated = bool(terminated), bool(truncated)
        obs = self._canonical(obs, read=self._schedule.count_step(terminated or truncated))
        if "success" in info:
            info["is_success"] = bool(info["success"])
        return obs, float(reward), terminated, truncated, info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Resets the env; its observation is always read."""
        obs, info = self.env.reset(seed=seed, options=options)
        self._schedule.reset()
        return self.observation(obs), info


VULKAN_HINT = (
    "SAPIEN found no working Vulkan driver ({error}). ManiSkill renders its cameras with Vulkan: a GPU machine "
    "needs the NVIDIA driver's Vulkan ICD (libnvidia-gl; check with `vulkaninfo`), a CPU machine a Mesa >= 24.3 "
    "lavapipe driver. Fix: run `bash .ci/install_sims.sh maniskill` (unpacks lavapipe and writes "
    "~/.cache/phyai-gym/sim_env.sh), then `source ~/.cache/phyai-gym/sim_env.sh`, or point VK_ICD_FILENAMES "
    "at a working ICD json (now {icd!r})."
)


def _gym_make(task: str, **kwargs: Any) -> gym.Env:
    """``gym.make`` of a ManiSkill task; SAPIEN's raw Vulkan errors become a `RuntimeError` saying how to fix them."""
    try:
        return gym.make(task, **kwargs)
    except RuntimeError as error:
        if "ErrorIncompatibleDriver" not in str(error) and "vk::" not in str(error):
            raise
        icd = os.environ.get("VK_ICD_FILENAMES")
        raise RuntimeError(f"make_maniskill_env: {VULKAN_HINT.format(error=error, icd=icd)}") from error


def binarize_gripper(command: Any) -> Any:
    """RLinf's gripper convention: ``2 * [g > 0.5] - 1`` (close +1 above 0.5, else open -1), numpy or torch.

    Example:
        >>> binarize_gripper(np.array([0.2, 0.5, 0.7], np.float32)).tolist()
        [-1.0, -1.0, 1.0]
    """
    return 2.0 * (command > 0.5) - 1.0


def _make_cpu_env(
    task: str,
    instruction: str,
    ignore_terminations: bool,
    env_kwargs: dict[str, Any],
    camera: str | Sequence[str] | None = None,
    gripper_binarize: bool = False,
) -> gym.Env:
    _import_maniskill()
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    if env_kwargs.get("obs_mode") == "rgb":  # captured by ManiSkillObservation after the steps that are read
        env_kwargs = {**env_kwargs, "obs_mode": "state_dict"}
    env = _gym_make(task, num_envs=1, sim_backend="physx_cpu", **env_kwargs)
    inner = CPUGymWrapper(env, ignore_terminations=ignore_terminations)
    return ManiSkillObservation(inner, instruction, camera=camera, gripper_binarize=gripper_binarize)


def _rows(value: Any, num_envs: int) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == num_envs


class ManiSkillFreezeWrapper(VectorWrapper):
    """Canonical observation and per-env freezing over a batched ``ManiSkillVectorEnv(auto_reset=False)``.

    The wrapper never autoresets (``metadata["autoreset_mode"] = DISABLED``): ``reset(options={"reset_mask":
    m})`` resets the masked envs through ManiSkill's partial reset (``options={"env_idx": ...}``).

    Freezing (rules of `wrappers.freeze`, on after `start_freezing()`, which `PolicyVectorEnv` calls): an env
    that terminates or truncates is frozen; while frozen its observation and info rows are the terminal
    ones, reward 0 and done flags False. The batched simulator still steps it (a GPU batch cannot skip
    rows), which nobody observes before its reset. A reset that does not carry ``THAW_OPTION`` leaves frozen
    envs alone; ``reset(options={"reset_mask": m, THAW_OPTION: True})`` resets and thaws the masked envs.

    Example:
        >>> venv = make_maniskill_env("PickCube-v1", num_envs=4, sim_backend="gpu")  # doctest: +SKIP
        >>> isinstance(venv, ManiSkillFreezeWrapper), venv.metadata[FREEZABLE_KEY]  # doctest: +SKIP
        (True, True)
    """

    def __init__(
        self,
        env: VectorEnv,
        instruction: str,
        camera: str | Sequence[str] | None = None,
        gripper_binarize: bool = False,
    ) -> None:
        super().__init__(env)
        base = env.unwrapped
        self.instruction = instruction
        self.gripper_binarize = bool(gripper_binarize)
        self.device = torch.device(str(base.device))
        raw_space = base.single_observation_space
        self.cameras = camera_map(raw_space, camera)
        self._goal = _goal_reader(base, base.spec.id if base.spec is not None else "", first_row=False)
        state_dim = _state_dim(raw_space, self._goal)
        size = next(iter(raw_space["sensor_data"].values()))["rgb"].shape[-2]
        self.single_observation_space = _single_obs_space(size, _camera_names(self.cameras), state_dim)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, self.num_envs)
        self.metadata = {**env.metadata, "autoreset_mode": AutoresetMode.DISABLED, FREEZABLE_KEY: True}
        self._freezing = False
        self._frozen = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        self._terminal_obs: dict[str, Any] | None = None
        self._terminal_info: dict[str, Any] = {}

    @property
    def frozen(self) -> torch.Tensor:
        """(N,) bool: envs that finished and wait for a thawing reset (none while freezing is off)."""
        return self._frozen.clone()

    def start_freezing(self) -> None:
        """Switches freezing on (see `wrappers.freeze.start_freezing`); from the next episode end on, rules 1-3 hold."""
        self._freezing = True

    def _canonical(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        base = self.env.unwrapped
        images, state = _canonical_parts(raw, lambda: base.agent.tcp.pose.raw_pose, self.cameras, self._goal)
        return {"images": dict(images), "state": state, "task": (self.instruction,) * self.num_envs}

    def _merge(self, obs: dict[str, Any], info: dict[str, Any], keep: torch.Tensor) -> None:
        """Replaces the rows `keep` of obs/info with the stored terminal ones (in place)."""
        if self._terminal_obs is None or not bool(keep.any()):
            return
        for name, image in obs["images"].items():
            image[keep] = self._terminal_obs["images"][name][keep]
        obs["state"][keep] = self._terminal_obs["state"][keep]
        for key, value in info.items():
            stored = self._terminal_info.get(key)
            if _rows(value, self.num_envs) and _rows(stored, self.num_envs):
                value[keep] = stored[keep].to(value.dtype)

    def _store(self, obs: dict[str, Any], info: dict[str, Any], rows: torch.Tensor) -> None:
        if self._terminal_obs is None:
            self._terminal_obs = {
                "images": {k: v.clone() for k, v in obs["images"].items()},
                "state": obs["state"].clone(),
            }
        else:
            for name, image in obs["images"].items():
                self._terminal_obs["images"][name][rows] = image[rows]
            self._terminal_obs["state"][rows] = obs["state"][rows]
        for key, value in info.items():
            if not _rows(value, self.num_envs):
                continue
            if key not in self._terminal_info or self._terminal_info[key].shape != value.shape:
                self._terminal_info[key] = value.clone()
            else:
                self._terminal_info[key][rows] = value[rows]

    def _info(self, info: Mapping[str, Any]) -> dict[str, Any]:
        info = dict(info)
        if "success" in info:
            info["is_success"] = info["success"].clone()
        return info

    def step(self, actions: Any) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Steps every env; frozen rows replay their terminal transition with reward 0."""
        actions = torch.as_tensor(actions, dtype=torch.float32, device=self.device)
        if self.gripper_binarize:
            actions = actions.clone()
            actions[..., -1] = binarize_gripper(actions[..., -1]).float()
        raw, reward, terminated, truncated, info = self.env.step(actions)
        obs, info = self._canonical(raw), self._info(info)
        frozen = self._frozen
        terminated = torch.as_tensor(terminated, device=self.device).bool() & ~frozen
        truncated = torch.as_tensor(truncated, device=self.device).bool() & ~frozen
        reward = torch.where(frozen, torch.zeros_like(reward), reward)
        self._merge(obs, info, frozen)
        done = terminated | truncated
        if self._freezing and bool(done.any()):
            self._store(obs, info, done)
            self._frozen = frozen | done
        return obs, reward, terminated, truncated, info

    def reset(
        self, *, seed: int | Sequence[int] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Resets the envs in ``reset_mask`` (default all) except frozen ones, unless ``THAW_OPTION`` is set."""
        options = dict(options or {})
        thaw = bool(options.pop(THAW_OPTION, False))
        mask = options.pop("reset_mask", None)
        wanted = (
            torch.ones(self.num_envs, dtype=torch.bool, device=self.device)
            if mask is None
            else torch.as_tensor(np.asarray(mask, dtype=bool), device=self.device)
        )
        if wanted.shape != (self.num_envs,):
            raise ValueError(f"ManiSkillFreezeWrapper: reset_mask must have shape ({self.num_envs},)")
        todo = wanted if thaw else wanted & ~self._frozen
        if bool(todo.all()):
            raw, info = self.env.reset(seed=seed, options=options or None)
        elif bool(todo.any()):
            options["env_idx"] = torch.nonzero(todo).flatten()
            raw, info = self.env.reset(seed=seed, options=options)
        else:
            raw, info = self.env.unwrapped.get_obs(), {}
        obs, info = self._canonical(raw), self._info(info)
        self._frozen = self._frozen & ~todo
        self._merge(obs, info, self._frozen)
        return obs, info


def make_maniskill_env(
    task: str,
    num_envs: int = 1,
    *,
    sim_backend: Literal["gpu", "cpu", "auto"] = "auto",
    image_size: int = 224,
    instruction: str | None = None,
    control_mode: str = "pd_ee_delta_pose",
    robot_uids: str | None = None,
    max_episode_steps: int | None = None,
    vectorization: Literal["auto", "maniskill", "sync", "async"] = "auto",
    render_backend: str | None = None,
    ignore_terminations: bool = False,
    camera: str | Sequence[str] | None = None,
    gripper_binarize: bool = False,
    autoreset_mode: AutoresetMode | str | None = None,
    context: str = "forkserver",
    **env_kwargs: Any,
) -> VectorEnv:
    """A freezable vector env over a ManiSkill3 task that yields the canonical observation (C1, C2).

    Args:
        task: ManiSkill env id; PickCube-v1 and PushCube-v1 are tested, any registered id works.
        num_envs: number of parallel envs.
        sim_backend: "gpu" (batched PhysX on CUDA; refused without CUDA), "cpu", or "auto" (gpu when CUDA is
            available and `vectorization` is not "sync"/"async", which run one CPU simulator per sub-env).
        image_size: camera height and width (square).
        instruction: the task instruction; default from `MANISKILL_INSTRUCTIONS` or the id.
        control_mode: ManiSkill controller, e.g. "pd_ee_delta_pose" (7-dim, the default) or "pd_joint_pos".
        robot_uids: e.g. "panda_wristcam" for a wrist camera (``images["wrist_image"]``).
        max_episode_steps: overrides the task's step limit.
        vectorization: "maniskill" (one batched env; the "auto" choice on GPU), "sync" or "async" (one
            CPUGymWrapper env per sub-env; the "auto" choice on CPU). The CPU simulator needs "sync"/"async"
            for ``num_envs > 1``.
        render_backend: SAPIEN render device (default "cpu" without CUDA, else ManiSkill's default).
        ignore_terminations: do not end episodes on success (only on the step limit; RLinf's convention, with
            ``success_once`` and ``success_at_end`` both reported by `PolicyVectorEnv`'s episode statistics).
        camera: the sensor shown as ``images["image"]``, or sensors in order of preference (RLinf's tasks use
            ``3rd_view_camera``; the tasks in the wheel have ``base_camera``); None: ``base_camera``.
        gripper_binarize: map the last action dim to ``2 * [g > 0.5] - 1`` before the simulator (RLinf).
        autoreset_mode: inner Sync/AsyncVectorEnv autoreset mode ("sync"/"async" only; default NEXT_STEP for
            "sync" and SAME_STEP for "async", whose Text observations cannot use shared memory).
        context: multiprocessing start method for "async".
        **env_kwargs: passed to ``gym.make`` (e.g. ``reconfiguration_freq``).

    Returns:
        A freezable `gymnasium.vector.VectorEnv` (``metadata[FREEZABLE_KEY]``), observations as in C1.

    Raises:
        ImportError: ManiSkill3 (or SAPIEN) is not installed; names the extra to install.
        ValueError: unknown task, bad backend/vectorization combination, sim_backend="gpu" without CUDA.
        RuntimeError: SAPIEN finds no working Vulkan driver (the message says how to install one).

    Example:
        >>> venv = make_maniskill_env("PickCube-v1", num_envs=2, sim_backend="cpu")  # doctest: +SKIP
        >>> obs, info = venv.reset(seed=0)  # doctest: +SKIP
        >>> obs["images"]["image"].shape, obs["state"].shape  # doctest: +SKIP
        ((2, 224, 224, 3), (2, 16))
    """
    if vectorization not in ("auto", "maniskill", "sync", "async"):
        raise ValueError(
            f"make_maniskill_env: vectorization must be 'auto', 'maniskill', 'sync' or 'async', got {vectorization!r}"
        )
    if sim_backend == "auto":
        per_process = vectorization in ("sync", "async")
        sim_backend = "gpu" if torch.cuda.is_available() and not per_process else "cpu"
    if sim_backend not in ("gpu", "cpu"):
        raise ValueError(f"make_maniskill_env: sim_backend must be 'gpu', 'cpu' or 'auto', got {sim_backend!r}")
    if sim_backend == "gpu" and vectorization not in ("auto", "maniskill"):
        raise ValueError(
            "make_maniskill_env: the GPU simulator is batched; sim_backend='gpu' expects vectorization='maniskill', "
            f"got vectorization={vectorization!r}."
        )
    if sim_backend == "gpu" and not torch.cuda.is_available():
        raise ValueError(
            "make_maniskill_env: sim_backend='gpu' runs ManiSkill's batched PhysX on CUDA, but this machine has no "
            f"CUDA device (torch.cuda.is_available() is False, torch {torch.__version__}). Fix: pass "
            "sim_backend='cpu' (or 'auto', which picks the CPU simulator here) with vectorization='sync' or "
            "'async' for num_envs > 1, or run on a machine with an NVIDIA GPU and a CUDA build of torch."
        )
    if vectorization == "auto":
        vectorization = "maniskill" if sim_backend == "gpu" else "sync"
    if vectorization == "maniskill" and sim_backend == "cpu" and num_envs > 1:
        raise ValueError(
            "make_maniskill_env: ManiSkill's CPU simulator runs one env per process, so vectorization='maniskill' "
            f"with sim_backend='cpu' expects num_envs=1, got num_envs={num_envs}; use vectorization='sync' "
            "or 'async' for num_envs > 1 on CPU."
        )
    if num_envs < 1:
        raise ValueError(f"make_maniskill_env: num_envs must be >= 1, got {num_envs}")
    _import_maniskill()
    _check_task(task)
    text = maniskill_instruction(task, instruction)
    if render_backend is None and not torch.cuda.is_available():
        render_backend = "cpu"
    kwargs: dict[str, Any] = {
        "obs_mode": "rgb",
        "control_mode": control_mode,
        "sensor_configs": {"width": image_size, "height": image_size},
        **env_kwargs,
    }
    if render_backend is not None:
        kwargs["render_backend"] = render_backend
    if robot_uids is not None:
        kwargs["robot_uids"] = robot_uids
    if max_episode_steps is not None:
        kwargs["max_episode_steps"] = max_episode_steps

    if vectorization == "maniskill":
        from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

        backend = "physx_cuda" if sim_backend == "gpu" else "physx_cpu"
        env = _gym_make(task, num_envs=num_envs, sim_backend=backend, **kwargs)
        inner = ManiSkillVectorEnv(env, auto_reset=False, ignore_terminations=ignore_terminations)
        return ManiSkillFreezeWrapper(inner, text, camera=camera, gripper_binarize=gripper_binarize)

    fn = functools.partial(_make_cpu_env, task, text, ignore_terminations, kwargs, camera, gripper_binarize)
    if autoreset_mode is None:
        autoreset_mode = AutoresetMode.NEXT_STEP if vectorization == "sync" else AutoresetMode.SAME_STEP
    vector_kwargs: dict[str, Any] = {}
    if vectorization == "async":
        vector_kwargs.update(context=context, shared_memory=False)
    return make_freezable_vector_env(
        [fn] * num_envs, vectorization=vectorization, autoreset_mode=autoreset_mode, **vector_kwargs
    )
