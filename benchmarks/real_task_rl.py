"""Does SFT then PPO improve PI0.5 on a real simulator task? (issue 40, "Real improvement"; CPU or GPU)

Per seed, the whole user sequence, each step the command a user runs (in this process):

1. ``examples/sft_pi05.py --env mjwarp_push_cube_state --record-episodes N``: the scripted expert (privileged cube
   pose) records N demos, PI0.5 (``--policy-config``) is behaviour-cloned on them (with their statistics);
2. ``phyai-gym eval --checkpoint SFT --episodes K`` (deterministic): success with its Wilson 95 % interval;
3. ``examples/ppo_pi05.py --checkpoint SFT --run-dir RUN``: PPO from the SFT policy on the sparse success reward
   (its curve and plot in RUN);
4. ``phyai-gym eval --checkpoint RUN/checkpoints/last/pretrained_model``: success after PPO (``eval_ppo_<iteration>``).

One row per seed and a pooled row (all seeds' episodes) go to ``results/real_task_rl.jsonl`` (with ``sft_s``, the
recording and SFT, None when a rerun kept them; ``ppo_s``, this start's PPO; ``ppo_iteration_s``, every PPO
iteration's time from the curve, resumes included; ``ppo_target_kl``, the KL stop PPO ran with, its default for a
checkpoint resolved); each seed's PPO curve
is plotted with `phyai_gym.train.curves.plot_curves` into ``plots/real_task_rl_seed<k>.png``.

    python -m benchmarks.real_task_rl       # 3 seeds, tiny config, push-cube + state, 64 px (~20 min a seed here)
    python -m benchmarks.real_task_rl --seeds 1 --ppo-iterations 5 --eval-episodes 16   # a quick look
    python -m benchmarks.real_task_rl --device cuda --policy-config small --demos 128 --num-envs 256 --group-size 8 \
        --learning-rate 5e-5 --ppo-iterations 250 --save-every 5 --eval-episodes 256 --eval-envs 128 --work-dir runs/rt
        # docs/rl.md section 5's GPU recipe: PPO 2.6 s an iteration with 3 seeds sharing an H100

With ``--work-dir DIR`` an interrupted run resumes when started again with the same flags: a seed's finished SFT
checkpoint and its evaluations' episodes are kept, and PPO continues from its last checkpoint (``--save-every K``)
through ``examples/ppo_pi05.py --resume``; ``--ppo-iterations`` may grow between the two starts.
"""

from __future__ import annotations

import csv
import json
import math
import runpy
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import write_rows
from phyai_gym import cli
from phyai_gym.evaluation import EPISODES_FILE, read_jsonl, wilson_interval
from phyai_gym.train.curves import plot_curves
from phyai_gym.train.dataclass_cli import parse_dataclass
from phyai_gym.train.training_state import latest_checkpoint
from policies.base import TRAINABLE
from policies.checks import check_choice, check_float

BENCH = "real_task_rl"
ROOT = Path(__file__).resolve().parents[1]
PLOTS = Path(__file__).resolve().parent / "plots"


