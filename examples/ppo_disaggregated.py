"""Disaggregated PPO for PI0.5: trainer ranks apart from rollout ranks, under torchrun.

Ranks 0..T-1 train (`--trainer-ranks T`), ranks T..T+R-1 run N envs each with a rollout policy. One iteration:

1. every rollout rank collects T_steps x N samples, computes GAE with its own critic values (or, with
   `--group-size G`, group-relative advantages from G envs per start state: `phyai_gym.train.groups`) and sends
   the batch (`RolloutBatch` with the kept prefix K/V, advantages, returns, episode statistics) to its trainer
   (`phyai_gym.train.rollout_transport`: point-to-point tensors, no pickle); rollout rank T + i feeds trainer i % T;
2. each trainer runs the PPO epochs over the batches it received (T > 1: gradients averaged over the trainers);
3. trainer 0 broadcasts its trainable weights to every rank with `broadcast_weights` (one all-reduce vote):
   every rank commits the same version, or every rank aborts and keeps its weights.

`--overlap` (default): a rollout rank sends batch k, collects batch k+1 with the weights it has while the trainer
trains on batch k, and joins the broadcast at the iteration boundary, so rollout and training overlap and every
batch after the first is one update behind the weights it trains (policy lag 1; PPO's ratio and clipping are
computed against the rollout's own log-probs, so the lag is corrected as in any PPO epoch after the first).
`--no-overlap`: synchronous and on-policy (rollout ranks wait for the new weights before collecting).

An aborted weight sync (a NaN in the trainer's weights, a refused tensor, a dead rank) stops the run cleanly:
every rank keeps the last committed version, reports the abort and returns; the process exits with status 1.
Every collective has the process group's timeout (`--timeout-s`), so no rank waits forever.

    torchrun --nproc_per_node 3 examples/ppo_disaggregated.py                    # 1 trainer + 2 rollout ranks, CPU
    torchrun --nproc_per_node 5 examples/ppo_disaggregated.py --trainer-ranks 1 --device cuda   # 1 + 4 GPUs
    torchrun --nnodes 2 --nproc_per_node 8 --node_rank 0 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        examples/ppo_disaggregated.py --trainer-ranks 2 --device cuda           # 2 trainers + 14 rollout ranks
"""

from __future__ import annotations

import datetime
import hashlib
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from phyai_gym.make import SMALL_CONFIGS, make_env, make_policy
from phyai_gym.threads import configure_threads
from phyai_gym.train.dataclass_cli import parse_dataclass
from phyai_gym.train.distributed import average_gradients_
from phyai_gym.train.groups import FirstEpisodes, check_group_size, grouped_reset_seeds
from phyai_gym.train.master_weights import MasterWeights
from phyai_gym.train.ppo_math import gae, ppo_loss
from phyai_gym.train.rollout_transport import recv_rollout, send_rollout
from policies.pi05.batch import RolloutBatch
from policies.pi05.broadcast import broadcast_weights
from policies.pi05.policy import Pi05Policy, RolloutConfig
from policies.pi05.weight_sync import WeightSyncError
from wrappers import PolicyVectorEnv


