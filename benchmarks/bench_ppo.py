"""The PPO update at full size (DESIGN C9): update throughput, update-0 ratio, act() across batch sizes, iteration.

    python -m benchmarks.bench_ppo [--out DIR] [--which update ratio act iteration]
    python -m benchmarks.bench_ppo [--out DIR] --seeds 1 2 3 4      # `seeds` only (not in the default set)

LIBERO RL setting: pi05_base geometry, 2 cameras, 48-token prompt, K=5 joint flow-SDE, H=10, C=5, A=7, prefix
values, trainable = expert, random weights (every weight randomised). Rows go to ppo.jsonl (results/ or DIR), their
``kind`` saying which measurement, and the update-0 ratio to update0_ratio.jsonl:
  update         minibatch samples/s of evaluate() forward + backward + optimizer step (incl. the master copies),
                 for the default trainer (rollout's bf16 + float32 masters; the rollout's prefix K/V kept), the
                 same with the prefix encoded once per rollout batch (its cost shared over 4 epochs x 2
                 minibatches), and the float32 trainer (prefix recomputed per minibatch)
  update0_ratio  |log pi_trainer - log pi_rollout| at update 0 over a batch of 64 graph-rollout samples
  act_public     act() samples/s through the public processor at N = 8..64 with each N declared, and at every
                 N = 1..64 undeclared (``declared: false``; `first_act_s`: the first call at N, its captures included)
  iteration      examples/ppo_pi05.py --config base --device cuda on the target task (median iteration, split)
  seeds          `seeds`: that run for several seeds, one spawned process each, two at a time on the one GPU (each also
                 an ``iteration`` row with "seed" and "concurrent_runs", its timings shared-GPU ones); the final
                 success rates per seed and their means
"""

from __future__ import annotations

