"""Demonstrations for behaviour cloning, in ManiSkill's trajectory format (``trajectory.h5`` + ``trajectory.json``).

Why that format: ManiSkill ships its demonstrations this way, recorded by motion-planning experts that read the
simulator's privileged state, which is how demos are made here too; it keeps raw uint8 frames per episode (no video
codec to install), needs only h5py, and its readers (``mani_skill.trajectory``) and converters already exist.
LeRobotDataset v3 would need parquet and mp4 tooling (pyarrow, a video decoder) for the same content.

Layout (one group per episode; T actions, T+1 observations, the last one the episode's final observation)::

    trajectory.h5   traj_<i>/actions                      (T, A) float32
                    traj_<i>/rewards, terminated, truncated, success   (T,)
                    traj_<i>/obs/sensor_data/<camera>/rgb (T+1, H, W, 3) uint8
                    traj_<i>/obs/state                     (T+1, S) float32
    trajectory.json {"env_info": {"env_id": ..., "env_kwargs": {...}},
                     "episodes": [{"episode_id": i, "episode_seed": s, "elapsed_steps": T, "success": bool,
                                   "task": "the instruction"}]}

The observation keys are the canonical ones (DESIGN C1: cameras, state, task); ``task`` is this project's addition
to ManiSkill's episode record. Any env with a scripted expert (e.g. a GPU simulator's pick-and-place planner) plugs
into ``examples/sft_pi05.py`` by writing this layout, with `write_demos` or by hand.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _h5py():
    try:
        import h5py
    except ImportError as err:
        raise ImportError(
            f"demonstrations are ManiSkill .h5 files, which need h5py ({err}). Fix: pip install h5py."
        ) from err
    return h5py


@dataclass
class Episode:
    """One demonstrated episode.

    Attributes:
        images: camera -> (T+1, H, W, 3) uint8 frames (the last one: the final observation).
        state: (T+1, S) float32 states.
        actions: (T, A) float32 actions.
        task: the instruction.
        rewards: (T,) float32.
        success: whether the episode succeeded.
        seed: the reset seed (None: unknown).
    """

    images: dict[str, np.ndarray]
    state: np.ndarray
    actions: np.ndarray
    task: str
    rewards: np.ndarray
    success: bool
    seed: int | None = None

    @property
    def length(self) -> int:
        """T, the number of actions."""
        return int(self.actions.shape[0])


def write_demos(path: str | Path, episodes: Sequence[Episode], env_info: dict[str, Any] | None = None) -> Path:
    """Write `episodes` as ``path`` (.h5) and its ``.json`` sidecar; returns the .h5 path."""
    h5py = _h5py()
    path = Path(path).with_suffix(".h5")
    path.parent.mkdir(parents=True, exist_ok=True)
    records = []
    with h5py.File(path, "w") as f:
        for i, ep in enumerate(episodes):
            g = f.create_group(f"traj_{i}")
            g["actions"] = ep.actions.astype(np.float32)
            g["rewards"] = ep.rewards.astype(np.float32)
            g["success"] = np.zeros(ep.length, bool)
            g["success"][-1:] = ep.success
            g["terminated"], g["truncated"] = np.zeros(ep.length, bool), np.zeros(ep.length, bool)
            for cam, frames in ep.images.items():
                g[f"obs/sensor_data/{cam}/rgb"] = frames.astype(np.uint8)
            g["obs/state"] = ep.state.astype(np.float32)
            records.append({"episode_id": i, "episode_seed": ep.seed, "elapsed_steps": ep.length,
                            "success": bool(ep.success), "task": ep.task})  # fmt: skip
    meta = {"env_info": env_info or {}, "episodes": records}
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    return path


def read_demos(path: str | Path) -> list[Episode]:
    """The episodes of a ManiSkill-layout ``trajectory.h5`` (with its ``.json`` sidecar for the tasks)."""
    h5py = _h5py()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"demos: {str(path)!r} does not exist. Fix: record them first "
                                "(python examples/sft_pi05.py --record-episodes 64 --demos FILE).")  # fmt: skip
    meta_file = path.with_suffix(".json")
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {"episodes": []}
    by_id = {int(e["episode_id"]): e for e in meta.get("episodes", [])}
    episodes = []
    with h5py.File(path, "r") as f:
        for name in sorted(f, key=lambda n: int(n.split("_")[1])):
            g, i = f[name], int(name.split("_")[1])
            record = by_id.get(i, {})
            cams = g["obs/sensor_data"]
            episodes.append(Episode(
                images={cam: cams[cam]["rgb"][()] for cam in cams},
                state=g["obs/state"][()] if "state" in g["obs"] else np.zeros((len(g["actions"]) + 1, 0), np.float32),
                actions=g["actions"][()].astype(np.float32),
                task=str(record.get("task", "")),
                rewards=g["rewards"][()] if "rewards" in g else np.zeros(len(g["actions"]), np.float32),
                success=bool(record.get("success", bool(g["success"][-1]) if "success" in g else False)),
                seed=record.get("episode_seed"),
            ))  # fmt: skip
    return episodes


def _host(value: Any) -> np.ndarray:
    """A numpy array of `value` (torch tensors of GPU-batched simulators, e.g. MuJoCo Warp's, come to the host)."""
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)