@dataclass
class Args:
    """Disaggregated PPO for PI0.5 (cleanrl style); every flag below is a field of this dataclass."""

    seed: int = 1
    """seed of the weights (random policies), the envs (plus 1000 x rollout index) and the minibatch shuffle"""
    threads: int | None = None
    """torch CPU threads per rank (None: 1 for the tiny config on the CPU, torch's default otherwise)"""
    device: str = "cpu"
    """"cpu" (gloo) or "cuda" (NCCL, each rank on cuda:LOCAL_RANK)"""
    trainer_ranks: int = 1
    """T, ranks 0..T-1 train; the other ranks roll out (their number must be a multiple of T)"""
    overlap: bool = True
    """rollout ranks collect the next batch with the old weights while the trainers train (policy lag 1)"""
    timeout_s: float = 600.0
    """process-group timeout: a collective waiting longer fails (a dead or stuck rank) instead of hanging"""
    # Policy
    config: str = "tiny"
    """"tiny", "small" or "base" (random weights, stand-in tokenizer) when --checkpoint is not given"""
    checkpoint: str | None = None
    """a PI0.5 checkpoint folder, readable on every rank"""
    preset: str | None = None
    """processor preset of the checkpoint"""
    trainable: str = "expert"
    """"expert" (the rollout keeps its prefix K/V and sends it) or "all" """
    method: str = "sde"
    """rollout noise: "sde" (flow-SDE) or "noise" (learned noise head)"""
    joint: bool = True
    """every denoise step stochastic, log-prob over the whole chain"""
    denoise_steps: int = 5
    """K, Euler denoise steps of the rollout"""
    noise_level: float = 1.0
    """a, the flow-SDE noise level"""
    action_chunk: int = 1
    """C, env steps per policy call (one MDP step)"""
    # Environment
    env: str = "target"
    """"target" (image + state task) or any phyai_gym.make_env name"""
    num_targets: int = 2
    """target task: number of possible targets"""
    episode_length: int = 1
    """target task: steps before truncation"""
    num_envs: int = 16
    """N, parallel envs per rollout rank"""
    num_steps: int = 2
    """policy calls per env per rollout"""
    # Algorithm
    total_iterations: int = 20
    """PPO iterations (rollout + update + weight broadcast)"""
    learning_rate: float | None = None
    """Adam learning rate (default: 3e-3 for the tiny config; 5e-6 for base/checkpoints)"""
    gamma: float = 0.99
    """discount per chunk"""
    gae_lambda: float = 0.95
    """GAE lambda"""
    num_minibatches: int = 2
    """minibatches per epoch, per trainer"""
    update_epochs: int = 4
    """epochs over each batch"""
    norm_adv: bool = True
    """normalise advantages per minibatch (GAE's; --group-size's advantages are normalised per group)"""
    group_size: int = 1
    """G > 1: group-relative advantages (GRPO's) instead of GAE's, as in examples/ppo_pi05.py: every collection
    starts from a reset in which each G consecutive envs of a rollout rank share one state and draw their own
    noise, and a chunk's advantage comes from its env's first-episode return against its group's
    (`phyai_gym.train.groups`). N must be a multiple of G and T x C must cover an episode. 1: GAE"""
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
    # Reporting and faults
    digest_weights: bool = False
    """record a sha256 of each rank's trainable weights every iteration (a device-to-host copy: tests, debugging)"""
    inject_nan_iteration: int = 0
    """fault test: trainer 0 gets a NaN gradient in this iteration's last minibatch, so the sync aborts (0: never)"""
    quiet: bool = False
    """no per-iteration line"""

    # Derived in __post_init__ (STYLE item 2).
    batch_size: int = field(default=0, init=False)
    """samples per rollout rank and iteration (num_steps * num_envs)"""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") or (self.device == "cuda" and not torch.cuda.is_available()):
            why = "CUDA is not available here" if self.device == "cuda" else f"got {self.device!r}"
            raise ValueError(
                f"device: expected 'cpu' (gloo) or 'cuda' (NCCL, one GPU per rank: cuda:LOCAL_RANK), {why}; pass "
                "--device cpu, or --device cuda on a machine with a GPU per rank."
            )
        if self.learning_rate is None:
            self.learning_rate = 3e-3 if self.config in SMALL_CONFIGS and self.checkpoint is None else 5e-6
        check_group_size(self.group_size, self.num_envs)
        self.batch_size = self.num_envs * self.num_steps