@dataclass
class Args:
    """SFT then PPO on a MuJoCo Warp Panda task, success measured by phyai-gym eval before and after."""

    env: str = "mjwarp_push_cube_state"
    """the task (a make_env name with a scripted expert in phyai_gym.train.demos.EXPERTS)"""
    policy_config: str = "tiny"
    """the PI0.5 geometry SFT starts from: "tiny" or "small" (a 4-layer, 128-wide LM and expert)"""
    seeds: int = 3
    """number of seeds (each: its own demos, SFT weights, PPO run and eval episodes)"""
    first_seed: int = 1
    """the first seed (seeds first_seed .. first_seed + seeds - 1)"""
    demos: int = 64
    """expert episodes recorded for SFT"""
    demo_noise: float = 0.0
    """DART noise std on the executed expert actions while recording (the demos keep the clean actions)"""
    sft_steps: int = 1500
    """SFT optimizer steps (batch 32)"""
    sft_trainable: str = "all"
    """what SFT trains: "all" (the random tiny vision tower and LM too: they must learn to see the cube) or
    "expert" """
    image_size: int = 64
    """camera image side (the env renders it; the processor resizes to the tiny vision tower's input); at 32 px the
    4 cm cube is about one pixel"""
    cameras: str = "image"
    """cameras rendered for SFT and PPO (the tiny policy reads "image")"""
    action_chunk: int = 5
    """C, env steps per policy call (SFT saves it; PPO and eval use it)"""
    denoise_steps: int = 5
    """K, Euler denoise steps"""
    ppo_iterations: int = 12
    """PPO iterations"""
    num_envs: int = 32
    """PPO's parallel envs"""
    save_every: int = 0
    """PPO checkpoint every K iterations, so that a rerun with the same --work-dir resumes it (0: at the end only)"""
    num_steps: int = 10
    """PPO's chunks per env per rollout (10 x C = 50: one episode)"""
    learning_rate: float = 3e-5
    """PPO actor learning rate (a checkpoint would default to base-sized rates): at 3e-4 and 1e-3 success falls
    within 20-30 iterations, at 3e-5 it held on the CPU and climbed with 256 envs on the GPU (docs/rl.md)"""
    value_lr: float = 3e-3
    """PPO value-head learning rate"""
    target_kl: float | None = None
    """PPO's --target-kl: end an update at the first minibatch whose approx-KL is above it (None: PPO's default
    for a checkpoint, 0.1; the recipe's updates stay near 1e-4)"""
    anneal_lr: bool = False
    """PPO's --anneal-lr: both learning rates fall linearly to 0 over --ppo-iterations (fixed when PPO starts: a
    resumed run keeps the schedule it was started with)"""
    noise_level: float = 0.5
    """PPO's flow-SDE noise level (exploration)"""
    ppo_trainable: str = "expert"
    """PPO's --trainable: "expert" (the SFT prefix frozen, the critic reads it) or "all" (the vision tower and LM
    learn too; pair with --vf-coef 0 under --group-size, or the critic's loss moves the features the actor reads)"""
    vf_coef: float = 0.5
    """PPO's --vf-coef (the critic is unused by group-relative advantages)"""
    group_size: int = 1
    """PPO's --group-size: G > 1 takes group-relative advantages (G envs from one state) instead of GAE's"""
    reward_mode: str = "sparse"
    """the env's reward in PPO: "sparse" (1 at success) or "normalized_dense" (make_env's default)"""
    device: str = "cpu"
    """the policy's device (SFT, PPO, eval); MuJoCo Warp simulates on CUDA whenever torch sees a GPU"""
    eval_episodes: int = 48
    """episodes of each phyai-gym eval (deterministic)"""
    eval_envs: int = 16
    """phyai-gym eval's --num-envs"""
    work_dir: str | None = None
    """keep demos, checkpoints, runs and eval folders here (None: a temporary folder)"""
    out: str | None = None
    """folder of the JSONL and the plots (None: benchmarks/results/ and benchmarks/plots/)"""

    def __post_init__(self) -> None:  # PPO's own checks would refuse these only after the SFT and its evaluation
        check_choice("--sft-trainable", self.sft_trainable, TRAINABLE)
        check_choice("--ppo-trainable", self.ppo_trainable, TRAINABLE)
        check_float("--vf-coef", self.vf_coef, 0.0, fix="0 under --group-size (the critic unused), else e.g. 0.5")

    @property
    def config(self) -> str:
        """The recipe in one string (the rows' ``config`` field)."""
        ppo = (f"ppo N={self.num_envs} T={self.num_steps} lr={self.learning_rate:g}/{self.value_lr:g}"
               + (" annealed" if self.anneal_lr else "") + (f" kl<={self.target_kl:g}" if self.target_kl else "")
               + f" a={self.noise_level:g} {self.reward_mode}"
               + (f" trainable={self.ppo_trainable}" if self.ppo_trainable != "expert" else "")
               + (f" vf={self.vf_coef:g}" if self.vf_coef != 0.5 else "")
               + (f" G={self.group_size}" if self.group_size > 1 else ""))  # fmt: skip
        return (f"{self.policy_config},{self.image_size}px,{self.cameras},C={self.action_chunk},K={self.denoise_steps},"
                f"sft={self.sft_trainable},sft_steps={self.sft_steps},dart={self.demo_noise:g},{ppo}")  # fmt: skip