def _row(obs: dict[str, Any], i: int) -> tuple[dict[str, np.ndarray], np.ndarray, str]:
    """(images, state, task) of env i in a batched canonical observation (or one env's own, unbatched)."""
    images = {cam: _host(frames[i]) for cam, frames in obs["images"].items()}
    return images, _host(obs["state"][i]).astype(np.float32), str(obs["task"][i])


def record_demos(
    envs: Any, expert: Callable[[dict[str, Any]], Any], episodes: int, *, seed: int = 0, noise: float = 0.0
) -> list[Episode]:
    """The first `episodes` episodes that `expert` (batched canonical obs -> (N, A) actions) finishes in `envs`.

    ``noise > 0`` records DART demonstrations (Laskey et al., 2017): the env executes the expert's action plus
    Gaussian noise of that std (clipped to the action space), the episode stores the expert's clean action. The
    demos then show how the expert corrects small errors, which a cloned policy makes and a noiseless expert never
    shows.

    `envs` autoresets in the same step (SAME_STEP: the final observation is ``infos["final_obs"]``, success the final
    info's ``is_success`` or ``success``) or in the next one (NEXT_STEP, as MuJoCo Warp's envs: the step that ends an
    episode returns its final observation and success flag, the next step resets that env and its action is
    ignored). Observations, rewards and flags may be numpy arrays or torch tensors.
    """
    mode = envs.metadata.get("autoreset_mode")
    mode = getattr(mode, "value", mode)
    if mode not in ("SameStep", "NextStep"):
        raise ValueError(
            f"record_demos: expected a vector env with autoreset_mode SAME_STEP or NEXT_STEP, got {mode!r}. Fix: "
            "build it with autoreset_mode=AutoresetMode.SAME_STEP (the final observation is kept)."
        )
    if not (noise >= 0 and math.isfinite(noise)):
        raise ValueError(f"record_demos: noise must be a finite std >= 0, got {noise!r}. Fix: pass e.g. 0.3, or 0.")
    n = envs.num_envs
    low, high = envs.single_action_space.low, envs.single_action_space.high
    rng = np.random.default_rng(seed)
    obs, _ = envs.reset(seed=seed)
    open_eps = [{"obs": [_row(obs, i)], "actions": [], "rewards": []} for i in range(n)]
    seeds: list[int | None] = [seed + i for i in range(n)]
    resetting = np.zeros(n, bool)  # NEXT_STEP: env i ended last step; this step resets it
    done_eps: list[Episode] = []
    while len(done_eps) < episodes:
        actions = np.asarray(_host(expert(obs)), np.float32)
        executed = actions
        if noise > 0:
            executed = np.clip(actions + rng.normal(0.0, noise, actions.shape), low, high).astype(np.float32)
        obs, reward, terminated, truncated, infos = envs.step(executed)
        reward, ended = _host(reward), _host(terminated) | _host(truncated)
        if mode == "SameStep":
            final_info = infos.get("final_info", {})
            flags = final_info.get("is_success", final_info.get("success"))
        else:
            flags = infos.get("is_success", infos.get("success"))
        flags = None if flags is None else _host(flags)
        for i in range(n):
            if resetting[i]:  # the reset step of a NEXT_STEP env: a new episode starts at its observation
                open_eps[i], resetting[i] = {"obs": [_row(obs, i)], "actions": [], "rewards": []}, False
                continue
            ep = open_eps[i]
            ep["actions"].append(actions[i])
            ep["rewards"].append(float(reward[i]))
            if not ended[i]:
                ep["obs"].append(_row(obs, i))
                continue
            if mode == "SameStep":
                final = infos["final_obs"][i]
                ep["obs"].append(({c: _host(v) for c, v in final["images"].items()},
                                  _host(final["state"]).astype(np.float32), str(final["task"])))  # fmt: skip
                open_eps[i] = {"obs": [_row(obs, i)], "actions": [], "rewards": []}
            else:
                ep["obs"].append(_row(obs, i))
                resetting[i] = True
            done_eps.append(Episode(
                images={cam: np.stack([o[0][cam] for o in ep["obs"]]) for cam in ep["obs"][0][0]},
                state=np.stack([o[1] for o in ep["obs"]]), actions=np.stack(ep["actions"]), task=ep["obs"][0][2],
                rewards=np.asarray(ep["rewards"], np.float32), success=bool(flags[i]) if flags is not None else False,
                seed=seeds[i],
            ))  # fmt: skip
            seeds[i] = None  # later episodes of env i continue its RNG: no seed of their own
    return done_eps[:episodes]


def target_expert(obs: dict[str, Any]) -> np.ndarray:
    """The target task's scripted expert: move to the target.

    It reads the exact target position from the state; the policy sees it only as prompt bins and the image colour.
    """
    return np.asarray(obs["state"], np.float32)[:, :1].copy()


