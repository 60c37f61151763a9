"""MuJoCo Warp adapter: N Panda worlds simulated and rendered as one batch on the GPU (or slowly on the CPU).

`MujocoWarpVectorEnv` is a Gymnasium vector env whose observations are torch tensors on the simulator's
device (DESIGN C1: ``images`` camera -> (N, H, W, 3) uint8, ``state`` (N, S) float32, ``task`` N strings), so
`PolicyVectorEnv` and the PI0.5 processor take them with no host round trip. One `step`:

1. actions (N, 7) in [-1, 1] are copied to the device (a no-op for CUDA tensors) and turned into actuator
   targets by the end-effector delta controller (`wrappers.adapters.panda_tasks.ee_delta_targets`, torch);
2. ``substeps`` physics steps of ``mujoco_warp`` run as one captured CUDA graph (a Python loop on the CPU),
   then the kinematics (a second graph) -- on the caller's current CUDA stream, so torch work stays ordered;
3. rewards, success, termination (success) and truncation (step limit) are computed on the device;
4. the cameras are rendered by MuJoCo Warp's batch ray tracer -- every step by default, or, once
   ``set_read_every(C)`` was called (`PolicyVectorEnv` does), only for observations someone reads: resets and
   every C-th step after one (the chunk's last sub-step).

Freezing (`wrappers.freeze`, on after `start_freezing`): a world that ends is frozen -- held at its terminal
joint state (so its images, rendered at the chunk's last sub-step, show the terminal state), reward 0, no done
flags, its terminal info replayed -- until a reset with ``THAW_OPTION`` resets it. Without freezing the env
autoresets like Gymnasium's ``NEXT_STEP`` mode: the step after an episode ends resets that world. Env i draws
its initial states from a numpy stream seeded with ``seed + i``.

Example:
    >>> env = make_mujoco_warp_env("pick_cube", num_envs=2, image_size=32, device="cpu")  # doctest: +SKIP
    >>> obs, info = env.reset(seed=0)  # doctest: +SKIP
    >>> obs["images"]["image"].shape, obs["state"].shape  # doctest: +SKIP
    (torch.Size([2, 32, 32, 3]), torch.Size([2, 19]))
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from policies.checks import check_int
from wrappers.adapters import panda_tasks as pt
from wrappers.adapters.scripted import canonical_observation_space
from wrappers.freeze import FREEZABLE_KEY, READ_EVERY_KEY, THAW_OPTION

__all__ = ["CAMERAS", "REWARD_MODES", "MujocoWarpVectorEnv", "make_mujoco_warp_env"]

CAMERAS = ("image", "wrist_image")
REWARD_MODES = ("normalized_dense", "sparse")
"""ManiSkill's names: the task's dense reward scaled to [0, 1] (1 at success), or 1 at the success step, else 0."""
"""The scene's cameras: a third-person view and the wrist camera."""
CONTROL_DT = 0.05
"""Seconds per env step (20 Hz control, as ManiSkill's Panda tasks); physics runs at the model's 5 ms."""


def _import_warp() -> tuple[Any, Any]:
    try:
        import warp

        warp.config.quiet = True  # before Warp initialises: no banner, no line per kernel module loaded
        warp.config.log_level = max(warp.config.log_level, warp.LOG_WARNING)
        import mujoco_warp
    except ImportError as error:
        raise ImportError(
            f"the MuJoCo Warp envs need mujoco-warp and warp-lang ({error}). Fix: {pt.INSTALL_HINT}."
        ) from error
    return warp, mujoco_warp


