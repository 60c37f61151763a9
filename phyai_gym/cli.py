"""The ``phyai-gym`` command line: ``run`` (the main job) and ``eval`` (success rates).

``phyai-gym run`` with no arguments is an offline demo: a tiny PI0.5 with random weights and the stand-in
tokenizer on 4 MuJoCo Pusher envs. ``phyai-gym run --checkpoint DIR --preset P --env libero_spatial``
runs a real checkpoint on a real simulator. ``phyai-gym eval`` measures success rates over a fixed,
resumable episode plan (`phyai_gym.evaluation`). Each subcommand has an ``_add_<name>_parser`` /
``_<name>`` pair; errors in the options exit with status 2 and a message saying how to fix them. torch and
the simulators are imported inside the handlers, so that ``phyai-gym --help`` is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phyai_gym.protocols import list_protocols
from phyai_gym.run import POLICIES, PRESETS, RunConfig

EPISODES_FILE, RESULTS_FILE = "episodes.jsonl", "results.csv"  # phyai_gym.evaluation's names, without its imports


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to every option whose default is a value (not None / False) and not yet in its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return help_text
        return f"{help_text} (default: %(default)s)"


def _add_policy_env_arguments(parser: argparse.ArgumentParser, default_env: str | None) -> None:
    env_help = "'scripted', 'target', a Gymnasium MuJoCo id (Pusher-v5), a LIBERO suite or a ManiSkill task id"
    if default_env is None:
        env_help += " (required: an evaluation names what it measures)"
    parser.add_argument("--env", default=default_env, required=default_env is None, help=env_help)
    parser.add_argument("--num-envs", type=int, default=4, help="N, sub-envs")
    parser.add_argument("--seed", type=int, default=0, help="env i and its policy stream get seed + i")
    parser.add_argument("--checkpoint", default=None, help="PI0.5 checkpoint folder (safetensors)")
    parser.add_argument(
        "--preset", default=None, choices=PRESETS, metavar="PRESET",
        help=f"processor preset of the checkpoint: {', '.join(PRESETS)} (default: inferred from the checkpoint)",
    )  # fmt: skip
    parser.add_argument(
        "--policy", choices=POLICIES, default=None,
        help=f"policy without a checkpoint, random weights: {', '.join(POLICIES)} (default: tiny when no --checkpoint)",
    )  # fmt: skip
    parser.add_argument(
        "--action-chunk", type=int, default=None,
        help="C, env steps per policy call (default: the preset's or protocol's, else 5)",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu", help="torch device of the policy (cpu, cuda, cuda:1)")
    parser.add_argument("--image-size", type=int, default=None, help="rendered image side (default: the env's, 224)")
    parser.add_argument(
        "--max-episode-steps", type=int, default=None, help="episode limit override (default: the env's or preset's)"
    )
    parser.add_argument(
        "--vectorization", choices=["sync", "async"], default=None,
        help="sync: the N sub-envs step one after another in this process; async: one worker process per "
        "sub-env (gymnasium AsyncVectorEnv), faster when a sub-env step costs more than the process hand-over "
        "(default: async for MuJoCo envs under a CUDA policy, else sync)",
    )  # fmt: skip
    parser.add_argument(
        "--groups", type=int, default=None,
        help="env groups the policy alternates between: one simulates while the policy acts for another; the "
        "results are the same for any count; needs async sub-envs (default: 2 for MuJoCo envs under a CUDA policy, "
        "else 1)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: 1 for small policies on the CPU)"
    )


def _add_run_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run", help="run a policy in a vector env and print what it does", formatter_class=_HelpFormatter
    )
    _add_policy_env_arguments(parser, default_env="Pusher-v5")
    parser.add_argument(
        "--chunks", type=int, default=None, help="policy calls of C env steps (default: until every env finished once)"
    )
    parser.add_argument("--std", type=float, default=0.5, help="Gaussian baseline standard deviation")
    parser.add_argument("--deterministic", action="store_true", help="ODE sampling (no noise)")
    parser.set_defaults(handler=_run)


def _add_eval_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "eval", help="success rates over a fixed, resumable episode plan", formatter_class=_HelpFormatter
    )
    _add_policy_env_arguments(parser, default_env=None)
    parser.add_argument(
        "--episodes", type=int, default=None,
        help="episodes PER TASK: a LIBERO suite has 10 tasks (libero_90: 90), so --episodes 2 plans 20 episodes; "
        "a single-task env plans exactly this many (default: the protocol's)",
    )  # fmt: skip
    protocols = list(list_protocols())
    parser.add_argument(
        "--protocol", default=None, choices=protocols, metavar="PROTOCOL",
        help=f"evaluation procedure: {', '.join(protocols)} (phyai_gym/protocols.py; default: the preset's, "
        "else phyai)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="folder for episodes.jsonl, results.csv, videos (resumable)")
    parser.add_argument("--video", type=int, default=0, help="MP4s of the first K episodes (needs --out)")
    parser.add_argument(
        "--stochastic", action="store_true", help="sample with the rollout method (default: deterministic ODE)"
    )
    parser.add_argument("--task-ids", default=None, help="LIBERO task ids, comma-separated (default: all)")
    parser.add_argument(
        "--max-episodes-this-run", type=int, default=None, help="stop after this many new episodes (resume later)"
    )
    parser.set_defaults(handler=_eval)


def _config(args: argparse.Namespace, **extra: Any) -> RunConfig:
    from phyai_gym.make import check_checkpoint
    from policies.checks import check_device

    config = RunConfig(
        env=args.env,
        num_envs=args.num_envs,
        action_chunk=args.action_chunk,
        seed=args.seed,
        checkpoint=args.checkpoint,
        preset=args.preset,
        policy=args.policy,
        device=args.device,
        image_size=args.image_size,
        max_episode_steps=args.max_episode_steps,
        vectorization=args.vectorization,
        groups=args.groups,
        threads=args.threads,
        **extra,
    )
    check_device(args.device, "--device")  # refused here, before any env or model is built
    if args.checkpoint is not None:
        check_checkpoint(args.checkpoint, "--checkpoint")
    return config


def _run(args: argparse.Namespace) -> int:
    from phyai_gym.run import run

    run(_config(args, chunks=args.chunks, std=args.std, deterministic=args.deterministic))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from phyai_gym.evaluation import check_resume, evaluate_success, file_sha256, format_table, project_commit
    from phyai_gym.make import MODEL_FILE, check_checkpoint, check_preset, resolve_env
    from phyai_gym.protocols import get_protocol, protocol_for_preset
    from phyai_gym.run import (
        action_chunk_for,
        build_env,
        build_envs,
        build_policy,
        building_policy_message,
        check_state_fits,
        episode_limit,
        phase,
        sub_env_attr,
    )
    from phyai_gym.threads import configure_threads
    from policies.checks import check_int
    from wrappers import FrameRecorder, PolicyVectorEnv

    if args.checkpoint is None and args.policy is None:
        raise ValueError(
            "eval needs --checkpoint DIR (a PI0.5 checkpoint folder), or --policy tiny|base|gaussian for a "
            "random policy (tests and smoke runs)."
        )
    check_int("--video", args.video, 0, fix="the number of episodes to film (0: none)")
    if args.video and args.out is None:
        raise ValueError("conflicting options: --video needs --out DIR (the videos are written there).")
    if args.max_episodes_this_run is not None:
        check_int("--max-episodes-this-run", args.max_episodes_this_run, 1, fix="or leave it out to run them all")
    kind = resolve_env(args.env).kind
    check_preset(args.preset)
    protocol = get_protocol(args.protocol, kind) if args.protocol else protocol_for_preset(args.preset, kind)
    episodes = args.episodes if args.episodes is not None else protocol.episodes_per_task
    if episodes is None:
        raise ValueError(f"--episodes: required with --protocol {protocol.name} (it fixes no trial count).")
    if episodes < 1:
        raise ValueError(f"--episodes: expected >= 1, got {episodes}.")
    if args.task_ids is not None and kind != "libero":
        raise ValueError(f"conflicting options: --task-ids applies to LIBERO suites, not --env {args.env!r}.")
    sha = "none (random weights)"
    if args.checkpoint is not None:
        root = check_checkpoint(args.checkpoint, "--checkpoint")
        weights = root / MODEL_FILE if (root / MODEL_FILE).is_file() else sorted(root.glob("*.safetensors"))[0]
        sha = file_sha256(weights)
    cfg = _config(args)
    if cfg.action_chunk is None and protocol.action_chunk is not None:
        cfg = dataclasses.replace(cfg, action_chunk=protocol.action_chunk)
    known_now = {  # the header fields known before the env and the policy are built: a resume is checked first
        "env": args.env,
        "policy": args.policy or "checkpoint",
        "checkpoint_sha256": sha,
        "protocol": protocol.name,
        "primary_metric": protocol.primary_metric,
        "seed": args.seed,
        "deterministic": not args.stochastic,
        **({"action_chunk": cfg.action_chunk} if cfg.action_chunk is not None else {}),
    }
    check_resume(args.out, known_now, episodes)
    threads = configure_threads(args.threads, device=args.device, small_model=args.checkpoint is None)
    env_kwargs = dict(protocol.env_kwargs)
    if args.task_ids is not None:
        env_kwargs["task_ids"] = [int(t) for t in args.task_ids.split(",")]
    print(threads)
    if args.video:  # the recorder wraps one vector env
        if (args.groups or 1) > 1:
            raise ValueError(
                f"conflicting options: --video records one vector env, --groups {args.groups} asks for several. "
                "Fix: drop --groups (or pass 1) when recording videos."
            )
        cfg = dataclasses.replace(cfg, groups=1)
    build = (lambda c: build_env(c, args.preset)) if not env_kwargs else (lambda c: _protocol_env(c, dict(env_kwargs)))
    with phase(f"loading the simulator: {args.env} x {args.num_envs}"):
        envs = build_envs(cfg, build)
    if args.video:
        envs[0] = FrameRecorder(envs[0])  # every env step, not one frame per chunk
    env = envs[0]
    try:
        with phase(building_policy_message(cfg)):
            policy, description = build_policy(cfg, int(env.single_action_space.shape[0]))
            check_state_fits(cfg, env, policy)
            chunk = action_chunk_for(cfg, policy)
            wrapper = PolicyVectorEnv(
                envs, policy, action_chunk=chunk, deterministic=not args.stochastic, prefetch=len(envs) > 1
            )
    except BaseException:
        for e in envs:
            e.close()
        raise
    limit, settle = episode_limit(env), sub_env_attr(env, "settle_steps")
    header = {
        "env": args.env,
        "policy": args.policy or "checkpoint",
        "policy_description": description,
        "protocol": protocol.name,
        "checkpoint": args.checkpoint,
        "checkpoint_sha256": sha,
        "preset": getattr(getattr(policy, "processor", None), "config", None) and policy.processor.config.preset,
        "action_chunk": chunk,
        "episode_limit": limit,
        "settle_steps": settle,
        "deterministic": not args.stochastic,
        "num_envs": args.num_envs,
        "commit": project_commit(),
    }
    print(f"policy: {description}")
    print(f"protocol: {protocol.name} (primary metric: {protocol.primary_metric})")
    print(
        f"env={args.env} num_envs={args.num_envs} action_chunk={chunk} episode_limit={limit} "
        f"episodes per task={episodes}"
    )
    bar = functools.partial(tqdm, desc="eval", file=sys.stderr, dynamic_ncols=True)
    interrupted = False
    try:
        result = evaluate_success(
            wrapper,
            episodes,
            header=header,
            out_dir=args.out,
            seed=args.seed,
            primary_metric=protocol.primary_metric,
            init_state_option=kind == "libero",
            max_episodes_this_run=args.max_episodes_this_run,
            video_episodes=args.video,
            progress=bar,
        )
    except KeyboardInterrupt:
        interrupted = True
    finally:
        wrapper.close()  # evaluate_success closed the bar: the messages below are not printed onto it
    if interrupted:
        where = f"are in {Path(args.out) / EPISODES_FILE}" if args.out else "were not saved (no --out)"
        print(f"interrupted; finished episodes {where}; run the same command again to resume.")
        return 130
    print(format_table(result))
    if result.rows and all(row["success"] is None for row in result.rows):
        print(
            f"success: n/a -- {args.env} reports no success flag, so no success rate is measured (not 0); "
            "returns and lengths are. Success rates need an env with one: LIBERO, ManiSkill, 'target', 'scripted'."
        )
    planned = len(result.header["tasks"]) * episodes
    status = "complete" if result.complete else f"partial ({len(result.rows)}/{planned}; rerun to resume)"
    print(f"episodes: {status}")
    print(written_files(result))
    return 0


def written_files(result: Any) -> str:
    """Where an evaluation's files went, one per line (or that nothing was written without --out)."""
    if result.out_dir is None:
        return "files: none written (pass --out DIR to keep episodes.jsonl, results.csv and the plot)"
    out = Path(result.out_dir)
    lines = [f"episodes: {out / EPISODES_FILE}", f"results:  {out / RESULTS_FILE}"]
    if result.plot is not None:
        lines.append(f"plot:     {result.plot}")
    lines += [f"video:    {path}" for path in result.videos]
    return "\n".join(lines)