def _example(name: str, argv: list[str]) -> None:
    """Runs ``examples/<name>`` with `argv` as its command line, in this process (as a user runs it)."""
    saved = sys.argv
    try:
        sys.argv = [name, *argv]
        runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")
    finally:
        sys.argv = saved


def evaluate(args: Args, checkpoint: Path, out: Path, seed: int) -> tuple[int, int]:
    """(successes, episodes) of ``phyai-gym eval`` on `checkpoint` (deterministic, seeds from `seed`)."""
    code = cli.main(["eval", "--env", args.env, "--checkpoint", str(checkpoint), "--episodes", str(args.eval_episodes),
                     "--num-envs", str(args.eval_envs), "--device", args.device, "--image-size", str(args.image_size),
                     "--action-chunk", str(args.action_chunk), "--seed", str(seed), "--out", str(out)])  # fmt: skip
    if code != 0:
        raise RuntimeError(f"phyai-gym eval of {checkpoint} exited with {code}")
    _, rows = read_jsonl(out / EPISODES_FILE)
    return sum(bool(r["success"]) for r in rows), len(rows)


def one_seed(args: Args, seed: int, work: Path) -> dict:
    """SFT, eval, PPO, eval for one seed; returns its row (and its PPO curve under ``curve``)."""
    work.mkdir(parents=True, exist_ok=True)
    sft, run = work / "sft", work / "ppo"
    started, reused = time.perf_counter(), (sft / "policy_config.json").is_file()
    if not reused:  # policy_config.json is the last file of a saved policy: a finished SFT is kept
        _example("sft_pi05.py", ["--env", args.env, "--seed", str(seed), "--device", args.device,
                                 "--config", args.policy_config,
                                 "--record-episodes", str(args.demos),
                                 "--demos", str(work / "demos.h5"), "--steps", str(args.sft_steps), "--image-size",
                                 str(args.image_size), "--cameras", args.cameras, "--action-chunk",
                                 str(args.action_chunk), "--denoise-steps", str(args.denoise_steps), "--trainable",
                                 args.sft_trainable, "--demo-noise", str(args.demo_noise),
                                 "--out", str(sft), "--csv",
                                 str(work / "sft_curve.csv"), "--eval-episodes", "0", "--log-every", "50"])  # fmt: skip
    sft_s = time.perf_counter() - started
    eval_seed = 10_000 * seed  # the same episodes before and after PPO, apart from the demos' and PPO's seeds
    sft_k, sft_n = evaluate(args, sft, work / "eval_sft", eval_seed)
    started = time.perf_counter()
    schedule = ["--total-iterations", str(args.ppo_iterations), "--save-every", str(args.save_every)]
    if latest_checkpoint(run) is not None:  # an interrupted run: its own flags, from its last checkpoint
        _example("ppo_pi05.py", ["--resume", str(run), *schedule])
    else:
        _example("ppo_pi05.py", ["--env", args.env, "--seed", str(seed), "--device", args.device,
                                 "--checkpoint", str(sft), "--run-dir", str(run),
                                 "--image-size", str(args.image_size), "--cameras", args.cameras, "--action-chunk",
                                 str(args.action_chunk), "--denoise-steps", str(args.denoise_steps), "--num-envs",
                                 str(args.num_envs), "--num-steps", str(args.num_steps), *schedule,
                                 "--learning-rate", str(args.learning_rate), "--value-lr",
                                 str(args.value_lr), "--noise-level", str(args.noise_level), "--reward-mode",
                                 args.reward_mode, "--group-size", str(args.group_size),
                                 "--trainable", args.ppo_trainable, "--vf-coef", str(args.vf_coef),
                                 "--anneal-lr" if args.anneal_lr else "--no-anneal-lr",
                                 *(["--target-kl", str(args.target_kl)] if args.target_kl is not None else []),
                                 "--eval-episodes", "0"])  # fmt: skip
    ppo_s = time.perf_counter() - started
    last = latest_checkpoint(run)  # checkpoints/<iteration>: a resumed, longer run is evaluated anew
    ppo_k, ppo_n = evaluate(args, last / "pretrained_model", work / f"eval_ppo_{int(last.name)}", eval_seed)
    with (run / "curve.csv").open() as handle:
        curve = [{k: float(v) if v not in ("", None) else float("nan") for k, v in r.items()}
                 for r in csv.DictReader(handle)]  # fmt: skip
    plots = PLOTS if args.out is None else Path(args.out)  # a run elsewhere keeps its plots beside its rows
    title = f"PPO from SFT, {args.policy_config} PI0.5, {args.env}, seed {seed}"
    plot_curves(curve, plots / f"{BENCH}_seed{seed}.png", title=title)
    return {
        "seed": seed, "sft_successes": sft_k, "sft_episodes": sft_n, "ppo_successes": ppo_k, "ppo_episodes": ppo_n,
        "sft_s": None if reused else round(sft_s, 1),  # recording + SFT, None when a rerun kept them
        "ppo_s": round(ppo_s, 1),  # this start's PPO (a resumed run: its part)
        "ppo_iteration_s": round(sum(r["time_rollout"] + r["time_train"] + r["time_sync"] for r in curve), 1),
        "ppo_target_kl": json.loads((run / "args.json").read_text())["target_kl"],  # PPO's, its default resolved
        "ppo_rollout_success": [None if math.isnan(r["success_rate"]) else round(r["success_rate"], 3) for r in curve],
    }  # fmt: skip


