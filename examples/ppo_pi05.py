"""PPO for PI0.5 over a PolicyVectorEnv, in the style of cleanrl's ppo_continuous_action.py.

Two copies of the policy: the ROLLOUT policy acts in the envs (CUDA graphs on a GPU), the TRAINER copy
(eager, same weights, trainable subset only) recomputes log-probs/values with `evaluate()` and takes the
optimizer steps. After every update the rollout policy receives the trainer's trainable weights through
the weight-sync hook (`policy.sync_weights(trainer.model)`), and its weight version goes up by one.

The trainer computes in the rollout's precision (bf16 blocks, fp32 islands) and the optimizer steps float32
master weights (`MasterWeights`), so update 0 has ratio 1 up to batch-shape rounding (`--trainer-dtype float32`
computes in float32 instead). With the prefix frozen (`--trainable expert`) the rollout keeps its prefix K/V
for the update (`RolloutConfig.keep_prefix`): no epoch or minibatch recomputes the vision tower or the LM.

One MDP step is one action chunk (C env steps, rewards summed, RLinf's chunk-level setting). Truncated
episodes are bootstrapped with the critic on their final observation (``infos["policy"]["final_value"]``).

    python examples/ppo_pi05.py                                 # tiny PI0.5 on the target task, CPU
    python examples/ppo_pi05.py --config base --device cuda     # published geometry on a GPU
    python examples/ppo_pi05.py --env libero_spatial --checkpoint DIR --preset rlinf_pi05_libero --device cuda
    python examples/ppo_pi05.py --help                          # every flag, its meaning and default

Issue 40's defaults (docs/rl.md): one clipped ratio per Gaussian element of the chunk (``--logprob-reduction``),
the actor at 5e-6, the value head at 1e-4 (``--value-lr``) and an update stopped at approx-KL 0.1 (``--target-kl``)
for the base config. ``--run-dir DIR`` keeps the curve
and checkpoints in LeRobot's layout (``DIR/checkpoints/<iteration>/pretrained_model`` loads with `make_policy`),
``--resume DIR`` continues a run, ``--tensorboard`` logs beside the CSV.

    python examples/ppo_pi05.py --run-dir runs/a --save-every 5 --tensorboard    # checkpoints every 5 iterations
    python examples/ppo_pi05.py --resume runs/a --total-iterations 40            # continue it to 40

The curve is written as it goes (``--csv``, one row flushed per iteration) and plotted next to it (same name,
``.png``) at the end and on Ctrl-C; `phyai_gym.train.curves` does both. A rerun with the same ``--csv`` starts from
iteration 1 in a fresh file and keeps the earlier one as ``<stem>.<k>.csv`` (nothing lost, nothing duplicated).

Data parallel under torchrun (`phyai_gym.train.distributed`; NCCL on GPUs, gloo on the CPU): each of G ranks owns N
envs -- rank r's are envs r*N..(r+1)*N-1 of one run with G*N envs (the same env seeds and policy noise streams)
-- its rollout policy and its trainer copy. Every minibatch, one all-reduce of sums gives the global approx-KL,
clip fraction and advantage mean/std, and one all-reduce averages the float32 master gradients, so every rank
steps identical weights and syncs its own rollout policy in process. Rank 0 writes the CSV; the final evaluation
is split over the ranks. Without torchrun (no WORLD_SIZE) nothing of this runs.

    torchrun --nproc_per_node 2 examples/ppo_pi05.py --num-envs 16         # 2 CPU ranks (gloo), 32 envs
    torchrun --nproc_per_node 8 examples/ppo_pi05.py --config base --device cuda --num-envs 32
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch

from phyai_gym.make import SMALL_CONFIGS, make_env, make_policy
from phyai_gym.threads import configure_threads
from phyai_gym.train.curves import CurveLog
from phyai_gym.train.dataclass_cli import parse_dataclass
from phyai_gym.train.distributed import GradientMean, ProcessGroup
from phyai_gym.train.groups import FirstEpisodes, check_group_size, grouped_reset_seeds
from phyai_gym.train.master_weights import MasterWeights
from phyai_gym.train.ppo_math import (
    LOGPROB_REDUCTIONS,
    RewardNormalizer,
    clipped_losses,
    gae,
    log_ratio,
    ratio_stats,
)
from phyai_gym.train.training_state import TrainingState, latest_checkpoint
from policies.pi05.batch import RolloutBatch
from policies.pi05.policy import RolloutConfig
from wrappers import PolicyVectorEnv


@dataclass
class Args:
    """PPO for PI0.5 over a PolicyVectorEnv (cleanrl style); every flag below is a field of this dataclass."""

    seed: int = 1
    """seed of the weights (random policies), the envs and the minibatch shuffle"""
    threads: int | None = None
    """torch CPU threads (None: 1 for the tiny config on the CPU, torch's default otherwise)"""
    device: str = "cpu"
    """device of the rollout policy and the trainer"""
    # Policy
    config: str = "tiny"
    """"tiny", "small" or "base" (random weights, stand-in tokenizer) when --checkpoint is not given"""
    checkpoint: str | None = None
    """a PI0.5 checkpoint folder (its preset sets the prompt format and the action dims)"""
    preset: str | None = None
    """processor preset of the checkpoint"""
    trainable: str = "expert"
    """"expert" (action expert, projections, heads) or "all" """
    trainer_dtype: str | None = None
    """compute dtype of the trainer copy (None: the rollout's, with float32 master weights; or "float32")"""
    trainer_cuda_graphs: bool = True
    """replay the trainer's evaluate() forward and backward as CUDA graphs (GPU, kept-prefix batches; else eager)"""
    method: str = "sde"
    """rollout noise: "sde" (flow-SDE) or "noise" (learned noise head)"""
    joint: bool = True
    """every denoise step stochastic, log-prob over the whole chain (False: one random step j per env)"""
    denoise_steps: int = 5
    """K, Euler denoise steps of the rollout"""
    noise_level: float = 1.0
    """a, the flow-SDE noise level (1.0: the first step's noise is as large as x_0's, so exploration is credited)"""
    action_chunk: int = 1
    """C, env steps per policy call (one MDP step)"""
    # Environment
    env: str = "target"
    """"target" (image + state task, target redrawn every episode) or any phyai_gym.make_env name"""
    num_targets: int = 2
    """target task: number of possible targets (best constant action succeeds ~1/k)"""
    episode_length: int = 1
    """target task: steps before truncation"""
    image_size: int | None = None
    """rendered image side of a simulator env (None: the env's own; e.g. 32 keeps MuJoCo Warp cheap on the CPU)"""
    cameras: str | None = None
    """MuJoCo Warp envs: the cameras to render, comma-separated ("image" or "image,wrist_image"; None: both)"""
    reward_mode: str | None = None
    """MuJoCo Warp envs: "sparse" (1 at success: RL on success, as RLinf trains VLAs) or "normalized_dense" (None:
    the env's, dense; success ends an episode, so the dense reward pays more for hovering near success)"""
    num_envs: int = 32
    """N, parallel envs (per rank under torchrun: G ranks step G*N envs)"""
    num_steps: int = 2
    """T, policy calls per env per rollout"""
    # Algorithm
    total_iterations: int = 20
    """PPO iterations (rollout + update + weight sync)"""
    learning_rate: float | None = None
    """Adam learning rate of the policy (default: 3e-3 for the tiny config; 5e-6, RLinf's PI0.5 actor rate, for the
    base config and checkpoints: at 2e-5 the base expert's updates leave the trust region, docs/rl.md)"""
    value_lr: float | None = None
    """Adam learning rate of the value head (default: --learning-rate for the tiny config; 1e-4, RLinf's value_lr,
    for the base config and checkpoints: at the actor's 5e-6 the head's output moves too little to fit returns)"""
    logprob_reduction: str = "element"
    """granularity of the PPO ratio (RLinf's logprob_type; docs/rl.md): "element" (one clipped ratio per C x A
    Gaussian element), "action" (per executed action, summed over A), "sum" (one per sample: the chunk's likelihood
    ratio), "mean" (one per sample, the mean element log-ratio)"""
    anneal_lr: bool = False
    """linearly anneal the learning rate to 0"""
    gamma: float = 0.99
    """discount per chunk"""
    gae_lambda: float = 0.95
    """GAE lambda"""
    num_minibatches: int = 2
    """minibatches per epoch (under torchrun each rank shuffles its own samples: a minibatch is stratified by rank)"""
    micro_batch_size: int | None = None
    """samples per forward and backward within a minibatch (None: the whole minibatch at once); the micro-batches'
    gradients add up to the minibatch's, so the update is the same (up to float summation order) in less memory.
    Must divide the minibatch size (per rank under torchrun)"""
    update_epochs: int = 4
    """epochs over each rollout"""
    norm_adv: bool = True
    """normalise advantages per minibatch (GAE's; --group-size's advantages are normalised per group)"""
    group_size: int = 1
    """G > 1: group-relative advantages (GRPO's) instead of GAE's: every rollout starts from a reset in which each G
    consecutive envs share one state (an env seed) and draw their own noise; a chunk's advantage is its env's
    first-episode return minus its group's mean, over the group's std, shared by that episode's chunks, and 0 after
    it (`ppo_math.group_advantages`); the critic still trains, the advantages do not use it. N must be a multiple of
    G and T x C must cover an episode; the curve's group_signal is the share of groups whose envs ended differently
    (over every rank's groups under torchrun). 1: GAE"""
    norm_reward: bool = False
    """divide rewards by the running std of the discounted return (cleanrl's NormalizeReward): with dense rewards
    (MuJoCo) returns are tens, and value clipping lets a value move only --clip-coef per iteration (docs/rl.md)"""
    clip_coef: float = 0.2
    """surrogate clipping coefficient"""
    clip_vloss: bool = True
    """clip the value loss around the rollout values"""
    ent_coef: float = 0.0
    """entropy bonus (non-zero only for the learned-noise method)"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float = 0.5
    """gradient norm clip"""
    target_kl: float | None = None
    """end an update before the first minibatch step whose approx-KL (the weights so far against the rollout's, on
    that minibatch) is above this (one host sync a minibatch). Default: none for the tiny config (every epoch runs);
    0.1 for the base config and checkpoints, twice the health bound, so an iteration whose KL runs away stops there
    (Spinning Up's PPO stops at 1.5 x its target; docs/rl.md); inf: every epoch runs"""
    # Reporting
    eval_episodes: int = 256
    """episodes of the final success-rate measurement (stochastic and deterministic); 0 skips it"""
    csv: str | None = "ppo_curve.csv"
    """learning curve CSV, one row flushed per iteration (rank 0 writes it); the plot goes next to it as .png; an
    existing file is kept as <stem>.<k>.csv, never appended to (none: do not write)"""
    quiet: bool = False
    """no per-iteration line"""
    tensorboard: bool = False
    """also log every row to TensorBoard, cleanrl's tags (in <run-dir>/tensorboard, else runs/<csv stem> next to
    the CSV); needs the tensorboard package (pip install tensorboard)"""
    # Run folder: checkpoints and resume (phyai_gym.train.training_state)
    run_dir: str | None = None
    """a folder for the run: args.json, curve.csv and its plot (instead of --csv), checkpoints/ in LeRobot's layout
    (each checkpoints/<iteration>/pretrained_model loads with make_policy and phyai-gym eval --checkpoint), and
    tensorboard/"""
    save_every: int = 0
    """write a checkpoint every K iterations (needs --run-dir; 0: only after the last iteration)"""
    keep_checkpoints: int = 2
    """keep the newest K checkpoints, delete older ones (0: keep all; a base-config checkpoint is about 12 GB)"""
    resume: str | None = None
    """a run folder: continue it from its last checkpoint (weights, float32 masters, optimizer, RNG, iteration) with
    the flags it was started with; only --total-iterations, --save-every, --keep-checkpoints, --eval-episodes,
    --quiet, --tensorboard, --threads, --dist-timeout and --trainer-cuda-graphs may change"""
    reset_every_iteration: bool = False
    """start every rollout from a seeded reset of all envs (RLinf's LIBERO setting; episodes never cross an
    iteration); a resumed run is then bitwise the straight run, while without it the resumed run resets its envs
    once and the episodes in progress at the checkpoint restart"""
    # torchrun
    dist_timeout: float = 300.0
    """torchrun runs: seconds that joining the group and every collective wait for the other ranks, after which
    this rank exits with an error naming the collective (a rank that died or hung)"""

    # Derived in __post_init__ (STYLE item 2).
    batch_size: int = field(default=0, init=False)
    """T * N samples per iteration (per rank under torchrun)"""
    minibatch_size: int = field(default=0, init=False)
    """batch_size // num_minibatches"""

    def __post_init__(self) -> None:
        tiny = self.config in SMALL_CONFIGS and self.checkpoint is None
        if self.learning_rate is None:
            self.learning_rate = 3e-3 if tiny else 5e-6
        if self.value_lr is None:
            self.value_lr = self.learning_rate if tiny else 1e-4
        if self.target_kl is None and not tiny:
            self.target_kl = 0.1
        if self.logprob_reduction not in LOGPROB_REDUCTIONS:
            raise ValueError(f"--logprob-reduction: expected one of {', '.join(LOGPROB_REDUCTIONS)}, got "
                             f"{self.logprob_reduction!r}. Fix: pass e.g. --logprob-reduction element.")  # fmt: skip
        self.batch_size = self.num_envs * self.num_steps
        self.minibatch_size = self.batch_size // self.num_minibatches
        if self.minibatch_size < 1:
            raise ValueError(f"num_minibatches ({self.num_minibatches}) > batch_size ({self.batch_size}).")
        if self.micro_batch_size is not None and not (
            0 < self.micro_batch_size <= self.minibatch_size and self.minibatch_size % self.micro_batch_size == 0
        ):
            raise ValueError(f"--micro-batch-size: expected a divisor of the minibatch size {self.minibatch_size} "
                             f"(num_envs x num_steps / num_minibatches), got {self.micro_batch_size!r}. Fix: pass "
                             f"e.g. --micro-batch-size {max(1, self.minibatch_size // 2)}.")  # fmt: skip
        check_group_size(self.group_size, self.num_envs)
        if self.target_kl is not None and not self.target_kl > 0:
            raise ValueError(f"--target-kl: expected an approx-KL > 0, got {self.target_kl!r}. Fix: pass e.g. 0.5.")
        if self.save_every < 0 or (self.save_every and self.run_dir is None and self.resume is None):
            raise ValueError(f"--save-every: expected 0, or K > 0 with --run-dir, got {self.save_every!r} (run dir "
                             f"{self.run_dir!r}). Fix: pass --run-dir DIR.")  # fmt: skip
        if self.run_dir is not None:
            self.csv = str(Path(self.run_dir) / "curve.csv")
        if not self.dist_timeout > 0:
            raise ValueError(f"--dist-timeout: expected seconds > 0, got {self.dist_timeout!r}. Fix: pass e.g. 300.")


RESUMABLE_CHANGES = ("total_iterations", "save_every", "keep_checkpoints", "eval_episodes", "quiet", "tensorboard",
                     "threads", "dist_timeout", "trainer_cuda_graphs", "micro_batch_size")  # fmt: skip
"""The flags a resumed run may change; every other one is the run's own (its args.json)."""


def parse_args(argv: list[str] | None = None) -> Args:
    """Command-line flags, one per `Args` field (``--total-iterations 40``, ``--anneal-lr``, ``--no-joint``).

    With ``--resume DIR`` a flag left out takes the run's saved value, and a flag outside `RESUMABLE_CHANGES` that
    differs from it is refused.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_dataclass(Args, argv)
    if args.resume is None:
        return args
    saved = _saved_args(args.resume)
    given = {tok[2:].split("=")[0].removeprefix("no-").replace("-", "_") for tok in argv if tok.startswith("--")}
    for name in given - {"resume", *RESUMABLE_CHANGES}:
        if name in saved and getattr(args, name) != saved[name]:
            raise ValueError(
                f"--{name.replace('_', '-')}: a resumed run keeps its own flags; {args.resume}/args.json has "
                f"{saved[name]!r}, got {getattr(args, name)!r}. Fix: drop the flag (only "
                f"{', '.join('--' + n.replace('_', '-') for n in RESUMABLE_CHANGES)} may change)."
            )
    kept = {name: saved[name] for name in RESUMABLE_CHANGES if name not in given and name in saved}
    return resumed_args(replace(args, **kept))


def _saved_args(run_dir: str) -> dict:
    """The `Args` fields a run folder was started with (its args.json)."""
    file = Path(run_dir) / "args.json"
    if not file.is_file():
        raise FileNotFoundError(f"--resume: {str(file)!r} does not exist. Fix: pass a folder written by --run-dir.")
    return json.loads(file.read_text())


def resumed_args(args: Args) -> Args:
    """The run's saved flags, with `RESUMABLE_CHANGES` (and the run folder) taken from `args`."""
    saved = _saved_args(args.resume)
    init = {f.name for f in fields(Args) if f.init}
    kept = {k: v for k, v in saved.items() if k in init and k not in RESUMABLE_CHANGES}
    return Args(**{**kept, **{k: getattr(args, k) for k in RESUMABLE_CHANGES}, "run_dir": args.resume,
                   "resume": args.resume})  # fmt: skip


def prepare_run_dir(args: Args, rank: int) -> Path | None:
    """The checkpoint to resume from (None: a fresh run); a fresh run's folder gets its args.json.

    A fresh run refuses a folder that already holds checkpoints (resume it, or pick another folder).
    """
    if args.run_dir is None:
        return None
    run = Path(args.run_dir)
    last = latest_checkpoint(run)
    if args.resume is not None:
        if last is None:
            raise FileNotFoundError(f"--resume: {str(run)!r} has no checkpoint yet (checkpoints/last). Fix: start "
                                    "it again with --run-dir, or resume a run that saved one.")  # fmt: skip
        return last
    if last is not None or (run / "checkpoints").exists():
        raise FileExistsError(f"--run-dir: {str(run)!r} already holds a run's checkpoints. Fix: pass --resume "
                              f"{run} to continue it, or another --run-dir.")  # fmt: skip
    if rank == 0:
        run.mkdir(parents=True, exist_ok=True)
        saved = {f.name: getattr(args, f.name) for f in fields(Args) if f.init}
        (run / "args.json").write_text(json.dumps(saved, indent=2) + "\n")
    return None


def save_policy(policy, folder: Path) -> None:
    """The policy in the LeRobot layout; its rollout settings without the trainer-only prefix copies."""
    policy.save_pretrained(folder)
    settings = json.loads((folder / "policy_config.json").read_text())
    settings["rollout"]["keep_prefix"] = False  # a copy of the prefix K/V per sample is the PPO trainer's business
    (folder / "policy_config.json").write_text(json.dumps(settings, indent=2) + "\n")


def train(args: Args) -> dict:
    """Runs PPO; returns the learning curve (one dict per iteration) and the final success rates.

    The curve CSV and its plot are written on the way out, also when the loop is interrupted (Ctrl-C).
    Under torchrun every rank runs this; rank 0 writes the curve and prints, every rank returns the same curve.
    """
    if args.resume is not None:
        args = resumed_args(args)
    group = ProcessGroup.from_env(args.device, timeout_s=args.dist_timeout)  # None: not launched by torchrun
    rank = 0 if group is None else group.rank
    ranks = "" if group is None else f", {group.world_size} ranks"
    title = f"PPO, {args.config} PI0.5, {args.env}, {args.device}{ranks}"
    resume_from = prepare_run_dir(args, rank)
    tensorboard = None
    if args.tensorboard and rank == 0:
        csv_path = Path(args.csv or "ppo_curve.csv")
        tensorboard = Path(args.run_dir) / "tensorboard" if args.run_dir else csv_path.parent / "runs" / csv_path.stem
    resume_after = None if resume_from is None else int(resume_from.name)
    curves = CurveLog(args.csv if rank == 0 else None, args.total_iterations, title=title, resume_after=resume_after,
                      tensorboard=tensorboard)  # fmt: skip
    try:
        return _train(args, curves, group, resume_from)
    finally:
        files = curves.close()
        done = f"{len(curves.rows)}/{args.total_iterations} iterations"
        kept = "" if curves.kept is None else f" (the earlier curve is kept as {curves.kept})"
        if rank == 0:
            why = "--csv none" if args.csv is None else "no iteration finished"
            written = ", ".join(map(str, files)) + kept if files else f"not written ({why})"
            print(f"curve ({done}): {written}")
        if group is not None:
            group.close()


def _train(args: Args, curves: CurveLog, group: ProcessGroup | None, resume_from: Path | None = None) -> dict:
    rank, world = (0, 1) if group is None else (group.rank, group.world_size)
    random.seed(args.seed)
    np.random.seed(args.seed + rank)  # the minibatch shuffle: each rank shuffles its own samples
    torch.manual_seed(args.seed)  # the same weights on every rank
    tiny = args.config in SMALL_CONFIGS and args.checkpoint is None
    threads = configure_threads(args.threads, device=args.device, small_model=tiny)
    verbose = not args.quiet and rank == 0
    if verbose:
        print(threads)
    device_name = args.device if group is None else str(group.device)  # torchrun: cuda:LOCAL_RANK on a GPU
    device = torch.device(device_name)
    env_offset = rank * args.num_envs  # global id of this rank's env 0: its seeds and noise streams follow

    # ---- env setup ---------------------------------------------------------------------------------
    env_kwargs = (
        {"num_targets": args.num_targets, "episode_length": args.episode_length} if args.env == "target" else {}
    )
    if args.image_size is not None:
        env_kwargs["image_size"] = args.image_size
    if args.cameras is not None:
        env_kwargs["cameras"] = tuple(c.strip() for c in args.cameras.split(",") if c.strip())
    if args.reward_mode is not None:
        env_kwargs["reward_mode"] = args.reward_mode
    raw_env = make_env(args.env, args.num_envs, **env_kwargs)
    action_dim = int(raw_env.single_action_space.shape[0])

    # ---- policy setup: ROLLOUT policy (graphs on GPU) and TRAINER copy (eager) ----------------------
    rollout_cfg = RolloutConfig(
        method=args.method,
        num_steps=args.denoise_steps,
        joint=args.joint,
        noise_level=args.noise_level,
        action_chunk=args.action_chunk,
        trainable=args.trainable,
        keep_prefix=args.trainable == "expert" and args.trainer_dtype is None,  # the update reuses the prefix K/V
    )
    policy_kwargs = dict(
        preset=args.preset, config=args.config, action_dim=action_dim, device=device_name, seed=args.seed,
        rollout=rollout_cfg, max_batch_size=args.num_envs,
    )  # fmt: skip
    if args.checkpoint is None:
        policy_kwargs["prompt_format"] = "state"  # the state (the target) enters the prompt as bins
    policy = make_policy(args.checkpoint, **policy_kwargs)
    trainer_kwargs = {**policy_kwargs, "max_batch_size": args.minibatch_size, "cuda_graphs": False}
    if args.trainer_dtype is not None:
        trainer_kwargs["dtype"] = args.trainer_dtype
    trainer = make_policy(args.checkpoint, **trainer_kwargs)
    if group is not None:  # identical trainable weights on every rank (the frozen rest: the same seed / checkpoint)
        with torch.no_grad():
            group.broadcast([p for _, p in trainer.trainable_parameters()], "the initial weight broadcast")
    policy.sync_weights(trainer.model, expected="all")  # start from identical weights (version 1)
    if rollout_cfg.keep_prefix:
        trainer.model.share_prefix(policy.model)  # the frozen prefix: one copy of its weights, the rollout's
    master = MasterWeights(p for _, p in trainer.trainable_parameters())  # float32 weights the optimizer steps
    names = [name for name, p in trainer.trainable_parameters() if p.requires_grad]  # master.parameters()' order
    groups = [[m for n, m in zip(names, master.parameters()) if n.startswith("value_head.") == critic]
              for critic in (False, True)]  # fmt: skip
    optimizer = torch.optim.Adam(
        [{"params": groups[0], "lr": args.learning_rate}, {"params": groups[1], "lr": args.value_lr}], eps=1e-5
    )
    grad_mean = None if group is None else GradientMean(group)  # DDP's mean, on the float32 master gradients
    state = TrainingState(list(zip(names, master.parameters())), optimizer)  # what a checkpoint restores
    reward_norm = RewardNormalizer(args.num_envs, args.gamma, device=device) if args.norm_reward else None
    start, global_step = 1, 0
    if resume_from is not None:  # masters, optimizer and RNG streams as saved; the rollout gets the weights
        step = state.load(resume_from)
        master.masters_to_model()
        policy.begin_weight_update("all")
        policy.update_weights(trainer.model)
        policy.finish_weight_update(version=step["weight_version"])
        start, global_step = step["iteration"] + 1, step["global_step"]
        if reward_norm is not None:
            reward_norm.load_state_dict(step["reward_norm"])
    envs = PolicyVectorEnv(raw_env, policy, action_chunk=args.action_chunk)

    # ---- storage: (T, N) scalars preallocated; the T calls' samples (inputs, chains, prefix K/V) ----------
    T, N = args.num_steps, args.num_envs  # noqa: N806  (the math's names)
    C, A = args.action_chunk, action_dim  # noqa: N806
    log_probs = torch.zeros((T, N, C, A), device=device)  # element log-probs: the ratio's granularity is chosen later
    rewards = torch.zeros((T, N), device=device)
    dones = torch.zeros((T, N), device=device)
    values = torch.zeros((T, N), device=device)

    # ---- start the game ----------------------------------------------------------------------------
    start_time = time.perf_counter()
    obs = None
    times = {"rollout": 0.0, "train": 0.0, "sync": 0.0}
    kl_stop = args.target_kl is not None and np.isfinite(args.target_kl)  # inf: no stop, no host sync
    for iteration in range(start, args.total_iterations + 1):
        run_seed = args.seed + (iteration - 1) * world * N  # fresh every iteration; env i of all ranks': + i
        seed = run_seed + env_offset  # this rank's env 0
        if args.group_size > 1:  # G envs a state: grouped env seeds, every env its own noise stream
            obs, _ = envs.reset(**grouped_reset_seeds(run_seed, N, args.group_size, env_offset))
        elif obs is None or args.reset_every_iteration:
            obs, _ = envs.reset(seed=seed)
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.total_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate
            optimizer.param_groups[1]["lr"] = frac * args.value_lr

        # ---- rollout: T chunks per env with the rollout policy ---------------------------------------
        t0 = time.perf_counter()
        returns_done, successes, samples = [], [], []
        first_episodes = FirstEpisodes(T, N)  # --group-size: each env's first episode, its chunks and return
        with torch.no_grad():
            for step in range(T):
                obs, reward, terminated, truncated, infos = envs.step()  # the policy acts on `obs`
                out = envs.last_output
                global_step += world * N * args.action_chunk
                log_probs[step] = out.log_prob_elements
                values[step] = out.values
                samples.append(RolloutBatch.from_output(out))
                # bootstrap truncations with V(final obs): r + gamma * V(s_T), then treat the step as done
                final_value = infos["policy"]["final_value"].to(device)
                trunc = torch.as_tensor(truncated, device=device) & ~torch.as_tensor(terminated, device=device)
                dones[step] = torch.as_tensor(terminated | truncated, device=device).float()
                reward = torch.as_tensor(reward, device=device).float()
                if reward_norm is not None:  # scaled by the running std of the discounted return
                    reward = reward_norm(reward, dones[step])
                rewards[step] = reward + args.gamma * final_value * trunc
                if "episode" in infos:
                    ended, episode_returns = _numpy(infos["_episode"]), _numpy(infos["episode"]["r"])
                    returns_done += episode_returns[ended].tolist()
                    first_episodes.record(step, ended, episode_returns)
                    successes += _numpy(infos["episode"]["success_once"])[ended].tolist()
            next_value = policy.value(obs).to(device)  # V(s_T) for the unfinished envs

            # ---- GAE over chunk steps (the explicit backward loop: ppo_math.gae) -------------------------
            advantages, returns = gae(rewards, values, dones, next_value, gamma=args.gamma, gae_lambda=args.gae_lambda)
            if args.group_size > 1:
                advantages = first_episodes.advantages(args.group_size, device, env_steps=T * C)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times["rollout"] += (t_rollout := time.perf_counter() - t0)

        # ---- flatten the batch (step-major, as the (T, N) tensors) -------------------------------------
        b_log_probs, b_values = log_probs.reshape(-1, C, A), values.reshape(-1)
        b_advantages, b_returns = advantages.reshape(-1), returns.reshape(-1)
        b_samples = RolloutBatch.cat(samples)

        # ---- optimise policy and value network (the trainer copy) ------------------------------------
        t0 = time.perf_counter()
        clipfracs, kls, chunk_kls, steps = [], [], [], 0  # per minibatch; optimizer steps taken
        pg_loss = v_loss = torch.full((), float("nan"))  # an update stopped before its first step
        micro = args.micro_batch_size or args.minibatch_size
        share = micro / args.minibatch_size  # of the minibatch's mean loss and statistics, per micro-batch
        what = f"the minibatch statistics all-reduce (iteration {iteration})"
        for mb_idx in shuffled_minibatches(args.batch_size, args.update_epochs, args.minibatch_size):
            mb = torch.as_tensor(mb_idx, device=device)
            mb_adv = b_advantages[mb]
            if args.norm_adv and args.group_size == 1:  # over every rank's share of the minibatch
                adv_mean, adv_std = advantage_stats(mb_adv, group, what)
                mb_adv = (mb_adv - adv_mean) / (adv_std + 1e-8)
            # forward and backward per micro-batch: their gradients add up to the minibatch's mean loss's
            optimizer.zero_grad()
            stats, mb_pg, mb_v = 0.0, 0.0, 0.0  # (approx-KL, chunk approx-KL, clip fraction), losses
            for part, part_adv in zip(mb.split(micro), mb_adv.split(micro), strict=True):
                try:
                    # differentiable log-probs and values (on a GPU: forward and backward replayed as CUDA graphs)
                    new = trainer.evaluate(b_samples.select(part), cuda_graphs=args.trainer_cuda_graphs)
                    # (B, G) log-ratios: G = 1 (sum, mean), C (action) or C x A (element) clipped ratios per sample
                    part_log_ratio = log_ratio(new.log_prob_elements, b_log_probs[part], args.logprob_reduction)
                    with torch.no_grad():
                        chunk_log_ratio = (new.log_prob_elements - b_log_probs[part]).sum(dim=(1, 2))  # whole chunk
                        part_kl, part_clipfrac = ratio_stats(part_log_ratio, args.clip_coef)  # no host sync
                        stats = stats + torch.stack([part_kl, ratio_stats(chunk_log_ratio, args.clip_coef)[0],
                                                     part_clipfrac]) * share  # fmt: skip
                    # clipped surrogate (every ratio with its sample's advantage) and clipped value loss
                    pg, v = clipped_losses(part_log_ratio, new.values, b_values[part], part_adv, b_returns[part],
                                           clip_coef=args.clip_coef, clip_vloss=args.clip_vloss)  # fmt: skip
                    ((pg - args.ent_coef * new.entropy.mean() + v * args.vf_coef) * share).backward()
                except torch.OutOfMemoryError as error:
                    raise torch.OutOfMemoryError(f"{error}\n{out_of_memory_fix(micro, args.minibatch_size)}") from error
                master.grads_to_masters(accumulate=True)  # summed in float32 on the masters
                mb_pg, mb_v = mb_pg + pg.detach() * share, mb_v + v.detach() * share
            if group is not None:  # every rank's share of the minibatch is the same size: the mean of the means
                stats = group.all_reduce_sum(stats, what) / group.world_size
            approx_kl, chunk_kl, clipfrac = stats
            clipfracs.append(clipfrac)
            kls.append(approx_kl)
            chunk_kls.append(chunk_kl)
            if kl_stop and approx_kl.item() > args.target_kl:  # this minibatch's gradients are not applied
                break
            pg_loss, v_loss = mb_pg, mb_v
            if grad_mean is not None:  # their mean over the ranks: every rank takes the same step
                grad_mean(master.parameters(), f"the gradient all-reduce (iteration {iteration})")
            torch.nn.utils.clip_grad_norm_(master.parameters(), args.max_grad_norm)
            optimizer.step()
            steps += 1
            master.masters_to_model()  # the trainer computes with the updated weights, rounded
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times["train"] += (t_train := time.perf_counter() - t0)

        # ---- weight sync: trainer -> rollout policy (in place, graphs stay valid) --------------------
        t0 = time.perf_counter()
        report = policy.sync_weights(trainer.model)
        times["sync"] += (t_sync := time.perf_counter() - t0)

        y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
        var_y = np.var(y_true)
        explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
        row = {
            "iteration": iteration,
            "global_step": global_step,
            "success_rate": float(np.mean(successes)) if successes else float("nan"),
            "episodic_return": float(np.mean(returns_done)) if returns_done else float("nan"),
            "episodes": len(successes),
            "pg_loss": pg_loss.item(),
            "v_loss": v_loss.item(),
            "approx_kl": float(kls[-1]),
            "approx_kl_first": float(kls[0]),
            "approx_kl_max": float(torch.stack(kls).max()),
            "approx_kl_mean": float(torch.stack(kls).mean()),
            "approx_kl_chunk": float(torch.stack(chunk_kls).mean()),  # of the whole chunk, whatever the granularity
            "update_steps": steps,
            "clipfrac": float(torch.stack(clipfracs).mean()),
            "explained_variance": float(explained_var),
            # --group-size: the share of groups whose envs' outcomes differ (the others give no gradient)
            "group_signal": first_episodes.signal(args.group_size) if args.group_size > 1 else float("nan"),
            "sps": global_step / (time.perf_counter() - start_time),
            "time_rollout": t_rollout,
            "time_train": t_train,
            "time_sync": t_sync,
            "weight_version": report.version,
        }
        if group is not None:  # the same row on every rank: over all ranks' episodes and samples
            row.update(global_metrics(group, iteration, successes, returns_done, row, y_pred, y_true))
        curves.log(row)
        if verbose:
            print(
                f"{curves.progress(iteration)} | step {global_step:6d} success {row['success_rate']:.2f} "
                f"return {row['episodic_return']:+.3f} kl {row['approx_kl']:.4f} "
                f"(before any step {row['approx_kl_first']:.1e}: rollout vs trainer rounding, 0 in fp32) "
                f"clipfrac {row['clipfrac']:.2f} ev {row['explained_variance']:+.2f} SPS {row['sps']:.0f} | "
                f"rollout {t_rollout:.2f}s train {t_train:.2f}s sync {t_sync * 1e3:.1f}ms v{report.version}",
                flush=True,
            )
        if (
            args.run_dir is not None
            and rank == 0
            and (iteration == args.total_iterations or (args.save_every and iteration % args.save_every == 0))
        ):
            counters = {"global_step": global_step, "weight_version": report.version}
            if reward_norm is not None:
                counters["reward_norm"] = reward_norm.state_dict()
            state.save(args.run_dir, iteration, counters, lambda folder: save_policy(policy, folder),
                       keep=args.keep_checkpoints)  # fmt: skip

    # ---- final success rates of the trained rollout policy ----------------------------------------
    final = {
        mode: success_rate(envs, args.eval_episodes, deterministic=mode == "deterministic",
                           seed=args.seed + 10_000 + env_offset, group=group)
        if args.eval_episodes > 0
        else float("nan")
        for mode in ("stochastic", "deterministic")
    }  # fmt: skip
    envs.close()
    total = sum(times.values())
    if rank == 0:
        success = (f"stochastic {final['stochastic']:.3f}, deterministic {final['deterministic']:.3f}"
                   if args.eval_episodes > 0 else "not measured (--eval-episodes 0)")  # fmt: skip
        split = (f"time split: rollout {times['rollout'] / total:.0%}, training {times['train'] / total:.0%}, "
                 f"weight sync {times['sync'] / total:.1%} of {total:.1f}s" if total > 0
                 else "no iteration ran (a resumed run already at --total-iterations)")  # fmt: skip
        print(f"final success: {success} | {split}")
    return {"curve": curves.rows, "final": final, "times": times, "trainer": trainer, "policy": policy}


def shuffled_minibatches(batch_size: int, epochs: int, minibatch_size: int):
    """The sample indices of every minibatch of every epoch, the batch reshuffled (in place) before each epoch."""
    b_idx = np.arange(batch_size)
    for _epoch in range(epochs):
        np.random.shuffle(b_idx)
        for start in range(0, batch_size, minibatch_size):
            yield b_idx[start : start + minibatch_size]


def out_of_memory_fix(micro: int, minibatch: int) -> str:
    """What to do when the update's forward and backward of `micro` samples ran the device out of memory."""
    smaller = [d for d in range(1, micro // 2 + 1) if minibatch % d == 0]
    if not smaller:
        return "The PPO update of one sample ran the device out of memory. Fix: a smaller policy or image size."
    return (f"The PPO update's forward and backward of {micro} samples at once ran the device out of memory. Fix: "
            f"pass --micro-batch-size {smaller[-1]} (the same update, the minibatch of {minibatch} in smaller parts).")


def advantage_stats(adv: torch.Tensor, group: ProcessGroup | None, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (unbiased) std of a minibatch's advantages, over every rank's share under torchrun (one all-reduce)."""
    if group is None:
        return adv.mean(), adv.std()
    a = adv.double()
    n, total, sumsq = group.all_reduce_sum(torch.stack([torch.ones_like(a).sum(), a.sum(), (a * a).sum()]), what)
    mean = total / n
    return mean.float(), ((sumsq - n * mean * mean).clamp(min=0.0) / (n - 1)).sqrt().float()


def global_metrics(
    group: ProcessGroup,
    iteration: int,
    successes: list[bool],
    returns_done: list[float],
    row: dict,
    y_pred: np.ndarray,
    y_true: np.ndarray,
) -> dict:
    """The iteration's row entries over all ranks (approx-KL and clip fraction are global per minibatch already)."""
    what = f"the metrics all-reduce (iteration {iteration})"
    local = [len(successes), sum(successes), sum(returns_done), row["pg_loss"], row["v_loss"], row["group_signal"]]
    sums = group.all_reduce_sum(torch.tensor(local, dtype=torch.float64, device=group.device), what).tolist()
    episodes, wins, returns, pg_loss, v_loss, group_signal = sums
    values = torch.as_tensor(np.stack([y_pred, y_true]), device=group.device)
    y = group.all_gather(values, f"the value gather (iteration {iteration})").cpu().numpy()  # (G, 2, T*N)
    y_pred, y_true = y[:, 0].reshape(-1), y[:, 1].reshape(-1)
    var_y = np.var(y_true)
    return {
        "success_rate": wins / episodes if episodes else float("nan"),
        "episodic_return": returns / episodes if episodes else float("nan"),
        "episodes": int(episodes),
        "pg_loss": pg_loss / group.world_size,  # the mean of equal-sized minibatch means
        "v_loss": v_loss / group.world_size,
        "group_signal": group_signal / group.world_size,  # every rank has N / G groups (NaN stays NaN without them)
        "explained_variance": float("nan") if var_y == 0 else float(1 - np.var(y_true - y_pred) / var_y),
    }


def _numpy(value) -> np.ndarray:
    """An info leaf on the host (GPU simulators such as ManiSkill's report torch tensors on the device)."""
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


@torch.no_grad()
def success_rate(
    envs: PolicyVectorEnv, episodes: int, *, deterministic: bool, seed: int, group: ProcessGroup | None = None
) -> float:
    """Fraction of the first `episodes` finished episodes that succeeded (policy acting as in the rollout).

    Under torchrun `episodes` is the total: rank r takes the first ``episodes // G`` episodes (one more for r below
    ``episodes % G``) that its envs finish -- the caller seeds them as envs r*N.. of one run, so every episode has
    its own seed -- and the outcomes of all ranks are gathered: none is repeated or lost.
    """
    world, rank = (1, 0) if group is None else (group.world_size, group.rank)
    share = episodes // world + (rank < episodes % world)
    previous, envs.deterministic = envs.deterministic, deterministic
    envs.reset(seed=seed)
    outcomes: list[bool] = []
    while len(outcomes) < share:
        _, _, _, _, infos = envs.step()
        if "episode" in infos:
            ended = _numpy(infos["_episode"])
            outcomes += _numpy(infos["episode"]["success_once"])[ended].tolist()
    envs.deterministic = previous
    outcomes = outcomes[:share]
    if group is not None:  # pad every share to the largest with -1, gather, drop the padding
        padded = torch.full((-(-episodes // world),), -1.0, device=group.device)
        padded[:share] = torch.tensor(outcomes, dtype=torch.float32)
        mode = "deterministic" if deterministic else "stochastic"
        gathered = group.all_gather(padded, f"the final evaluation's gather ({mode})")
        outcomes = gathered[gathered >= 0].tolist()
    return float(np.mean(outcomes))


if __name__ == "__main__":
    try:
        train(parse_args())
    except KeyboardInterrupt:
        print("interrupted: the curve so far and its plot are written (above)")
        raise SystemExit(130) from None