@dataclass(frozen=True)
class Layout:
    """Who does what: trainers are ranks 0..T-1, rollout rank T + i sends to trainer i % T.

    Example:
        >>> layout = Layout.of(world_size=6, rank=3, trainer_ranks=2)
        >>> layout.is_trainer, layout.trainer_of(3), layout.rollout_ranks_of(1)
        (False, 1, [3, 5])
    """

    world_size: int
    rank: int
    trainer_ranks: int

    @classmethod
    def of(cls, world_size: int, rank: int, trainer_ranks: int) -> Layout:
        """The layout, refused with the launch that fixes it when the ranks do not split evenly."""
        rollout = world_size - trainer_ranks
        if trainer_ranks < 1 or rollout < trainer_ranks or rollout % trainer_ranks:
            raise ValueError(
                f"trainer_ranks: expected T >= 1 with the other {world_size} - T ranks a positive multiple of T, got "
                f"T={trainer_ranks} of {world_size} ranks. Fix: torchrun --nproc_per_node T+R with R a multiple of T "
                f"(e.g. --trainer-ranks 1 with {max(world_size, 2)} ranks)."
            )
        return cls(world_size, rank, trainer_ranks)

    @property
    def is_trainer(self) -> bool:
        """Whether this rank trains."""
        return self.rank < self.trainer_ranks

    def trainer_of(self, rank: int) -> int:
        """The trainer a rollout rank sends to."""
        return (rank - self.trainer_ranks) % self.trainer_ranks

    def rollout_ranks_of(self, trainer: int) -> list[int]:
        """The rollout ranks a trainer receives from, in order."""
        return [r for r in range(self.trainer_ranks, self.world_size) if self.trainer_of(r) == trainer]


def parse_args(argv: list[str] | None = None) -> Args:
    """Command-line flags, one per `Args` field (``--trainer-ranks 2``, ``--no-overlap``)."""
    return parse_dataclass(Args, argv)


def train(args: Args) -> dict:
    """Runs this rank's role; returns its rows (one per iteration: version, stats) and the abort, if any.

    Joins the process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) unless one
    is initialised already, and leaves the one it joined.
    """
    own_group = not dist.is_initialized()
    if args.device == "cuda":  # NCCL's buffers (and broadcast_weights') use the current device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if own_group:
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        layout = Layout.of(dist.get_world_size(), dist.get_rank(), args.trainer_ranks)
        trainer_group = dist.new_group(list(range(args.trainer_ranks))) if args.trainer_ranks > 1 else None
        return _trainer(args, layout, trainer_group) if layout.is_trainer else _rollout(args, layout)
    finally:
        if own_group:
            dist.destroy_process_group()


def _setup(args: Args, rank: int, trainer: bool) -> tuple[Pi05Policy, torch.device, int]:
    """This rank's policy (a trainer's eager copy or a rollout policy), its device and the env action dims."""
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    threads = configure_threads(args.threads, device=str(device), small_model=args.config in SMALL_CONFIGS)
    if not args.quiet and rank == 0:
        print(threads)
    rollout_cfg = RolloutConfig(
        method=args.method, num_steps=args.denoise_steps, joint=args.joint, noise_level=args.noise_level,
        action_chunk=args.action_chunk, trainable=args.trainable, keep_prefix=args.trainable == "expert",
    )  # fmt: skip
    action_dim = 1 if args.env == "target" else int(make_env(args.env, 1).single_action_space.shape[0])
    kwargs = dict(preset=args.preset, config=args.config, action_dim=action_dim, device=str(device), seed=args.seed,
                  rollout=rollout_cfg)  # fmt: skip
    if args.checkpoint is None:
        kwargs["prompt_format"] = "state"
    if trainer:
        policy = make_policy(args.checkpoint, **kwargs, max_batch_size=_minibatch(args, rank), cuda_graphs=False)
    else:
        policy = make_policy(args.checkpoint, **kwargs, max_batch_size=args.num_envs)
    return policy, device, action_dim


def _minibatch(args: Args, rank: int) -> int:
    per_trainer = (dist.get_world_size() - args.trainer_ranks) // args.trainer_ranks * args.batch_size
    if per_trainer < args.num_minibatches:
        raise ValueError(f"num_minibatches: expected at most the {per_trainer} samples a trainer gets, got "
                         f"{args.num_minibatches}; lower it or raise --num-envs / --num-steps.")  # fmt: skip
    return per_trainer // args.num_minibatches