def panda_expert(envs: Any) -> Callable[[dict[str, Any]], Any]:
    """The MuJoCo Warp Panda tasks' scripted expert for `envs` (`wrappers.adapters.panda_tasks.scripted_action`).

    It reads privileged simulator state (the cube's pose, the goal) from `envs.task_state()`, not the observation;
    the policy sees the cube in the camera images (and, for ``mjwarp_push_cube_state``, in the state).
    """
    from wrappers.adapters.panda_tasks import scripted_action

    return lambda obs: scripted_action(envs.task, envs.task_state())


MANISKILL_EXPERT_GAIN = 1.0
"""The Panda expert's gain on ManiSkill: its pd_ee_delta_pose controller follows a delta slowly (5 steps of +0.5 in x
moved the TCP 0.105 m of the 0.25 m commanded), and at the emulation's gain of 0.5 the push stalls short of the goal."""


def maniskill_expert(task_name: str) -> Callable[[Any], Callable[[dict[str, Any]], Any]]:
    """The Panda tasks' scripted expert on ManiSkill3 CPU PickCube-v1 or PushCube-v1 (task_name pick_cube, push_cube).

    ``build(envs)`` reads each sub-env's privileged state through ``envs.call("task_state")``
    (`wrappers.adapters.maniskill.ManiSkillObservation.task_state`).

    ManiSkill's rotation deltas turn the TCP the opposite way about each world axis from the emulation's, so the
    expert's rotation is negated here.
    """

    def build(envs: Any) -> Callable[[dict[str, Any]], Any]:
        from wrappers.adapters import panda_tasks as pt

        task = pt.TASKS[task_name]

        def expert(obs: dict[str, Any]) -> Any:
            rows = envs.call("task_state")
            s = {name: torch.as_tensor(np.stack([row[name] for row in rows])) for name in rows[0]}
            action = pt.scripted_action(task, pt.TaskState(**s), gain=MANISKILL_EXPERT_GAIN)
            action[:, 3:6] = -action[:, 3:6]
            return action.numpy()

        return expert

    return build


EXPERTS: dict[str, Callable[[Any], Callable[[dict[str, Any]], Any]]] = {
    "target": lambda envs: target_expert,
    "mjwarp_push_cube": panda_expert,
    "mjwarp_push_cube_state": panda_expert,
    "mjwarp_pick_cube": panda_expert,
    "PickCube-v1": maniskill_expert("pick_cube"),
    "PushCube-v1": maniskill_expert("push_cube"),
}
"""Scripted experts by env name (`phyai_gym.make_env` names): ``EXPERTS[name](envs)`` is the batched expert
``obs -> (N, A) actions`` for those envs (an expert may read the simulator's privileged state)."""


@dataclass
class ChunkBatch:
    """Behaviour-cloning samples: observations at frame t and the demonstrated chunk a[t : t+H].

    Attributes:
        obs: batched canonical observation (images, state, task).
        actions: (B, H, A) float32 env actions, padded past the episode's end with its last action.
        mask: (B, H) bool, False on that padding.
    """

    obs: dict[str, Any]
    actions: np.ndarray
    mask: np.ndarray


class ChunkSampler:
    """(episode, frame) samples of a demo set, each with its action chunk of H steps.

    As LeRobot's ``delta_timestamps`` action chunks, with ``action_is_pad`` as `mask`.

    Example:
        >>> ep = Episode({"image": np.zeros((3, 4, 4, 3), np.uint8)}, np.zeros((3, 2), np.float32),
        ...              np.array([[1.0], [2.0]], np.float32), "task", np.zeros(2, np.float32), True)
        >>> batch = ChunkSampler([ep], horizon=3).batch(np.array([1]))
        >>> batch.actions[0, :, 0].tolist(), batch.mask[0].tolist()
        ([2.0, 2.0, 2.0], [True, False, False])
    """

    def __init__(self, episodes: Sequence[Episode], horizon: int) -> None:
        if not episodes:
            raise ValueError("ChunkSampler: expected at least one episode, got none. Fix: record demos first.")
        self.episodes, self.horizon = list(episodes), horizon
        self.index = np.array([(e, t) for e, ep in enumerate(self.episodes) for t in range(ep.length)], np.int64)

    def __len__(self) -> int:
        return len(self.index)

    def batch(self, rows: np.ndarray) -> ChunkBatch:
        """The samples `rows` (indices into the flat frame list)."""
        images: dict[str, list[np.ndarray]] = {}
        states, tasks, chunks, masks = [], [], [], []
        for e, t in self.index[rows]:
            ep = self.episodes[e]
            for cam, frames in ep.images.items():
                images.setdefault(cam, []).append(frames[t])
            states.append(ep.state[t])
            tasks.append(ep.task)
            steps = np.minimum(np.arange(t, t + self.horizon), ep.length - 1)
            chunks.append(ep.actions[steps])
            masks.append(np.arange(t, t + self.horizon) < ep.length)
        obs = {"images": {c: np.stack(v) for c, v in images.items()}, "state": np.stack(states), "task": tasks}
        return ChunkBatch(obs, np.stack(chunks).astype(np.float32), np.stack(masks))
