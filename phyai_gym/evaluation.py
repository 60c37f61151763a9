"""Success-rate evaluation: a fixed episode plan, one JSONL row per finished episode, resumable.

The plan is made up front: episode e of task t gets (task, initial-state id, seed), so the set of episodes
does not depend on how fast each one ends (short episodes are not over-sampled). Every env slot runs one
planned episode at a time and, when it ends, takes the next unassigned episode of its task; the env
and the slot's policy stream are reset with the episode's seed, so an episode's outcome does not depend on
the slot or the run that played it. Each finished
episode is appended (and flushed) to ``episodes.jsonl`` at once, so an interrupted run resumes per
episode: a restart reads the file, skips the finished ids and runs only the rest -- no repeats, no losses.
The first line of the file is a header (policy, checkpoint sha256, preset, protocol, C, episode limit, settle
steps, seed, env, tasks, project commit); a restart whose defining fields differ is refused, naming the field.

Every row holds both success conventions: ``success_once`` (success at any step of the episode) and
``success_at_end`` (success at its last step; ManiSkill reports both). The protocol names its primary metric
(``header["primary_metric"]``), which is the row's ``success`` and the table's success rate. An env that reports
no success flag (Gymnasium MuJoCo) gets ``None`` in all three, and its success rates are n/a, not 0.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import subprocess
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wrappers import FrameRecorder, PolicyVectorEnv

EPISODES_FILE = "episodes.jsonl"
RESULTS_FILE = "results.csv"
PLOT_FILE = "success.png"
HEADER_KEYS_CHECKED = (
    "env",
    "tasks",
    "policy",
    "checkpoint_sha256",
    "preset",
    "protocol",
    "primary_metric",
    "action_chunk",
    "episode_limit",
    "settle_steps",
    "seed",
    "deterministic",
)
"""Header fields that define a run: all must match for a restart to resume into an existing file."""
SUCCESS_METRICS = ("success_once", "success_at_end")
"""The success conventions every row reports; a protocol picks one as its primary metric."""


@dataclass(frozen=True)
class Episode:
    """One planned episode.

    Attributes:
        episode_id: position in the plan (0-based); rows of the JSONL are keyed by it.
        task: the task instruction the episode runs.
        init_state_id: index of the initial state within the task (LIBERO's fixed initial states).
        seed: env reset seed.
    """

    episode_id: int
    task: str
    init_state_id: int
    seed: int


def plan_episodes(tasks: Sequence[str], episodes_per_task: int, seed: int) -> list[Episode]:
    """Episodes interleaved over tasks: id e runs task ``e % T``, initial state ``e // T``, seed ``seed + e``.

    Example:
        >>> [(e.task, e.init_state_id, e.seed) for e in plan_episodes(["a", "b"], 2, seed=10)]
        [('a', 0, 10), ('b', 0, 11), ('a', 1, 12), ('b', 1, 13)]
    """
    n = len(tasks)
    return [Episode(e, tasks[e % n], e // n, seed + e) for e in range(n * episodes_per_task)]


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a success rate (95 % by default); (0, 1) when n is 0.

    Example:
        >>> tuple(round(x, 3) for x in wilson_interval(8, 10))
        (0.49, 0.943)
    """
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # the interval contains p: at p = 1 float rounding put the upper bound at 0.9999999999999999
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def project_commit() -> str:
    """``PHYAI_GYM_COMMIT`` if set, else ``git rev-parse HEAD`` of the project, else "unknown".

    The variable names the commit of a copy of the tree whose ``.git`` is absent or not its own.
    """
    if os.environ.get("PHYAI_GYM_COMMIT"):
        return os.environ["PHYAI_GYM_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


@dataclass
class TaskResult:
    """Success statistics of one task (or "overall").

    Attributes:
        task: the task instruction, or "overall".
        episodes: finished episodes.
        successes: of which succeeded by the primary metric.
        success_rate: successes / episodes (nan without episodes).
        ci_low: Wilson 95 % lower bound.
        ci_high: Wilson 95 % upper bound.
        mean_return: mean episode return.
        mean_length: mean episode length in env steps.
        success_once: rate of episodes that succeeded at any step.
        success_at_end: rate of episodes that succeeded at their last step.
    """

    task: str
    episodes: int
    successes: int
    success_rate: float
    ci_low: float
    ci_high: float
    mean_return: float
    mean_length: float
    success_once: float = float("nan")
    success_at_end: float = float("nan")


@dataclass
class EvalResult:
    """What `evaluate_success` returns.

    Attributes:
        header: the run header (also the first JSONL line).
        rows: one dict per finished episode, sorted by episode id.
        tasks: per-task results, in plan order.
        overall: all episodes together.
        complete: every planned episode has a row.
        out_dir: where the JSONL/CSV went (None when not written).
        videos: the MP4s written (one per recorded episode).
        plot: the per-task success plot next to ``results.csv`` (None when not written).
        resumed: episodes that were already in ``episodes.jsonl`` when the call started.
    """

    header: dict[str, Any]
    rows: list[dict[str, Any]]
    tasks: list[TaskResult]
    overall: TaskResult
    complete: bool
    out_dir: Path | None = None
    videos: list[Path] = field(default_factory=list)
    plot: Path | None = None
    resumed: int = 0


def summarize(rows: Sequence[dict[str, Any]], tasks: Sequence[str]) -> tuple[list[TaskResult], TaskResult]:
    """Per-task and overall `TaskResult`s of episode rows."""

    def one(name: str, group: Sequence[dict[str, Any]]) -> TaskResult:
        n, k = len(group), sum(bool(r["success"]) for r in group)
        measured = [r for r in group if r["success"] is not None]  # None: the env reports no success flag
        low, high = wilson_interval(k, len(measured)) if measured else (float("nan"), float("nan"))
        nan_if_none = lambda v: np.nan if v is None else v
        mean = lambda key: float(np.mean([nan_if_none(r.get(key)) for r in group])) if group else float("nan")
        rate = k / len(measured) if measured else float("nan")
        return TaskResult(
            name, n, k, rate, low, high, mean("return"), mean("length"), mean("success_once"), mean("success_at_end")
        )

    per_task = [one(t, [r for r in rows if r["task"] == t]) for t in tasks]
    return per_task, one("overall", rows)


def format_table(result: EvalResult) -> str:
    """The results table as text: the protocol and its primary metric, one line per task, then overall.

    ``success`` (with its Wilson interval) is the primary metric; ``once`` and ``at end`` are both conventions.
    """
    protocol = result.header.get("protocol", "none named (pass header={'protocol': ...})")
    primary = result.header.get("primary_metric", "success_once")
    lines = [f"protocol: {protocol} (primary metric: {primary})"]
    if result.rows and all(r["success"] is None for r in result.rows):
        lines[0] += f"; success n/a: {result.header.get('env', 'the env')} reports no success flag (returns measured)"
    lines.append(
        f"{'task':<48} {'episodes':>8} {'success':>8} {'95% CI (Wilson)':>17} {'once':>6} {'at end':>6} "
        f"{'return':>8} {'length':>7}"
    )
    lines.append("-" * len(lines[1]))
    for r in [*result.tasks, result.overall]:
        name = r.task if len(r.task) <= 48 else r.task[:45] + "..."
        ci = "n/a" if math.isnan(r.ci_low) else f"[{r.ci_low:>6.3f}, {r.ci_high:>6.3f}]"
        lines.append(
            f"{name:<48} {r.episodes:>8d} {_rate(r.success_rate):>8} {ci:>17} {_rate(r.success_once):>6} "
            f"{_rate(r.success_at_end):>6} {r.mean_return:>8.3f} {r.mean_length:>7.1f}"
        )
    return "\n".join(lines)


def _rate(value: float) -> str:
    """A rate with 3 decimals, or "n/a" where nothing was measured (nan)."""
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def write_csv(result: EvalResult, path: Path) -> None:
    """Per-task and overall results as CSV."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(result.overall)))
        writer.writeheader()
        for r in [*result.tasks, result.overall]:
            writer.writerow(asdict(r))


def read_jsonl(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(header, episode rows) of an episodes file; a torn last line (crash mid-write) is ignored."""
    header, rows = None, []
    if not path.exists():
        return None, rows
    for line in path.read_text().splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if item.get("type") == "header":
            header = item
        elif item.get("type") == "episode":
            rows.append(item)
    return header, rows


def check_resume(out_dir: str | Path | None, settings: dict[str, Any], episodes_per_task: int) -> None:
    """Refuses, before anything is built, a run that cannot resume into `out_dir`'s episodes file.

    `settings` holds the header fields known before the env and the policy exist (env, policy, checkpoint sha256,
    protocol, seed, ...); only the `HEADER_KEYS_CHECKED` among them are compared, and `evaluate_success` compares
    all of them again once the env and the policy are built. Also refused: a file that holds more episodes per
    task than `episodes_per_task` plans (their results would not fit the plan). Nothing to check without a file.
    """
    if out_dir is None:
        return
    path = Path(out_dir) / EPISODES_FILE
    old, rows = read_jsonl(path)
    if old is None:
        return
    _check_resume(old, settings, path, keys=[k for k in HEADER_KEYS_CHECKED if k in settings])
    _check_plan_size(rows, len(old.get("tasks") or [None]), episodes_per_task, path)


def _check_plan_size(rows: Sequence[dict[str, Any]], num_tasks: int, episodes_per_task: int, path: Path) -> None:
    """Refuses a plan of `episodes_per_task` that leaves out episodes `path` already holds."""
    beyond = [r["episode_id"] for r in rows if r["episode_id"] >= num_tasks * episodes_per_task]
    if beyond:
        held = max(r["episode_id"] for r in rows) // num_tasks + 1
        raise ValueError(
            f"--episodes: {path} already holds episodes up to {held} per task (episode id {max(beyond)}), more "
            f"than --episodes {episodes_per_task} plans; the results would not match the plan. Fix: pass "
            f"--episodes {held} or more (the finished episodes are kept and the rest resume), or another --out folder."
        )


def _check_resume(
    old: dict[str, Any], new: dict[str, Any], path: Path, keys: Sequence[str] = HEADER_KEYS_CHECKED
) -> None:
    """Refuses to resume into `path` unless every field of `keys` matches (JSON-normalised)."""
    new = json.loads(json.dumps(new))  # tuples -> lists, as the file holds them
    differing = [k for k in keys if old.get(k) != new.get(k)]
    if differing:
        details = "; ".join(f"{k}: file has {old.get(k)!r}, this run has {new.get(k)!r}" for k in differing)
        raise ValueError(
            f"resume: {path} holds episodes of a different run; field(s) {', '.join(differing)} differ ({details}). "
            "Episodes of two runs would be mixed under one header. Fix: use another --out folder, run with the "
            "file's settings, or delete the file to start over."
        )


def evaluate_success(
    env: PolicyVectorEnv,
    episodes_per_task: int,
    *,
    header: dict[str, Any] | None = None,
    out_dir: str | Path | None = None,
    seed: int = 0,
    primary_metric: str = "success_once",
    init_state_option: bool = False,
    max_episodes_this_run: int | None = None,
    video_episodes: int = 0,
    on_episode: Callable[[dict[str, Any]], None] | None = None,
    progress: Callable[..., Any] | None = None,
    episode_limit: int | None = None,
) -> EvalResult:
    """Runs the planned episodes on `env` and returns per-task and overall success rates.

    Args:
        env: the policy vector env (its ``deterministic`` flag decides the sampling).
        episodes_per_task: episodes of every task the env's slots run.
        header: run metadata for the JSONL header (seed, tasks and the primary metric are added); include
            ``protocol`` (the evaluation protocol's name) so that results of two protocols never mix.
        out_dir: folder for ``episodes.jsonl``/``results.csv``/videos; an existing JSONL is resumed.
        seed: base seed of the plan (episode e resets with ``seed + e``).
        primary_metric: "success_once" (success at any step, openpi/LeRobot LIBERO) or "success_at_end" (at the
            last step); both are reported, this one is the row's ``success`` and the table's success rate.
        init_state_option: pass ``options={"init_state_id": ...}`` on resets (LIBERO's fixed initial states).
        max_episodes_this_run: stop after this many new episodes (the rest resumes on the next call).
        video_episodes: write an MP4 (every env step, at the env's frame rate) of the episodes with ids below
            this; needs imageio and a `wrappers.FrameRecorder` under the policy env:
            ``PolicyVectorEnv(FrameRecorder(make_env(...)), policy, ...)``.
        on_episode: called with every new row.
        progress: a progress-bar factory (optional), e.g. ``functools.partial(tqdm, desc="eval")``, called once
            as ``progress(total=..., initial=..., unit=...)``; it returns a tqdm-like bar (``update``, ``close``, a
            settable ``total``; ``set_postfix_str`` where present), closed when the call ends or raises. With an
            episode limit it counts env steps (unit "step") and advances every chunk: the total
            is the finished episodes' lengths plus the limit for every episode still to run, and shrinks when an
            episode ends early, so the ETA holds from the first chunk; the postfix counts episodes. Without a
            limit it counts episodes. With a bar, the plan (tasks x episodes per task) is printed first, and a
            resume prints ``resuming: N of M episodes done``.
        episode_limit: env steps per episode at most (default: ``header["episode_limit"]``); sizes the bar.

    Envs that report no success flag (Gymnasium MuJoCo) get ``None`` as every success field of a row, and
    their success rates are nan: unmeasured, not 0.

    Example:
        >>> from phyai_gym.make import make_env
        >>> from policies.baseline import GaussianPolicy
        >>> env = PolicyVectorEnv(make_env("target", 2), GaussianPolicy(1, action_horizon=1), 1,
        ...                       deterministic=True)
        >>> result = evaluate_success(env, episodes_per_task=4)
        >>> result.overall.episodes, result.complete
        (4, True)
    """
    if primary_metric not in SUCCESS_METRICS:
        raise ValueError(f"evaluate_success: primary_metric must be one of {SUCCESS_METRICS}, got {primary_metric!r}.")
    n = env.num_envs
    recorder = _find_recorder(env) if video_episodes > 0 else None
    if video_episodes > 0 and recorder is None:
        raise ValueError(
            f"video_episodes={video_episodes} needs a wrappers.FrameRecorder under the policy env (it records every "
            "env step). Fix: PolicyVectorEnv(FrameRecorder(make_env(...)), policy, ...), or video_episodes=0."
        )
    obs, _ = env.reset(seed=seed)
    slot_task = [str(t) for t in obs["task"]]
    tasks = list(dict.fromkeys(slot_task))
    plan = plan_episodes(tasks, episodes_per_task, seed)
    header = {
        "type": "header",
        **(header or {}),
        "primary_metric": primary_metric,
        "seed": seed,
        "tasks": tasks,
        "episodes_per_task": episodes_per_task,
    }
    out = Path(out_dir) if out_dir is not None else None
    rows: list[dict[str, Any]] = []
    handle = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = out / EPISODES_FILE
        old_header, rows = read_jsonl(path)
        if old_header is not None:
            _check_resume(old_header, header, path)
            _check_plan_size(rows, len(tasks), episodes_per_task, path)
        handle = open(path, "a")  # noqa: SIM115  (kept open for the run, closed in `finally`)
        if path.stat().st_size and not path.read_bytes().endswith(b"\n"):
            handle.write("\n")  # a torn last line (crash mid-write) stays on its own line
        if old_header is None:
            handle.write(json.dumps({**header, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
            handle.flush()
    finished = {r["episode_id"] for r in rows}
    queues = {t: deque(e for e in plan if e.task == t and e.episode_id not in finished) for t in tasks}
    active: list[Episode | None] = [None] * n
    frames: dict[int, list[np.ndarray]] = {}
    new_rows = 0
    budget = math.inf if max_episodes_this_run is None else max_episodes_this_run
    limit = episode_limit if episode_limit is not None else header.get("episode_limit")
    in_scope = int(min(len(plan), len(finished) + budget))  # episodes this call ends with, at most
    bar = None
    if progress is not None:  # messages before the bar appears
        print(f"plan: {len(tasks)} task(s) x {episodes_per_task} episodes per task = {len(plan)} episodes", flush=True)
        if finished:
            print(f"resuming: {len(finished)} of {len(plan)} episodes done ({out / EPISODES_FILE})", flush=True)
        if limit:
            done_steps = sum(int(r["length"]) for r in rows)
            total = done_steps + (in_scope - len(finished)) * int(limit)
            bar = progress(total=total, initial=done_steps, unit="step")
        else:
            bar = progress(total=in_scope, initial=len(finished), unit="ep")
        _postfix(bar, f"episodes {len(finished)}/{in_scope}")

    def take(slot: int) -> Episode | None:
        queue = queues[slot_task[slot]]
        active[slot] = queue.popleft() if queue else None
        if recorder is not None and active[slot] is not None and active[slot].episode_id < video_episodes:
            recorder.arm(slot, active[slot].episode_id)
        return active[slot]

    def reset_slot(slot: int, episode: Episode, reseed_stream: bool) -> None:
        options: dict[str, Any] = {"reset_mask": np.arange(n) == slot}
        if init_state_option:
            options["init_state_id"] = episode.init_state_id
        env.reset(seed=[episode.seed] * n, options=options)
        if reseed_stream:  # the slot's policy stream restarts from the episode's seed (DESIGN C3)
            _seed_stream(env.policy, slot, episode.seed, n)

    def start_all() -> None:
        """First episodes: one full reset with the episodes' seeds (env and policy streams alike)."""
        episodes = [take(slot) for slot in range(n)]
        env.reset(seed=[e.seed if e is not None else seed + i for i, e in enumerate(episodes)])
        for slot, episode in enumerate(episodes):
            if episode is not None and init_state_option:
                reset_slot(slot, episode, reseed_stream=False)

    def start(slot: int) -> None:
        episode = take(slot)
        if episode is not None:
            reset_slot(slot, episode, reseed_stream=True)

    try:
        start_all()
        while any(a is not None for a in active) and new_rows < budget:
            obs, _, _, _, infos = env.step()
            ended = _host(infos.get("_episode", np.zeros(n, bool)))
            if bar is not None and limit:
                executed = _host(infos["substep_mask"]).sum(axis=1)
                bar.update(int(sum(executed[slot] for slot in range(n) if active[slot] is not None)))
            for slot in range(n):
                episode = active[slot]
                if episode is None:
                    continue
                if not ended[slot] or new_rows >= budget:
                    continue
                stats = {k: _host(v) for k, v in infos["episode"].items()}
                measured = "success" in infos  # the env reports a success flag (Gymnasium MuJoCo does not)
                flags = {k: bool(stats[k][slot]) if measured else None for k in SUCCESS_METRICS}
                row = {
                    "type": "episode",
                    **asdict(episode),
                    "success": flags[primary_metric],
                    **flags,
                    "return": float(stats["r"][slot]),
                    "length": int(stats["l"][slot]),
                    "slot": slot,
                }
                rows.append(row)
                new_rows += 1
                if recorder is not None and episode.episode_id < video_episodes:
                    frames[episode.episode_id] = recorder.take(episode.episode_id)
                if handle is not None:
                    handle.write(json.dumps(row) + "\n")
                    handle.flush()
                if on_episode is not None:
                    on_episode(row)
                if bar is not None:
                    if limit:  # the plan counted the limit for this episode; it took row["length"]
                        bar.total = max(bar.total + row["length"] - int(limit), bar.n)
                    else:
                        bar.update(1)
                    _postfix(bar, f"episodes {len(finished) + new_rows}/{in_scope}")
                start(slot)
    finally:
        if bar is not None:
            bar.close()  # before the caller prints anything
        if handle is not None:
            handle.close()
    rows.sort(key=lambda r: r["episode_id"])
    per_task, overall = summarize(rows, tasks)
    result = EvalResult(
        header, rows, per_task, overall, complete=len(rows) == len(plan), out_dir=out, resumed=len(finished)
    )
    if out is not None:
        from phyai_gym.success_plot import plot_success

        write_csv(result, out / RESULTS_FILE)
        if not math.isnan(result.overall.success_rate):  # no success flag: nothing to plot
            result.plot = plot_success(result.tasks, result.overall, out / PLOT_FILE)
        result.videos = _write_videos(frames, out / "videos", recorder.fps if recorder is not None else 20.0)
    return result


def _host(x: Any) -> np.ndarray:
    """A per-env flag or statistic as a numpy array (device envs report torch tensors on their device)."""
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _postfix(bar: Any, text: str) -> None:
    """Shows `text` after a tqdm-like bar, where the bar supports it."""
    if hasattr(bar, "set_postfix_str"):
        bar.set_postfix_str(text)


def _find_recorder(env: Any) -> FrameRecorder | None:
    """The `FrameRecorder` in the wrapper stack under `env`, if any."""
    while env is not None:
        if isinstance(env, FrameRecorder):
            return env
        env = getattr(env, "env", None)
    return None


def _seed_stream(policy: Any, slot: int, seed: int, num_envs: int) -> None:
    """Re-seed the policy stream of env `slot` (policies with a `streams` table; others are left alone)."""
    streams = getattr(policy, "streams", None)
    if streams is not None:
        device = getattr(policy, "device", "cpu")
        ids = torch.tensor([slot], dtype=torch.int64, device=device)
        streams.set_seeds(ids, torch.tensor([seed], dtype=torch.int64, device=device), upper=num_envs)


def _write_videos(frames: dict[int, list[np.ndarray]], folder: Path, fps: float) -> list[Path]:
    """MP4s (one frame per env step, at `fps`) of the recorded episodes; skipped with a message without imageio."""
    if not frames:
        return []
    try:
        import imageio.v2 as imageio
    except ImportError:
        print("videos skipped: imageio is not installed (pip install imageio imageio-ffmpeg)")
        return []
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for episode_id, images in sorted(frames.items()):
        path = folder / f"episode_{episode_id:05d}.mp4"
        try:
            with imageio.get_writer(path, fps=fps, macro_block_size=1) as writer:
                for image in images:
                    writer.append_data(image)
        except Exception as error:  # no ffmpeg backend
            print(f"videos skipped: imageio could not write {path.name} ({error}); pip install imageio-ffmpeg")
            return paths
        paths.append(path)
    return paths
