"""The PPO update at full size (DESIGN C9): update throughput, update-0 ratio, act() across batch sizes, iteration.

    python -m benchmarks.bench_ppo [--out DIR] [--which update ratio act iteration]

LIBERO RL setting: pi05_base geometry, 2 cameras, 48-token prompt, K=5 joint flow-SDE, H=10, C=5, A=7, prefix
values, trainable = expert, random weights (every weight randomised). Rows go to <bench>.jsonl (results/ or
DIR):
  ppo_update     minibatch samples/s of evaluate() forward + backward + optimizer step (incl. the master copies),
                 for the default trainer (rollout's bf16 + float32 masters; the rollout's prefix K/V kept), the
                 same with the prefix encoded once per rollout batch (its cost shared over 4 epochs x 2
                 minibatches), and the float32 trainer (prefix recomputed per minibatch)
  update0_ratio  |log pi_trainer - log pi_rollout| at update 0 over a batch of 64 graph-rollout samples
  act_public     act() samples/s through the public processor at N = 8..64 with each N declared
  ppo_iteration  examples/ppo_pi05.py --config base --device cuda on the target task (median iteration, split)
"""

from __future__ import annotations

import argparse
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import write_rows

ROOT = Path(__file__).resolve().parents[1]
SETTING = "libero_rl"
BATCH, MINIBATCH, EPOCHS = 64, 32, 4


def _row(out: Path | None, row: dict) -> None:
    bench = row.pop("bench")
    write_rows(bench, [row], out)


def _config():
    from policies.pi05.config import Pi05Config

    return Pi05Config.pi05_base(action_horizon=10, num_steps=5, value_source="prefix")