def _protocol_env(cfg: RunConfig, kwargs: dict[str, Any]) -> Any:
    """The env with the protocol's (and --task-ids') adapter arguments; --image-size still wins."""
    from phyai_gym.make import make_env

    if cfg.image_size is not None:
        kwargs["image_size"] = cfg.image_size
    return make_env(cfg.env, cfg.num_envs, max_episode_steps=cfg.max_episode_steps,
                    vectorization=cfg.resolved_vectorization(), **kwargs)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The ``phyai-gym`` argument parser (one subparser per command)."""
    parser = argparse.ArgumentParser(prog="phyai-gym", description="Run PI0.5 (or a baseline) in Gymnasium.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(subparsers)
    _add_eval_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``phyai-gym`` console script.

    Option errors exit with status 2 and a remedy, Ctrl-C with status 130 and a one-line message.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (ValueError, FileNotFoundError, ImportError) as error:
        parser.exit(2, f"phyai-gym {args.command}: error: {error}\n")
    except KeyboardInterrupt:  # Ctrl-C outside eval's episode loop (which handles its own): a message, no traceback
        what = {"run": "run writes no files, so nothing is lost"}.get(args.command, "rerun the same command to resume")
        print(f"\nphyai-gym {args.command}: interrupted (Ctrl-C); {what}.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