def _sync(sync, source, rank: int, expected: str = "trainable") -> tuple[int | None, str | None]:
    """One broadcast from trainer 0: (committed version, None), or (None, why) when every rank aborted."""
    try:
        return broadcast_weights(sync, source if rank == 0 else None, expected=expected).version, None
    except WeightSyncError as err:
        return None, str(err)


def _digest(policy: Pi05Policy) -> str:
    h = hashlib.sha256()
    for name, p in sorted(policy.trainable_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _trainer(args: Args, layout: Layout, group) -> dict:
    rank = layout.rank
    trainer, device, _ = _setup(args, rank, trainer=True)
    master = MasterWeights(p for _, p in trainer.trainable_parameters())  # float32 weights the optimizer steps
    optimizer = torch.optim.Adam(master.parameters(), lr=args.learning_rate, eps=1e-5)
    # trainers other than 0 receive too: every trainer replica ends each iteration bit-identical to trainer 0
    receiver = None if rank == 0 else trainer.weight_sync
    version, aborted = _sync(receiver, trainer.model, rank, expected="all")  # identical start everywhere (v1)
    rows, sources, start = [], layout.rollout_ranks_of(rank), time.perf_counter()
    for iteration in range(1, args.total_iterations + 1):
        if aborted:
            break
        # ---- receive the rollout ranks' batches (the kept prefix K/V travels with them) ---------------------
        t0 = time.perf_counter()
        parts = [recv_rollout(src, device=device) for src in sources]
        batch = RolloutBatch.cat([b for b, _ in parts])
        extras = {key: torch.cat([e[key] for _, e in parts]) for key in parts[0][1]}
        t_recv = time.perf_counter() - t0

        # ---- PPO epochs over the gathered batch ---------------------------------------------------------------
        t0 = time.perf_counter()
        poison = iteration == args.inject_nan_iteration and rank == 0
        stats = _update(args, trainer, master, optimizer, batch, extras, group, poison)
        t_train = time.perf_counter() - t0

        # ---- broadcast: commit one version on every rank, or abort everywhere ---------------------------------
        t0 = time.perf_counter()
        lag = version - batch.header.weight_version  # updates between the batch's weights and the trained ones
        updated = _digest(trainer) if args.digest_weights else None  # this trainer's own result, before the sync
        new_version, aborted = _sync(receiver, trainer.model, rank)
        version = new_version or version
        row = {"iteration": iteration, "weight_version": version, "aborted": aborted is not None, "policy_lag": lag,
               "samples": batch.batch_size, "success_rate": _mean(extras["episode_success"]),
               "episodic_return": _mean(extras["episode_return"]), **stats,
               "time_recv": t_recv, "time_train": t_train, "time_sync": time.perf_counter() - t0}  # fmt: skip
        if args.digest_weights:
            row["update_digest"], row["weight_digest"] = updated, _digest(trainer)
        rows.append(row)
        if not args.quiet and rank == 0:
            sps = sum(r["samples"] for r in rows) * layout.trainer_ranks / (time.perf_counter() - start)
            print(f"iter {iteration}/{args.total_iterations} | success {row['success_rate']:.2f} return "
                  f"{row['episodic_return']:+.3f} kl {row['approx_kl']:.4f} clipfrac {row['clipfrac']:.2f} lag "
                  f"{row['policy_lag']} SPS {sps:.0f} | wait {t_recv:.2f}s train {t_train:.2f}s sync "
                  f"{row['time_sync'] * 1e3:.1f}ms v{version}", flush=True)  # fmt: skip
    return _result("trainer", rank, version, rows, aborted)


def _update(args: Args, trainer: Pi05Policy, master: MasterWeights, optimizer: torch.optim.Optimizer,
            batch: RolloutBatch, extras: dict, group, poison: bool) -> dict:  # fmt: skip
    """PPO epochs over `batch` on this trainer; with `group`, gradients are averaged over the trainers."""
    size = batch.batch_size
    step = size // args.num_minibatches
    b_idx = np.arange(size)
    last, first_kl, flat = (args.update_epochs - 1, (args.num_minibatches - 1) * step), None, None
    for epoch in range(args.update_epochs):
        np.random.shuffle(b_idx)
        for start in range(0, step * args.num_minibatches, step):
            mb = torch.as_tensor(b_idx[start : start + step], device=batch.chains.device)
            new = trainer.evaluate(batch.select(mb))
            out = ppo_loss(new.log_prob, new.values, new.entropy, batch.log_prob[mb], batch.values[mb],
                           extras["advantages"][mb], extras["returns"][mb], clip_coef=args.clip_coef,
                           clip_vloss=args.clip_vloss, norm_adv=args.norm_adv and args.group_size == 1,
                           ent_coef=args.ent_coef,
                           vf_coef=args.vf_coef)  # fmt: skip
            first_kl = out["approx_kl"] if first_kl is None else first_kl  # ~0 when the batch's weights are ours
            optimizer.zero_grad()
            out["loss"].backward()
            master.grads_to_masters()
            grads = [p.grad for p in master.parameters() if p.grad is not None]
            if poison and (epoch, start) == last:
                grads[0].view(-1)[0] = float("nan")  # the fault test: NaN weights after this step
            if group is not None:  # average over the trainers (one flat all-reduce)
                flat = average_gradients_(grads, lambda t: dist.all_reduce(t, group=group), dist.get_world_size(group),
                                          flat)  # fmt: skip
            torch.nn.utils.clip_grad_norm_(master.parameters(), args.max_grad_norm)
            optimizer.step()
            master.masters_to_model()
    stats = {key: float(out[key]) for key in ("pg_loss", "v_loss", "approx_kl", "clipfrac")}
    return {**stats, "approx_kl_first": float(first_kl)}


def _rollout(args: Args, layout: Layout) -> dict:
    rank, index = layout.rank, layout.rank - layout.trainer_ranks
    policy, device, _ = _setup(args, rank, trainer=False)
    version, aborted = _sync(policy.weight_sync, None, rank, expected="all")
    target = args.env == "target"
    env_kwargs = {"num_targets": args.num_targets, "episode_length": args.episode_length} if target else {}
    envs = PolicyVectorEnv(make_env(args.env, args.num_envs, **env_kwargs), policy, action_chunk=args.action_chunk)
    collector = Collector(envs, args, device, seed=args.seed + 1000 * index, rank=index,
                          ranks=layout.world_size - layout.trainer_ranks)  # fmt: skip
    rows, pending = [], None if aborted else collector.collect()
    for iteration in range(1, args.total_iterations + 1):
        if aborted:
            break
        send_rollout(pending[0], layout.trainer_of(rank), extras=pending[1])
        last = iteration == args.total_iterations
        # --overlap: the next batch is collected now, with the weights this rank has (the commit has not landed)
        pending = collector.collect() if args.overlap and not last else None
        new_version, aborted = _sync(policy.weight_sync, None, rank)
        version = new_version or version
        if pending is None and not (last or aborted):
            pending = collector.collect()  # --no-overlap: on-policy, with the weights just committed
        row = {"iteration": iteration, "weight_version": version, "aborted": aborted is not None}
        if args.digest_weights:
            row["weight_digest"] = _digest(policy)
        rows.append(row)
    envs.close()
    return _result("rollout", rank, version, rows, aborted)


class Collector:
    """A rollout rank's (T, N) rollout with GAE's advantages, or group-relative ones (--group-size): what it sends.

    `rank` of `ranks` is this rollout rank's index among the rollout ranks: with --group-size every collection
    resets from seeds no other rank and no earlier collection used (`grouped_reset_seeds`); without it the envs are
    reset once, from `seed`, and episodes run on across collections.

    Example:
        >>> batch, extras = Collector(envs, args, torch.device("cpu"), seed=1).collect()  # doctest: +SKIP
        >>> sorted(extras)  # doctest: +SKIP
        ['advantages', 'episode_return', 'episode_success', 'returns']
    """

    def __init__(self, envs: PolicyVectorEnv, args: Args, device: torch.device, seed: int, rank: int = 0,
                 ranks: int = 1) -> None:  # fmt: skip
        self.envs, self.args, self.device = envs, args, device
        self.rank, self.ranks, self.collections = rank, ranks, 0
        shape = (args.num_steps, args.num_envs)
        self.rewards, self.dones, self.values = (torch.zeros(shape, device=device) for _ in range(3))
        self.obs = None if args.group_size > 1 else envs.reset(seed=seed)[0]

    @torch.no_grad()
    def collect(self) -> tuple[RolloutBatch, dict[str, torch.Tensor]]:
        """T policy calls per env: the samples (step-major) and advantages, returns, finished episodes' stats."""
        args, dev, samples, returns_done, successes = self.args, self.device, [], [], []
        if args.group_size > 1:  # G envs a state, every env its own noise stream; fresh seeds every collection
            n = args.num_envs
            run_seed = args.seed + self.collections * self.ranks * n
            self.obs, _ = self.envs.reset(**grouped_reset_seeds(run_seed, n, args.group_size, self.rank * n))
        self.collections += 1
        first_episodes = FirstEpisodes(args.num_steps, args.num_envs)
        for step in range(args.num_steps):
            self.obs, reward, terminated, truncated, infos = self.envs.step()  # the policy acts on `obs`
            out = self.envs.last_output
            samples.append(RolloutBatch.from_output(out))
            self.values[step] = out.values
            # bootstrap truncations with V(final obs), then treat the step as done
            trunc = torch.as_tensor(truncated, device=dev) & ~torch.as_tensor(terminated, device=dev)
            final_value = infos["policy"]["final_value"].to(dev)
            self.rewards[step] = torch.as_tensor(reward, device=dev).float() + args.gamma * final_value * trunc
            self.dones[step] = torch.as_tensor(terminated | truncated, device=dev).float()
            if "episode" in infos:
                ended, episode_returns = _numpy(infos["_episode"]), _numpy(infos["episode"]["r"])
                returns_done += episode_returns[ended].tolist()
                first_episodes.record(step, ended, episode_returns)
                successes += _numpy(infos["episode"]["success_once"])[ended].tolist()
        next_value = self.envs.policy.value(self.obs).to(dev)
        advantages, returns = gae(self.rewards, self.values, self.dones, next_value, gamma=args.gamma,
                                  gae_lambda=args.gae_lambda)  # fmt: skip
        if args.group_size > 1:  # the critic still learns GAE's returns; the policy the group's advantages
            advantages = first_episodes.advantages(args.group_size, dev, env_steps=args.num_steps * args.action_chunk)
        extras = {"advantages": advantages.reshape(-1), "returns": returns.reshape(-1),
                  "episode_return": torch.tensor(returns_done, dtype=torch.float32),
                  "episode_success": torch.tensor(successes, dtype=torch.float32)}  # fmt: skip
        return RolloutBatch.cat(samples), extras


def _numpy(value) -> np.ndarray:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def _mean(values: torch.Tensor) -> float:
    return float(values.mean()) if values.numel() else float("nan")


def _result(role: str, rank: int, version: int | None, rows: list[dict], aborted: str | None) -> dict:
    if aborted:
        print(f"rank {rank} ({role}): weight sync aborted on every rank; stopping at version {version}: {aborted}",
              flush=True)  # fmt: skip
    return {"role": role, "rank": rank, "weight_version": version, "rows": rows, "aborted": aborted}


if __name__ == "__main__":
    result = train(parse_args())
    raise SystemExit(1 if result["aborted"] else 0)