class MujocoWarpVectorEnv(VectorEnv):
    """A batch of Panda cube-task worlds in MuJoCo Warp with canonical torch observations (see the module doc).

    Args:
        task: a key of `wrappers.adapters.panda_tasks.TASKS` ("pick_cube", "push_cube", "push_cube_state").
        num_envs: N worlds.
        image_size: side of every camera image (square).
        cameras: which of `CAMERAS` to render, in order.
        device: "cuda", "cuda:K" or "cpu" (None: CUDA when torch sees it).
        max_episode_steps: episode limit (None: the task's, 50).
        reward_mode: "normalized_dense" or "sparse" (`REWARD_MODES`). Success ends an episode, so under the dense
            reward an agent that hovers near success for the rest of the episode collects more than one that
            succeeds at once; RL on success (RLinf's VLA recipes) uses "sparse".
        nconmax: contact capacity per world (MuJoCo Warp preallocates).
        njmax: constraint rows per world.

    Example:
        >>> env = MujocoWarpVectorEnv("pick_cube", 2, image_size=32, device="cpu")  # doctest: +SKIP
        >>> env.single_action_space.shape, env.metadata["autoreset_mode"]  # doctest: +SKIP
        ((7,), <AutoresetMode.NEXT_STEP: 'NextStep'>)
    """

    def __init__(
        self,
        task: str = "pick_cube",
        num_envs: int = 16,
        *,
        image_size: int = 224,
        cameras: Sequence[str] = CAMERAS,
        device: str | torch.device | None = None,
        max_episode_steps: int | None = None,
        reward_mode: str = "normalized_dense",
        nconmax: int = 48,
        njmax: int = 192,
    ) -> None:
        self.task = self._check_args(task, num_envs, image_size, cameras, device, max_episode_steps, reward_mode)
        wp, mjw = _import_warp()
        self._wp, self._mjw = wp, mjw
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._wp_device = "cpu" if self.device.type == "cpu" else f"cuda:{self.device.index}"
        self.num_envs = int(num_envs)
        self.cameras = tuple(cameras)
        self.image_size = int(image_size)
        self.max_episode_steps = int(max_episode_steps or self.task.max_episode_steps)
        self.reward_mode = reward_mode
        started = time.perf_counter()
        self.mj_model = pt.build_model(self.task, self.image_size)
        self.substeps = max(1, round(CONTROL_DT / self.mj_model.opt.timestep))
        self._build_sim(nconmax, njmax)
        self.startup_s = time.perf_counter() - started
        """Seconds the constructor took (model, kernel compile or cache load, graph capture)."""

        self.single_observation_space = canonical_observation_space(
            {name: (self.image_size, self.image_size) for name in self.cameras}, self.task.state_dim
        )
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.single_action_space = spaces.Box(-1.0, 1.0, (7,), np.float32)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP, FREEZABLE_KEY: True, READ_EVERY_KEY: True,
                         "render_fps": round(1 / CONTROL_DT)}  # fmt: skip
        n, dev = self.num_envs, self.device
        self._rngs = [np.random.default_rng(i) for i in range(n)]
        self._goal = torch.zeros(n, 3, device=dev)
        self._elapsed = torch.zeros(n, dtype=torch.int64, device=dev)
        self._frozen = torch.zeros(n, dtype=torch.bool, device=dev)
        self._pending_reset = torch.zeros(n, dtype=torch.bool, device=dev)
        self._held_qpos = torch.zeros_like(self._qpos)
        self._terminal_success = torch.zeros(n, dtype=torch.bool, device=dev)
        self._freezing = False
        self._read_every = 1
        self._steps_since_reset = 0
        self._images: dict[str, torch.Tensor] = {}
        self._last_success = torch.zeros(n, dtype=torch.bool, device=dev)
        self.render_count = 0
        """Batch renders so far (resets included): what on-demand rendering saves is visible here."""

    # ------------------------------------------------------------------------------------------ set-up
    @staticmethod
    def _check_args(
        task: Any, num_envs: Any, image_size: Any, cameras: Any, device: Any, limit: Any, reward_mode: Any
    ) -> pt.PandaTask:
        if task not in pt.TASKS:
            raise ValueError(
                f"make_mujoco_warp_env: task must be one of {sorted(pt.TASKS)}, got {task!r}. "
                f"Fix: pass task='pick_cube' or 'push_cube'."
            )
        check_int("make_mujoco_warp_env: num_envs", num_envs, 1, None, fix="pass the number of worlds, e.g. 256")
        check_int("make_mujoco_warp_env: image_size", image_size, 8, 1024, fix="pass a side in pixels, e.g. 224")
        if limit is not None:
            check_int("make_mujoco_warp_env: max_episode_steps", limit, 1, None, fix="pass None for the task's 50")
        bad = [c for c in cameras] if isinstance(cameras, str) else [c for c in cameras if c not in CAMERAS]
        if bad or not cameras:
            raise ValueError(
                f"make_mujoco_warp_env: cameras must be a non-empty sequence of {list(CAMERAS)}, got {cameras!r}. "
                f"Fix: cameras=('image', 'wrist_image') or ('image',)."
            )
        if reward_mode not in REWARD_MODES:
            raise ValueError(
                f"make_mujoco_warp_env: reward_mode must be one of {list(REWARD_MODES)}, got {reward_mode!r}. "
                "Fix: reward_mode='sparse' (1 at success) or 'normalized_dense'."
            )
        if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"make_mujoco_warp_env: device={str(device)!r} but torch sees no CUDA device "
                f"(torch {torch.__version__}). Fix: device='cpu' (slow: for tests), or run on a GPU machine."
            )
        if device is not None and torch.device(device).type not in ("cuda", "cpu"):
            raise ValueError(f"make_mujoco_warp_env: device must be 'cuda', 'cuda:K' or 'cpu', got {device!r}.")
        return pt.TASKS[task]

    def _build_sim(self, nconmax: int, njmax: int) -> None:
        import mujoco

        wp, mjw, mjm = self._wp, self._mjw, self.mj_model
        mjd = mujoco.MjData(mjm)
        mujoco.mj_resetDataKeyframe(mjm, mjd, 0)
        mujoco.mj_forward(mjm, mjd)
        self._cube_body = mjm.body("box").id
        self._tcp_site = mjm.site("gripper").id
        self._cube_qpos = int(mjm.jnt_qposadr[mjm.body("box").jntadr[0]])
        low, high = mjm.actuator_ctrlrange[:, 0], mjm.actuator_ctrlrange[:, 1]
        self._ctrl_low = torch.as_tensor(low, dtype=torch.float32, device=self.device)
        self._ctrl_high = torch.as_tensor(high, dtype=torch.float32, device=self.device)
        with wp.ScopedDevice(self._wp_device):
            self.m = mjw.put_model(mjm)
            self.d = mjw.put_data(mjm, mjd, nworld=self.num_envs, nconmax=nconmax, njmax=njmax)
            self.rc = mjw.create_render_context(
                mjm, nworld=self.num_envs, cam_res=(self.image_size, self.image_size), render_rgb=True,
                render_depth=False, cam_active=list(self.cameras), use_textures=True, use_shadows=False,
            )  # fmt: skip
            self._rgb_adr = [int(a) for a in self.rc.rgb_adr.numpy()]
            self._physics_graph = self._kinematics_graph = None
            mjw.step(self.m, self.d)  # compiles the kernels (cached on disk by Warp) before any capture
            mjw.reset_data(self.m, self.d)
            if self.device.type == "cuda":
                with wp.ScopedCapture() as capture:
                    self._physics()
                self._physics_graph = capture.graph
                with wp.ScopedCapture() as capture:
                    mjw.kinematics(self.m, self.d)
                self._kinematics_graph = capture.graph
        t = wp.to_torch
        self._qpos, self._qvel, self._ctrl = t(self.d.qpos), t(self.d.qvel), t(self.d.ctrl)
        self._xanchor, self._xaxis = t(self.d.xanchor), t(self.d.xaxis)
        self._site_xpos, self._site_xmat, self._xpos = t(self.d.site_xpos), t(self.d.site_xmat), t(self.d.xpos)
        self._rgb = t(self.rc.rgb_data)

    def _physics(self) -> None:
        for _ in range(self.substeps):
            self._mjw.step(self.m, self.d)

    def _launch(self, graph: Any, eager: Any) -> None:
        """Runs a captured graph (CUDA) or its eager body (CPU), ordered on torch's current stream."""
        if graph is None:
            with self._wp.ScopedDevice(self._wp_device):
                eager()
            return
        self._wp.capture_launch(graph, stream=self._wp.stream_from_torch(torch.cuda.current_stream(self.device)))

    def _on_torch_stream(self, fn: Any) -> None:
        if self.device.type == "cpu":
            with self._wp.ScopedDevice(self._wp_device):
                fn()
            return
        with self._wp.ScopedStream(self._wp.stream_from_torch(torch.cuda.current_stream(self.device))):
            fn()

    # ------------------------------------------------------------------------------------------ freezing
    def start_freezing(self) -> None:
        """Switches the freeze rules of `wrappers.freeze` on (what `PolicyVectorEnv` needs)."""
        self._freezing = True

    def set_read_every(self, chunk: int) -> None:
        """Renders only resets and every `chunk`-th step after one (`wrappers.freeze.set_read_every`)."""
        self._read_every = check_int("MujocoWarpVectorEnv.set_read_every: chunk", chunk, 1, None, fix="pass C >= 1")

    @property
    def frozen(self) -> torch.Tensor:
        """(N,) bool: worlds that finished and wait for a thawing reset."""
        return self._frozen.clone()

    # ------------------------------------------------------------------------------------------ state
    def task_state(self) -> pt.TaskState:
        """The batched quantities the task rules and the scripted expert read (privileged: the cube's pose)."""
        cube = self._qpos[:, self._cube_qpos : self._cube_qpos + 7]
        return pt.TaskState(
            tcp_pos=self._site_xpos[:, self._tcp_site],
            tcp_rot=self._site_xmat[:, self._tcp_site],
            cube_pos=cube[:, :3],
            cube_quat=cube[:, 3:],
            goal=self._goal,
            arm_qvel=self._qvel[:, : pt.ARM_JOINTS],
            finger_gap=self._qpos[:, pt.ARM_JOINTS] + self._qpos[:, pt.ARM_JOINTS + 1],
        )

    def _state(self) -> torch.Tensor:
        tcp_quat = pt.matrix_to_quat(self._site_xmat[:, self._tcp_site])
        parts = [self._qpos[:, : pt.ARM_JOINTS + 2], self._site_xpos[:, self._tcp_site], tcp_quat]
        if self.task.goal_in_state:
            parts.append(self._goal)
        if self.task.cube_in_state:  # ManiSkill's tcp_to_obj_pos
            parts.append(self._qpos[:, self._cube_qpos : self._cube_qpos + 3] - self._site_xpos[:, self._tcp_site])
        return torch.cat(parts, dim=-1).float()

    def _render(self) -> None:
        mjw = self._mjw
        self._on_torch_stream(lambda: (mjw.refit_bvh(self.m, self.d, self.rc), mjw.render(self.m, self.d, self.rc)))
        side, images = self.image_size, {}
        for name, adr in zip(self.cameras, self._rgb_adr):
            packed = self._rgb[:, adr : adr + side * side].view(torch.uint8).view(self.num_envs, side, side, 4)
            images[name] = packed[..., [2, 1, 0]]  # BGRA bytes -> RGB, a new tensor (earlier obs stay as they were)
        self._images = images
        self.render_count += 1

    def _obs(self) -> dict[str, Any]:
        return {"images": dict(self._images), "state": self._state(), "task": (self.task.instruction,) * self.num_envs}

    def _reset_worlds(self, rows: torch.Tensor, seeds: Sequence[int | None] | None) -> None:
        """Resets the worlds `rows` ((N,) bool) to fresh initial states drawn from their own streams."""
        wp, mjw = self._wp, self._mjw
        index = np.flatnonzero(rows.cpu().numpy())
        if index.size == 0:
            return
        qpos = np.zeros((index.size, self.mj_model.nq), np.float32)
        goals = np.zeros((index.size, 3), np.float32)
        for k, i in enumerate(index):
            if seeds is not None and seeds[i] is not None:
                self._rngs[i] = np.random.default_rng(seeds[i])
            rng = self._rngs[i]
            qpos[k, : pt.ARM_JOINTS] = np.asarray(pt.HOME_QPOS) + rng.normal(0.0, pt.HOME_NOISE, pt.ARM_JOINTS)
            qpos[k, pt.ARM_JOINTS : pt.ARM_JOINTS + 2] = pt.FINGER_OPEN
            cube, goals[k] = self.task.sample(rng)
            qpos[k, self._cube_qpos : self._cube_qpos + 7] = cube
        rows_t = torch.as_tensor(index, device=self.device)
        mask = wp.from_torch(rows.to(self.device).contiguous())
        self._on_torch_stream(lambda: mjw.reset_data(self.m, self.d, reset=mask))
        new_qpos = torch.as_tensor(qpos, device=self.device)
        self._qpos[rows_t] = new_qpos
        self._ctrl[rows_t] = new_qpos[:, : pt.ARM_JOINTS + 1]  # arm joints, then the finger opening
        self._goal[rows_t] = torch.as_tensor(goals, device=self.device)
        self._elapsed[rows_t] = 0
        self._frozen[rows_t] = False
        self._pending_reset[rows_t] = False
        self._last_success[rows_t] = False

    # ------------------------------------------------------------------------------------------ Gymnasium API
    def reset(
        self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Resets every world, or those in ``options["reset_mask"]``; frozen ones only with ``THAW_OPTION``."""
        options = dict(options or {})
        thaw = bool(options.pop(THAW_OPTION, False))
        mask = options.pop("reset_mask", None)
        n = self.num_envs
        wanted = torch.ones(n, dtype=torch.bool, device=self.device)
        if mask is not None:
            mask = mask.cpu() if isinstance(mask, torch.Tensor) else mask
            wanted = torch.as_tensor(np.asarray(mask), device=self.device)
            if wanted.shape != (n,) or wanted.dtype != torch.bool:
                raise ValueError(
                    f"MujocoWarpVectorEnv.reset: options['reset_mask'] must be a bool array of shape ({n},), got "
                    f"{wanted.dtype} {tuple(wanted.shape)}. Fix: pass one flag per world."
                )
        if isinstance(seed, (int, np.integer)):
            seeds: list[int | None] | None = [int(seed) + i for i in range(n)]
        elif seed is None:
            seeds = None
        else:
            seeds = list(seed)
            if len(seeds) != n:
                raise ValueError(
                    f"MujocoWarpVectorEnv.reset: seed must be an int or {n} seeds (one per world), got {len(seeds)}. "
                    "Fix: pass seed=s (world i gets s + i)."
                )
        todo = wanted if thaw else wanted & ~self._frozen
        self._reset_worlds(todo, seeds)
        self._launch(self._kinematics_graph, lambda: self._mjw.kinematics(self.m, self.d))
        self._hold_frozen()
        self._steps_since_reset = 0
        if bool(todo.any()) or not self._images:
            self._render()
        return self._obs(), {"success": self._last_success.clone(), "is_success": self._last_success.clone()}

    def _hold_frozen(self) -> None:
        """Keeps frozen worlds at their terminal joint state (their images then show the terminal state)."""
        if self._freezing:
            held = self._frozen[:, None]
            self._qpos.copy_(torch.where(held, self._held_qpos, self._qpos))
            self._qvel.masked_fill_(held, 0.0)

    def step(self, actions: Any) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
        """One control step of every world (frozen ones replay their terminal transition with reward 0)."""
        actions = torch.as_tensor(actions, device=self.device, dtype=torch.float32)
        if actions.shape != (self.num_envs, 7):
            raise ValueError(
                f"MujocoWarpVectorEnv.step: actions must have shape (N, 7) = ({self.num_envs}, 7) "
                f"(xyz, rotation, gripper in [-1, 1]), got {tuple(actions.shape)}. Fix: one action per world."
            )
        if not bool(torch.isfinite(actions).all()):
            raise ValueError("MujocoWarpVectorEnv.step: actions must be finite, got NaN or Inf. Fix: check the policy.")
        actions = actions.clamp(-1.0, 1.0)
        arm = slice(0, pt.ARM_JOINTS)
        jac = pt.tcp_jacobian(self._site_xpos[:, self._tcp_site], self._xanchor[:, arm], self._xaxis[:, arm])
        targets = pt.ee_delta_targets(actions, self._qpos[:, arm], jac, self._ctrl_low, self._ctrl_high)
        self._ctrl.copy_(targets)
        self._launch(self._physics_graph, self._physics)
        self._hold_frozen()
        pending = self._pending_reset.clone()
        # NEXT_STEP autoreset (freezing off): the step after an end resets the world; under freezing none is
        # pending, and the check (a host sync) is skipped
        autoreset = not self._freezing and bool(pending.any())
        if autoreset:
            self._reset_worlds(pending, None)
        self._launch(self._kinematics_graph, lambda: self._mjw.kinematics(self.m, self.d))
        self._elapsed += (~self._frozen & ~pending).long()
        reward, success = self.task.evaluate(self.task_state())
        if self.reward_mode == "sparse":
            reward = success.float()
        idle = self._frozen | pending
        success = torch.where(self._frozen, self._terminal_success, success & ~pending)
        terminated = success & ~idle
        truncated = (self._elapsed >= self.max_episode_steps) & ~idle
        reward = torch.where(idle, 0.0, reward)
        done = terminated | truncated
        if self._freezing:
            self._held_qpos.copy_(torch.where(done[:, None], self._qpos, self._held_qpos))
            self._terminal_success = torch.where(done, success, self._terminal_success)
            self._frozen = self._frozen | done
        else:
            self._pending_reset = done
        self._last_success = success
        self._steps_since_reset += 1
        if self._read_every == 1 or self._steps_since_reset % self._read_every == 0 or autoreset:
            self._render()
        info = {"success": success, "is_success": success.clone(), "elapsed_steps": self._elapsed.clone()}
        return self._obs(), reward, terminated, truncated, info

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """``getattr(self, name)`` once per world (what Gymnasium's vector envs return for sub-env attributes)."""
        return (getattr(self, name),) * self.num_envs

    def close(self, **kwargs: Any) -> None:
        """Releases the simulator's device buffers."""
        self._images = {}
        self.closed = True


def make_mujoco_warp_env(task: str = "pick_cube", num_envs: int = 16, **kwargs: Any) -> MujocoWarpVectorEnv:
    """A freezable, GPU-batched Panda cube-task vector env (see `MujocoWarpVectorEnv` for the arguments).

    Example:
        >>> env = make_mujoco_warp_env("push_cube", num_envs=4, image_size=64, device="cpu")  # doctest: +SKIP
        >>> env.task.instruction  # doctest: +SKIP
        'push the cube to the red target'
    """
    return MujocoWarpVectorEnv(task, num_envs, **kwargs)