import argparse
import shlex
import sys
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
    """Append `row` to ``ppo.jsonl``; its ``kind`` says which measurement it is."""
    write_rows("ppo", [row], out)


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
    from phyai_gym.train.master_weights import MasterWeights
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
            _row(out, {"kind": "update", "trainer": name, "setting": SETTING, "minibatch": MINIBATCH,
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
        write_rows("update0_ratio", [{"trainer": "default" if trainer_dtype is None else "float32",
                   "setting": SETTING, "batch": BATCH, "mean_abs_log_ratio": float(log_ratio.abs().mean()),
                   "max_abs_log_ratio": float(log_ratio.abs().max()),
                   "clip_fraction": float(((log_ratio.exp() - 1).abs() > 0.2).float().mean()),
                   "approx_kl": float(((log_ratio.exp() - 1) - log_ratio).mean()),
                   "mean_abs_value_diff": float((ev.values - batch.values).abs().mean())}], out)
        del rollout, trainer, master, batch
        torch.cuda.empty_cache()


def bench_act(out: Path, device: str = "cuda", sizes=(8, 16, 24, 40, 48, 56, 64), iters: int = 10) -> None:
    """act() through make_policy and the public processor: N declared as PolicyVectorEnv declares it, then every
    N = 1..64 undeclared (a fresh policy)."""
    _bench_act(out, device, sizes, iters, declared=True)
    _bench_act(out, device, tuple(range(1, 65)), max(3, iters // 2), declared=False)


def _bench_act(out: Path, device: str, sizes: tuple[int, ...], iters: int, declared: bool) -> None:
    from phyai_gym.make import make_policy
    from policies.pi05.policy import RolloutConfig

    cfg = _config()
    policy = make_policy(config=cfg, action_dim=7, device=device, max_batch_size=64,
                         camera_map={"image": "base_0_rgb", "wrist_image": "left_wrist_0_rgb"},
                         rollout=RolloutConfig(method="sde", joint=True, num_steps=5, noise_level=0.5, action_chunk=5))
    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        if declared:
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
            if i == 0:
                first = time.perf_counter() - t0
            if i >= 2:
                times.append(time.perf_counter() - t0)
        p50 = float(np.median(times))
        rows.append((n, n / p50, p50, int(policy.processor(obs).tokens.shape[1]), first))
    at64 = dict((n, s) for n, s, *_ in rows).get(64)
    for n, sps, p50, bucket, first in rows:
        _row(out, {"kind": "act_public", "setting": SETTING, "batch": n, "samples_per_s": sps,
                   "p50_ms": p50 * 1e3, "prompt_bucket": bucket, "bucket": policy.scheduler.bucket_for(n),
                   "ratio_to_64": sps / at64 if at64 else None, "declared": declared, "first_act_s": first})
    policy.close()


def _iteration_row(
    csv: Path, iterations: int, flags: tuple[str, ...], config: str, device: str, extra: tuple[str, ...] = ()
) -> dict:
    """One run of the PPO example in this process (`flags`, then `extra`, after the defaults); its ``iteration``
    row, "flags" naming `flags` only."""
    import runpy

    example = runpy.run_path(str(ROOT / "examples" / "ppo_pi05.py"))
    args = example["parse_args"](["--config", config, "--device", device, "--total-iterations", str(iterations),
                                  "--csv", str(csv), *flags, *extra])  # fmt: skip
    t0 = time.perf_counter()
    result = example["train"](args)
    curve = result["curve"]
    split = {k: float(np.median([r[f"time_{k}"] for r in curve])) for k in ("rollout", "train", "sync")}
    return {
        "kind": "iteration",
        "config": config,
        "env": args.env,
        "flags": " ".join(flags),
        "seed": args.seed,
        "num_envs": args.num_envs,
        "T": args.num_steps,
        "epochs": args.update_epochs,
        "minibatches": args.num_minibatches,
        "iterations": len(curve),
        "iteration_s_p50": float(np.median([r["time_rollout"] + r["time_train"] + r["time_sync"] for r in curve])),
        "rollout_s_p50": split["rollout"],
        "update_s_p50": split["train"],
        "sync_s_p50": split["sync"],
        "success_first": curve[0]["success_rate"],
        "success_last": curve[-1]["success_rate"],
        "final_success_stochastic": result["final"]["stochastic"],
        "final_success_deterministic": result["final"]["deterministic"],
        "eval_episodes": args.eval_episodes,
        "wall_s": time.perf_counter() - t0,
        "clipfrac_first": curve[0]["clipfrac"],
        "approx_kl_first": curve[0]["approx_kl_first"],
    }


def bench_iteration(
    out: Path, iterations: int = 16, flags: tuple[str, ...] = (), config: str = "base", device: str = "cuda"
) -> None:
    """The PPO example in this process with extra `flags` (its own CSV and plot go to DIR)."""
    csv = (out or Path(tempfile.mkdtemp())) / "ppo_iteration.csv"
    _row(out, _iteration_row(csv, iterations, tuple(flags), config, device))


def _seed_child(
    work: str, seed: int, iterations: int, flags: tuple[str, ...], config: str, device: str, concurrent: int
) -> None:
    """A spawned child of `bench_seeds`: one run with ``--seed seed``; its stdout and stderr go to
    ``work/ppo_seed<seed>.log``, its row (or an error row) to ``work/ppo_seed<seed>.json`` for the parent."""
    import json
    import os

    from benchmarks.common import environment

    work_dir = Path(work)
    with (work_dir / f"ppo_seed{seed}.log").open("w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        extra = ("--seed", str(seed))
        if device != "cpu" and "--threads" not in flags:  # the host's cores shared between the runs
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            extra += ("--threads", str(max(1, cores // concurrent)))
        try:
            row = _iteration_row(work_dir / f"ppo_seed{seed}.csv", iterations, flags, config, device, extra)
        except BaseException as err:  # noqa: BLE001 - the parent records it
            traceback.print_exc()
            row = {
                "kind": "iteration_error",
                "flags": " ".join(flags),
                "error": f"{type(err).__name__}: {err}"[:2000],
                "traceback": traceback.format_exc()[-4000:],
            }
        row.update(seed=seed, concurrent_runs=concurrent)
        row = {**environment(), **row}  # this process's GPU and threads, not the parent's
        tmp = work_dir / f"ppo_seed{seed}.json.tmp"
        tmp.write_text(json.dumps(row))
        tmp.replace(work_dir / f"ppo_seed{seed}.json")
        sys.stdout.flush()


def _collect_child(
    work: Path, seed: int, child, flags: tuple[str, ...], width: int, start: float, timeout_s: float | None
) -> dict:
    """The row of `child` (run with ``--seed seed``) once it ends, or an error row; past `timeout_s` (counted from
    `start`) it is terminated first."""
    import json

    child.join(None if timeout_s is None else max(0.0, timeout_s - (time.perf_counter() - start)))
    timed_out = child.is_alive()
    if timed_out:  # past the deadline (or hanging after its row): end it
        child.terminate()
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(10)
    path = work / f"ppo_seed{seed}.json"
    if path.exists():
        row = json.loads(path.read_text())
        path.unlink()  # the row goes to ppo.jsonl
    else:
        why = f"ran past timeout_s={timeout_s}" if timed_out else "died"
        log = work / f"ppo_seed{seed}.log"
        row = {
            "kind": "iteration_error",
            "flags": " ".join(flags),
            "seed": seed,
            "concurrent_runs": width,
            "error": f"child {why} (exit code {child.exitcode}) after {time.perf_counter() - start:.0f} s, no row",
            "log_tail": log.read_text()[-4000:] if log.exists() else "",
        }
    print(f"ppo_seeds: seed {seed} {row['kind']} deterministic {row.get('final_success_deterministic')}", flush=True)
    return row


def bench_seeds(
    out: Path | None,
    seeds=(1, 2, 3, 4),
    flags: tuple[str, ...] = (),
    iterations: int = 16,
    config: str = "base",
    device: str = "cuda",
    timeout_s: float | None = None,
    concurrent: int = 2,
) -> dict:
    """`bench_iteration` for every seed, `concurrent` spawned processes at a time sharing the device.

    Each child runs the example in process with ``--seed S`` after `flags` (its CSV, plot and log go to
    ``DIR/ppo_seed<S>.*``, or a temporary folder when `out` is None) and hands its row back through a JSON file;
    the parent alone appends the ``iteration`` rows (``seed``, ``concurrent_runs``: the timings are shared-GPU
    ones), an error row for a child that failed, died or ran past `timeout_s` (counted from the start of all;
    then it is terminated), and one ``seeds`` row: the final success rates per seed and their means over the
    seeds that finished. Returns that ``seeds`` row. The default of 2 is what fits an H200: a full-size run
    peaks at 35-57 GiB, and 3 or 4 at once ran out of its memory.
    """
    import multiprocessing

    seeds, flags = [int(s) for s in seeds], tuple(flags)
    if len(set(seeds)) != len(seeds) or not seeds:
        raise ValueError(f"seeds: expected distinct seeds, got {seeds!r}.")
    if not (isinstance(concurrent, int) and concurrent >= 1):
        raise ValueError(f"concurrent: expected an int >= 1, got {concurrent!r}. Fix: pass e.g. 2.")
    work = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="ppo_seeds_"))
    work.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        (work / f"ppo_seed{seed}.json").unlink(missing_ok=True)
    width = min(concurrent, len(seeds))
    ctx = multiprocessing.get_context("spawn")
    start = time.perf_counter()
    rows = {}
    for first in range(0, len(seeds), width):  # in waves of `width` runs
        wave = {
            seed: ctx.Process(
                target=_seed_child,
                name=f"ppo_seed{seed}",
                args=(str(work), seed, iterations, flags, config, device, width),
            )
            for seed in seeds[first : first + width]
        }
        for child in wave.values():
            child.start()
        for seed, child in wave.items():
            rows[seed] = _collect_child(work, seed, child, flags, width, start, timeout_s)
            _row(out, dict(rows[seed]))
    done = [s for s in seeds if rows[s]["kind"] == "iteration"]
    finals = {mode: [rows[s].get(f"final_success_{mode}") for s in seeds] for mode in ("deterministic", "stochastic")}
    summary = {
        "kind": "seeds",
        "config": config,
        "device": device,
        "flags": " ".join(flags),
        "seeds": seeds,
        "iterations": iterations,
        "final_success_deterministic": finals["deterministic"],
        "mean_deterministic": float(np.mean([rows[s]["final_success_deterministic"] for s in done])) if done else None,
        "final_success_stochastic": finals["stochastic"],
        "mean_stochastic": float(np.mean([rows[s]["final_success_stochastic"] for s in done])) if done else None,
        "episodes_each": rows[done[0]]["eval_episodes"] if done else None,
        "concurrent_runs": width,
        "failed_seeds": [s for s in seeds if s not in done],
        "wall_s": time.perf_counter() - start,
    }
    _row(out, dict(summary))
    return summary


WHICH = {
    "update": bench_update,
    "ratio": bench_ratio,
    "act": bench_act,
    "iteration": bench_iteration,
    "seeds": bench_seeds,
}
DEFAULT = ("update", "ratio", "act", "iteration")
"""What `run` (the gpu_suite `ppo` section) measures by default: not "seeds" (4 concurrent full runs)."""


def run(out: Path | None = None, which=DEFAULT, seeds=None, flags: tuple[str, ...] = ()) -> None:
    """Every measurement in `which` (the `ppo` section of gpu_suite.py); one failing does not lose the others.
    `seeds` and `flags` (the example's flags, e.g. ``("--learning-rate", "2e-5")``) are "seeds"'s."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    for name in which:
        try:
            if name == "seeds":
                bench_seeds(out, **({"seeds": seeds} if seeds is not None else {}), flags=tuple(flags))
            else:
                WHICH[name](out)
        except Exception as err:  # noqa: BLE001
            _row(out, {"kind": f"{name}_error", "error": f"{type(err).__name__}: {err}"[:2000]})
            traceback.print_exc()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSONL files (default: results/)")
    parser.add_argument(
        "--which", nargs="+", default=None, choices=list(WHICH), help=f"default: {' '.join(DEFAULT)}, or seeds"
    )
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=None, help="`seeds` for these seeds, two at a time (default: 1 2 3 4)"
    )
    parser.add_argument("--flags", default="", help='the example\'s flags for "seeds", e.g. "--learning-rate 2e-5"')
    args = parser.parse_args()
    which = args.which if args.which is not None else ["seeds"] if args.seeds else list(DEFAULT)
    run(args.out, which, args.seeds, tuple(shlex.split(args.flags)))


if __name__ == "__main__":
    main()