def _rates(k_sft: int, n_sft: int, k_ppo: int, n_ppo: int) -> dict:
    sft_ci, ppo_ci = wilson_interval(k_sft, n_sft), wilson_interval(k_ppo, n_ppo)
    return {
        "sft_success": k_sft / n_sft, "sft_ci": [round(v, 3) for v in sft_ci],
        "ppo_success": k_ppo / n_ppo, "ppo_ci": [round(v, 3) for v in ppo_ci],
        "gain_points": round(100 * (k_ppo / n_ppo - k_sft / n_sft), 1),
        "intervals_overlap": bool(ppo_ci[0] <= sft_ci[1]),
    }  # fmt: skip


def run(args: Args) -> list[dict]:
    """Every seed (its row written as soon as it is measured), then the pooled row; returns the rows written."""
    common = {"env": args.env, "config": args.config, "demos": args.demos, "iterations": args.ppo_iterations,
              "eval_episodes": args.eval_episodes, "settings": asdict(args)}  # fmt: skip
    keys = ("sft_successes", "sft_episodes", "ppo_successes", "ppo_episodes")
    written, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            r = one_seed(args, seed, work / f"seed{seed}")
            results.append(r)
            written += write_rows(BENCH, [{**common, "seeds": [seed], **_rates(*(r[k] for k in keys)), **r}], args.out)
    if len(results) > 1:
        total = [sum(r[k] for r in results) for k in keys]
        pooled = {**common, "seeds": [r["seed"] for r in results], "seed": "pooled", **_rates(*total),
                  **dict(zip(keys, total))}  # fmt: skip
        written += write_rows(BENCH, [pooled], args.out)
    return written


if __name__ == "__main__":
    run(parse_dataclass(Args))
