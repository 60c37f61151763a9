"""Behaviour cloning (SFT) of PI0.5 from scripted demonstrations, with PI0.5's own flow-matching loss.

Demonstrations are ManiSkill trajectory files (``trajectory.h5`` + ``.json``, `phyai_gym.train.demos` says why and gives
the layout): recorded here by an env's scripted expert (``--record-episodes``), or written by any other source, e.g. a
GPU simulator's pick-and-place planner, and passed as ``--demos``. Each step samples (episode, frame) pairs, takes
the observation at frame t and the demonstrated chunk a[t : t+H] (padded and masked past the episode's end), and
minimises ``|v(x_t, t) - (eps - a)|^2`` (`policies.pi05.flow_loss`). The result is a checkpoint folder in the
LeRobot layout that `make_policy`, ``phyai-gym eval --checkpoint`` and ``examples/ppo_pi05.py --checkpoint`` load:
SFT, then RL.

    python examples/sft_pi05.py --record-episodes 64                      # tiny PI0.5, target task, CPU
    python examples/sft_pi05.py --demos pick_cube.h5 --checkpoint DIR --preset P --device cuda --steps 2000
    python examples/ppo_pi05.py --checkpoint sft_out --env target         # RL from the SFT policy
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from phyai_gym.make import SMALL_CONFIGS, make_env, make_policy
from phyai_gym.threads import configure_threads
from phyai_gym.train.curves import CurveLog
from phyai_gym.train.dataclass_cli import parse_dataclass
from phyai_gym.train.demos import EXPERTS, ChunkSampler, read_demos, record_demos, write_demos
from phyai_gym.train.master_weights import MasterWeights
from policies.base import RolloutConfig
from policies.pi05.config import CAMERA_SLOTS
from policies.pi05.flow_loss import flow_matching_loss, sample_time
from policies.pi05.normalize import NormStats
from wrappers import PolicyVectorEnv


@dataclass
class Args:
    """Flow-matching behaviour cloning of PI0.5; every flag below is a field of this dataclass."""

    seed: int = 1
    """seed of the weights (random policies), the recording, the sampling of frames, noise and times"""
    threads: int | None = None
    """torch CPU threads (None: 1 for the tiny config on the CPU, torch's default otherwise)"""
    device: str = "cpu"
    """device of the policy"""
    # Policy
    config: str = "tiny"
    """"tiny", "small" or "base" (random weights, stand-in tokenizer) when --checkpoint is not given"""
    checkpoint: str | None = None
    """a PI0.5 checkpoint folder to fine-tune (its preset sets the prompt format and the action dims)"""
    preset: str | None = None
    """processor preset of the checkpoint"""
    trainable: str = "expert"
    """"expert" (action expert, projections, time MLP) or "all" (also the vision tower and the LM)"""
    # Demonstrations
    env: str = "target"
    """the env of the demonstrations (its scripted expert records them; the final evaluation runs in it)"""
    num_targets: int = 2
    """target task: number of possible targets"""
    episode_length: int = 1
    """target task: steps before the episode ends"""
    image_size: int | None = None
    """rendered image side of a simulator env (None: the env's own; e.g. 32 keeps MuJoCo Warp cheap on the CPU)"""
    cameras: str | None = None
    """MuJoCo Warp envs: the cameras to render, comma-separated ("image" or "image,wrist_image"; None: both); a new
    policy reads them, in this order, through the model's camera slots (without the flag: "image" only)"""
    demos: str = "demos/target.h5"
    """the demonstrations, a ManiSkill trajectory .h5 (with its .json sidecar)"""
    record_episodes: int = 0
    """record this many episodes with the env's scripted expert into --demos first (0: read --demos as it is)"""
    record_envs: int = 16
    """parallel envs while recording (and in the final evaluation)"""
    norm_stats: bool = True
    """a new policy normalises state and actions with the demos' statistics (quantile mode: q01..q99 -> [-1, 1]),
    as openpi computes them before training; without them the state's 256 prompt bins span [-1, 1] in raw units"""
    demo_noise: float = 0.0
    """recording: std of Gaussian noise added to the executed expert actions, the demos keeping the clean ones
    (DART): the demos then show corrections of the small errors a cloned policy makes"""
    # Rollout settings saved with the checkpoint (random policies; a --checkpoint keeps its own)
    action_chunk: int = 1
    """C, env steps per policy call when the checkpoint acts (eval, PPO); at most the model's horizon"""
    denoise_steps: int = 5
    """K, Euler denoise steps when the checkpoint acts"""
    # Optimisation (LeRobot's / openpi's PI0.5 fine-tuning: AdamW, betas (0.9, 0.95), weight decay 0.01, clip 1.0)
    steps: int = 100
    """optimizer steps"""
    batch_size: int = 32
    """(episode, frame) samples per step"""
    learning_rate: float | None = None
    """AdamW learning rate (default: 1e-3 for the tiny and small configs; 2.5e-5, openpi's PI0.5 rate, otherwise)"""
    lr_schedule: str = "constant"
    """"cosine" (the rate falls along a cosine to a tenth of --learning-rate at the last step, openpi's
    peak-to-end ratio) or "constant" """
    weight_decay: float = 0.01
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient norm clip"""
    # Reporting
    log_every: int = 10
    """steps per CSV row (the mean training loss since the last row, and the fixed-batch loss)"""
    csv: str | None = "sft_curve.csv"
    """loss curve CSV (none: do not write)"""
    out: str | None = "sft_out"
    """the fine-tuned checkpoint folder (LeRobot layout; none: not written)"""
    eval_episodes: int = 64
    """episodes of the final deterministic success rate in --env (0 skips it)"""
    quiet: bool = False
    """no per-row line"""

    # Derived in __post_init__ (STYLE item 2).
    env_kwargs: dict = field(default_factory=dict, init=False)
    """keyword arguments of make_env"""

    def __post_init__(self) -> None:
        if self.learning_rate is None:
            self.learning_rate = 1e-3 if self.config in SMALL_CONFIGS and self.checkpoint is None else 2.5e-5
        if self.lr_schedule not in ("cosine", "constant"):
            raise ValueError(f"--lr-schedule: expected 'cosine' or 'constant', got {self.lr_schedule!r}.")
        if self.trainable not in ("expert", "all"):
            raise ValueError(f"--trainable: expected 'expert' or 'all', got {self.trainable!r}.")
        if self.record_episodes and self.env not in EXPERTS:
            raise ValueError(
                f"--record-episodes: env {self.env!r} has no scripted expert here (known: {', '.join(EXPERTS)}). "
                "Fix: record its demos with its own expert and pass --demos."
            )
        if self.env == "target":
            self.env_kwargs = {"num_targets": self.num_targets, "episode_length": self.episode_length}
        if self.image_size is not None:
            self.env_kwargs["image_size"] = self.image_size
        if self.cameras is not None:
            self.env_kwargs["cameras"] = tuple(c.strip() for c in self.cameras.split(",") if c.strip())


def train(args: Args) -> dict:
    """Records (if asked) and fits the demonstrations; returns the loss curve, the policy and the success rate."""
    torch.manual_seed(args.seed)
    tiny = args.config in SMALL_CONFIGS and args.checkpoint is None
    threads = configure_threads(args.threads, device=args.device, small_model=tiny)
    if not args.quiet:
        print(threads)
    if args.record_episodes:
        envs = make_env(args.env, args.record_envs, **args.env_kwargs)
        episodes = record_demos(envs, EXPERTS[args.env](envs), args.record_episodes, seed=args.seed,
                                noise=args.demo_noise)
        envs.close()
        write_demos(args.demos, episodes, {"env_id": args.env, "env_kwargs": args.env_kwargs})
        if not args.quiet:
            wins = np.mean([e.success for e in episodes])
            print(f"recorded {len(episodes)} expert episodes (success {wins:.2f}) into {args.demos}")
    episodes = read_demos(args.demos)
    action_dim = int(episodes[0].actions.shape[1])

    # ---- the policy: processor, model, trainable subset, float32 masters ---------------------------------------
    kwargs = dict(preset=args.preset, config=args.config, action_dim=action_dim, device=args.device, seed=args.seed,
                  max_batch_size=args.batch_size, cuda_graphs=False)  # fmt: skip
    if args.checkpoint is None:
        kwargs["prompt_format"] = "state"  # the state enters the prompt as bins, as in examples/ppo_pi05.py
        kwargs["rollout"] = RolloutConfig(num_steps=args.denoise_steps, action_chunk=args.action_chunk)
        if args.norm_stats:
            kwargs["state_stats"] = NormStats.of(np.concatenate([e.state for e in episodes]))
            kwargs["action_stats"] = NormStats.of(np.concatenate([e.actions for e in episodes]))
        if "cameras" in args.env_kwargs:  # the rendered cameras fill the model's slots in order (wrist: a wrist slot)
            kwargs["camera_map"] = dict(zip(args.env_kwargs["cameras"], CAMERA_SLOTS))
    policy = make_policy(args.checkpoint, **kwargs)
    policy.set_trainable(args.trainable)
    model, processor = policy.model, policy.processor
    horizon, model_dim = model.config.action_horizon, model.config.action_dim
    master = MasterWeights(p for _, p in policy.trainable_parameters())
    optimizer = torch.optim.AdamW(master.parameters(), lr=args.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay)  # fmt: skip
    cosine = args.lr_schedule == "cosine"  # 1 at step 0, 0.1 at the last step
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.1 + 0.45 * (1 + math.cos(math.pi * step / max(1, args.steps))) if cosine else 1.0
    )
    sampler = ChunkSampler(episodes, horizon)
    rng, gen = np.random.default_rng(args.seed), torch.Generator().manual_seed(args.seed)

    def loss_of(rows: np.ndarray, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Mean flow-matching loss of the samples `rows` at the given noise (B, H, D) and times (B,)."""
        batch = sampler.batch(rows)
        inputs = processor(batch.obs)
        a = processor.action_normalizer.normalize(torch.as_tensor(batch.actions, device=args.device))  # (B, H, A)
        a = torch.nn.functional.pad(a, (0, model_dim - a.shape[-1]))  # zero-padded to the model's D
        mask = torch.as_tensor(batch.mask, device=args.device)
        train_prefix = args.trainable == "all"
        return flow_matching_loss(model, inputs, a, mask, noise, t, action_dim, train_prefix).mean()

    def draws(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(n, horizon, model_dim, generator=gen).to(args.device)
        return noise, sample_time(n, gen, args.device)

    # a fixed batch, noise and times: its loss before / during / after training is a like-for-like comparison
    fixed = (rng.integers(len(sampler), size=args.batch_size), *draws(args.batch_size))
    with torch.no_grad():
        fixed_loss_start = float(loss_of(*fixed))

    # ---- training ----------------------------------------------------------------------------------------------
    curves = CurveLog(args.csv, max(1, args.steps // max(1, args.log_every)), title=f"SFT, PI0.5 {args.config}")
    try:
        losses, start = [], time.perf_counter()
        for step in range(1, args.steps + 1):
            loss = loss_of(rng.integers(len(sampler), size=args.batch_size), *draws(args.batch_size))
            optimizer.zero_grad()
            loss.backward()
            master.grads_to_masters()
            torch.nn.utils.clip_grad_norm_(master.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            master.masters_to_model()
            losses.append(loss.item())
            if step % args.log_every == 0 or step == args.steps:
                with torch.no_grad():
                    fixed_loss = float(loss_of(*fixed))
                row = {"iteration": len(curves.rows) + 1, "step": step, "loss": float(np.mean(losses)),
                       "fixed_batch_loss": fixed_loss, "samples_per_s": step * args.batch_size /
                       (time.perf_counter() - start)}  # fmt: skip
                curves.log(row)
                losses = []
                if not args.quiet:
                    print(
                        f"step {step:5d} | loss {row['loss']:.4f} | fixed-batch loss {fixed_loss:.4f} "
                        f"(start {fixed_loss_start:.4f}) | {row['samples_per_s']:.0f} samples/s",
                        flush=True,
                    )
    finally:
        curves.close()

    # ---- the checkpoint, and how well it acts ---------------------------------------------------------------------
    result = {"curve": curves.rows, "fixed_loss_start": fixed_loss_start, "policy": policy}
    if args.out is not None:
        model.refresh_fused_weights()
        policy.save_pretrained(args.out)
        if not args.quiet:
            print(f"checkpoint: {args.out} (make_policy / phyai-gym eval --checkpoint / ppo_pi05.py --checkpoint)")
    if args.eval_episodes > 0:
        if args.out is None:
            raise ValueError("--eval-episodes: the evaluation acts with the saved checkpoint. Fix: pass --out DIR.")
        acting = make_policy(args.out, device=args.device, max_batch_size=args.record_envs)
        chunk = acting.rollout.action_chunk
        envs = PolicyVectorEnv(make_env(args.env, args.record_envs, **args.env_kwargs), acting, action_chunk=chunk)
        envs.deterministic = True
        result["success_rate"] = success_rate(envs, args.eval_episodes, seed=args.seed + 10_000)
        envs.close()
        if not args.quiet:
            print(f"SFT policy success (deterministic, {args.eval_episodes} episodes): {result['success_rate']:.3f}")
    return result


@torch.no_grad()
def success_rate(envs: PolicyVectorEnv, episodes: int, *, seed: int) -> float:
    """Fraction of the first `episodes` finished episodes that succeeded."""
    envs.reset(seed=seed)
    outcomes: list[bool] = []
    while len(outcomes) < episodes:
        _, _, _, _, infos = envs.step()
        if "episode" in infos:
            ended = np.asarray(infos["_episode"])
            outcomes += np.asarray(infos["episode"]["success_once"])[ended].tolist()
    return float(np.mean(outcomes[:episodes]))


if __name__ == "__main__":
    train(parse_dataclass(Args))