def _randomize(model, seed: int = 0, std: float = 0.02) -> None:
    """Seeded N(0, std) for every parameter, drawn on the device."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.empty(p.shape, device=p.device, dtype=torch.float32).normal_(0.0, std, generator=gen)
            p.copy_(noise.to(p.dtype))


class _Processor:
    """Model-side processor stand-in: inputs are already processed."""

    slots, action_dim, prompt_buckets = (0, 1), 7, (48,)

    def postprocess(self, model_actions: torch.Tensor, chunk: int) -> torch.Tensor:
        return model_actions[:, :chunk, : self.action_dim].float()


def _inputs(n: int, device: str, seed: int = 0):
    from policies.pi05.inputs import ModelInputs

    gen = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 2, 3, 224, 224), generator=gen, dtype=torch.uint8)
    tokens = torch.randint(3, 30000, (n, 48), generator=gen, dtype=torch.int32)
    return ModelInputs(images.to(device), torch.ones(n, 2, dtype=torch.bool, device=device), (0, 1),
                       tokens.to(device), torch.full((n,), 48, dtype=torch.int32, device=device))


def _policies(device: str, trainer_dtype: torch.dtype | None):
    """(graph rollout policy in bf16 keeping its prefix, eager trainer copy with the same weights, its masters,
    the bytes the rollout policy holds: weights, buffers, graphs)."""
    from policies.master_weights import MasterWeights
    from policies.pi05.model import Pi05Model
    from policies.pi05.policy import Pi05Policy, RolloutConfig
    from policies.pi05.scheduler import SchedulerConfig

    cfg = _config()
    rollout_cfg = RolloutConfig(method="sde", joint=True, num_steps=5, noise_level=0.5, action_chunk=5,
                                keep_prefix=trainer_dtype is None)
    with torch.device(device):
        model = Pi05Model(cfg)
    _randomize(model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.set_precision(torch.bfloat16)
    sched = SchedulerConfig(max_batch_size=BATCH, batch_buckets=(BATCH,), prompt_buckets=(48,), num_steps=(5,),
                            camera_sets=((0, 1),))
    rollout = Pi05Policy(model, _Processor(), rollout_cfg, sched)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - sum(t.nbytes for t in state.values())
    with torch.device(device):
        trainer_model = Pi05Model(cfg)
    trainer_model.load_state_dict(state)
    del state
    trainer_model.set_precision(trainer_dtype or torch.bfloat16)
    trainer = Pi05Policy(trainer_model, _Processor(), rollout_cfg,
                         replace(sched, max_batch_size=MINIBATCH, batch_buckets=None, cuda_graphs=False))
    if trainer_dtype is None:
        trainer.model.share_prefix(rollout.model)  # as the PPO example: one copy of the frozen prefix weights
    master = MasterWeights(p for _, p in trainer.trainable_parameters())
    return rollout, trainer, master, held


def _rollout_batch(rollout, device: str):
    from policies.pi05.batch import RolloutBatch

    x = _inputs(BATCH, device)
    with torch.no_grad():
        out = rollout.act_inputs(x, seeds=torch.arange(BATCH, device=device))
    return RolloutBatch.from_output(out)


def _update_step(trainer, master, optimizer, batch, graphs: bool = False) -> None:
    new = trainer.evaluate(batch, cuda_graphs=graphs)
    ratio = (new.log_prob - batch.log_prob).exp()
    adv = torch.linspace(-1, 1, batch.batch_size, device=ratio.device)
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    loss = pg + 0.5 * ((new.values - batch.values) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    master.grads_to_masters()
    torch.nn.utils.clip_grad_norm_(master.parameters(), 0.5)
    optimizer.step()
    master.masters_to_model()


def _time_updates(trainer, master, batch, steps: int, warmup: int = 2, graphs: bool = False) -> list[float]:
    optimizer = torch.optim.Adam(master.parameters(), lr=5e-6, eps=1e-5)
    times = []
    gen = torch.Generator().manual_seed(0)
    for i in range(warmup + steps):
        mb = torch.randperm(batch.batch_size, generator=gen)[:MINIBATCH].to(batch.chains.device)
        sub = batch.select(mb)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _update_step(trainer, master, optimizer, sub, graphs)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _kernels_per_minibatch(trainer, master, batch, graphs: bool = False) -> tuple[int, int]:
    """(CUDA kernels executed, kernel + graph launches issued by the host) in one update step."""
    from torch.profiler import ProfilerActivity, profile

    optimizer = torch.optim.Adam(master.parameters(), lr=5e-6, eps=1e-5)
    sub = batch.select(torch.arange(MINIBATCH, device=batch.chains.device))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _update_step(trainer, master, optimizer, sub, graphs)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                        "cuLaunchKernelEx", "cudaGraphLaunch"))  # fmt: skip
    return int(kernels), int(launches)


def bench_update(out: Path, device: str = "cuda") -> None:
    for trainer_dtype in (None, torch.float32):
        rollout, trainer, master, held = _policies(device, trainer_dtype)
        batch = _rollout_batch(rollout, device)
        variants = [("default", batch)] if trainer_dtype is None else [("float32", replace(batch, prefix=None))]
        if trainer_dtype is None:
            variants = [("default_graphed", batch), *variants, ("default_encode_once", replace(batch, prefix=None))]
        for name, data in variants:
            encode_s = 0.0
            if name == "default_encode_once":
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                data = trainer.encode_prefix(data)
                torch.cuda.synchronize()
                encode_s = time.perf_counter() - t0
            torch.cuda.reset_peak_memory_stats()
            graphs = name == "default_graphed"
            times = _time_updates(trainer, master, data, steps=8 if trainer_dtype is None else 3, graphs=graphs)
            kernels, launches = _kernels_per_minibatch(trainer, master, data, graphs)
            p50 = float(np.median(times)) + encode_s / (EPOCHS * BATCH // MINIBATCH)
            _row(out, {"bench": "ppo_update", "trainer": name, "setting": SETTING, "minibatch": MINIBATCH,
                       "K": 5, "method": "sde joint", "trainable": "expert",
                       "cuda_graphs": graphs,
                       "prefix": {"default": "kept from the rollout", "default_graphed": "kept from the rollout",
                                  "default_encode_once": "encoded once per batch",
                                  "float32": "recomputed per minibatch"}[name],
                       "minibatch_ms_p50": p50 * 1e3, "encode_prefix_ms": encode_s * 1e3,
                       "samples_per_s": MINIBATCH / p50,
                       "peak_mem_gib": (torch.cuda.max_memory_allocated() - held) / 2**30,
                       "process_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                       "rollout_policy_gib": held / 2**30,
                       "kernels_per_minibatch": kernels, "host_launches_per_minibatch": launches})
        del rollout, trainer, master, batch
        torch.cuda.empty_cache()


def bench_ratio(out: Path, device: str = "cuda") -> None:
    for trainer_dtype in (None, torch.float32):
        rollout, trainer, master, _ = _policies(device, trainer_dtype)
        batch = _rollout_batch(rollout, device)
        if trainer_dtype is not None:
            batch = replace(batch, prefix=None)
        with torch.no_grad():
            ev = trainer.evaluate(batch)
        log_ratio = (ev.log_prob - batch.log_prob).float()
        _row(out, {"bench": "update0_ratio", "trainer": "default" if trainer_dtype is None else "float32",
                   "setting": SETTING, "batch": BATCH, "mean_abs_log_ratio": float(log_ratio.abs().mean()),
                   "max_abs_log_ratio": float(log_ratio.abs().max()),
                   "clip_fraction": float(((log_ratio.exp() - 1).abs() > 0.2).float().mean()),
                   "approx_kl": float(((log_ratio.exp() - 1) - log_ratio).mean()),
                   "mean_abs_value_diff": float((ev.values - batch.values).abs().mean())})
        del rollout, trainer, master, batch
        torch.cuda.empty_cache()


def bench_act(out: Path, device: str = "cuda", sizes=(8, 16, 24, 40, 48, 56, 64), iters: int = 10) -> None:
    """act() through make_policy and the public processor, N declared as PolicyVectorEnv declares it."""
    from phyai_gym.make import make_policy
    from policies.pi05.policy import RolloutConfig

    cfg = _config()
    policy = make_policy(config=cfg, action_dim=7, device=device, max_batch_size=64,
                         camera_map={"image": "base_0_rgb", "wrist_image": "left_wrist_0_rgb"},
                         rollout=RolloutConfig(method="sde", joint=True, num_steps=5, noise_level=0.5, action_chunk=5))
    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        policy.declare_batch_sizes([n])
        obs = {"images": {k: rng.integers(0, 256, (n, 224, 224, 3), dtype=np.uint8) for k in ("image", "wrist_image")},
               "state": rng.standard_normal((n, 8)).astype(np.float32),
               "task": ["put the bowl on the plate"] * n}
        times = []
        for i in range(iters + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            result = policy.act(obs)
            result.actions.cpu()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        p50 = float(np.median(times))
        rows.append((n, n / p50, p50, int(policy.processor(obs).tokens.shape[1])))
    at64 = dict((n, s) for n, s, _, _ in rows).get(64)
    for n, sps, p50, bucket in rows:
        _row(out, {"bench": "act_public", "setting": SETTING, "batch": n, "samples_per_s": sps,
                   "p50_ms": p50 * 1e3, "prompt_bucket": bucket, "bucket": policy.scheduler.bucket_for(n),
                   "ratio_to_64": sps / at64 if at64 else None})
    policy.close()


def bench_iteration(out: Path, iterations: int = 16, flags: tuple[str, ...] = ()) -> None:
    """The PPO example in this process with extra `flags` (its own CSV and plot go to DIR)."""
    import runpy

    example = runpy.run_path(str(ROOT / "examples" / "ppo_pi05.py"))
    args = example["parse_args"](["--config", "base", "--device", "cuda", "--total-iterations", str(iterations),
                                  "--csv", str((out or Path(tempfile.mkdtemp())) / "ppo_iteration.csv"), *flags])
    t0 = time.perf_counter()
    result = example["train"](args)
    curve = result["curve"]
    split = {k: float(np.median([r[f"time_{k}"] for r in curve])) for k in ("rollout", "train", "sync")}
    _row(out, {"bench": "ppo_iteration", "config": "base", "env": "target", "flags": " ".join(flags),
               "seed": args.seed, "num_envs": args.num_envs,
               "T": args.num_steps, "epochs": args.update_epochs, "minibatches": args.num_minibatches,
               "iterations": len(curve), "iteration_s_p50": float(np.median([r["time_rollout"] + r["time_train"]
                                                                            + r["time_sync"] for r in curve])),
               "rollout_s_p50": split["rollout"], "update_s_p50": split["train"], "sync_s_p50": split["sync"],
               "success_first": curve[0]["success_rate"], "success_last": curve[-1]["success_rate"],
               "final_success_stochastic": result["final"]["stochastic"],
               "final_success_deterministic": result["final"]["deterministic"], "wall_s": time.perf_counter() - t0,
               "clipfrac_first": curve[0]["clipfrac"], "approx_kl_first": curve[0]["approx_kl_first"]})


WHICH = {"update": bench_update, "ratio": bench_ratio, "act": bench_act, "iteration": bench_iteration}


def run(out: Path | None = None, which=tuple(WHICH)) -> None:
    """Every measurement in `which` (the `ppo` section of gpu_suite.py); one failing does not lose the others."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    for name in which:
        try:
            WHICH[name](out)
        except Exception as err:  # noqa: BLE001
            _row(out, {"bench": f"ppo_{name}_error", "error": f"{type(err).__name__}: {err}"[:2000]})
            traceback.print_exc()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSONL files (default: results/)")
    parser.add_argument("--which", nargs="+", default=list(WHICH), choices=list(WHICH))
    args = parser.parse_args()
    run(args.out, args.which)


if __name__ == "__main__":
    main()
