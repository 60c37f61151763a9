"""First-hour wall times: what a new user waits for, measured here rather than asserted in tests.

Measurements (``--which``, several allowed):

1. ``help``      -- ``phyai-gym --help`` in a fresh interpreter (target: < 0.5 s on an idle 2-core machine; it
   imports no torch). Also ``python -c pass`` as the floor of an interpreter start.
2. ``run``       -- ``phyai-gym run`` with its defaults (tiny PI0.5, 4 Pusher envs, until every env finished one
   episode), end to end in a fresh interpreter.
3. ``ppo``       -- the tiny PPO example as the test runs it (target task, 20 iterations, 256 evaluation
   episodes, seed 1), in process: wall time and final success.
4. ``tokenizer`` -- a cached ``build_standin_tokenizer`` call (the stand-in tokenizer is built once per machine).

Each measurement appends one JSON row (``"measure": "help"``, ...) to ``benchmarks/results/cli.jsonl``
(``--out-dir`` elsewhere) with the device, torch version, git commit, CPU cores, the 1-minute load average
before and after, and the configuration.

    python benchmarks/bench_cli.py                       # help + tokenizer (seconds)
    python benchmarks/bench_cli.py --which help run ppo  # everything (minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHICH = ("help", "run", "ppo", "tokenizer")


def commit() -> str:
    if os.environ.get("PHYAI_GYM_COMMIT"):
        return os.environ["PHYAI_GYM_COMMIT"]
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def environment() -> dict:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "gpu": gpu,
        "device": gpu if gpu != "cpu" else f"cpu x{os.cpu_count()} ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit(),
        "cpu_cores": os.cpu_count(),
    }


def append(out_dir: Path, row: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "cli.jsonl"
    with open(path, "a") as handle:
        handle.write(json.dumps({"bench": "cli", **row}) + "\n")
    print(f"{row['measure']}: {json.dumps(row.get('results'))} -> {path}")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def python_start() -> None:
    subprocess.run([sys.executable, "-c", "pass"], cwd=ROOT, env=_env(), check=True, capture_output=True)


def phyai_gym_help() -> None:
    subprocess.run([sys.executable, "-m", "phyai_gym.cli", "--help"], cwd=ROOT, env=_env(), check=True,
                   capture_output=True)  # fmt: skip


def phyai_gym_run() -> None:
    subprocess.run([sys.executable, "-m", "phyai_gym.cli", "run"], cwd=ROOT, env=_env(), check=True,
                   capture_output=True, timeout=3600)  # fmt: skip


def wall(command, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        command()
        times.append(time.perf_counter() - start)
    return times


def bench_help(repeats: int) -> dict:
    floor = wall(python_start, repeats)
    help_ = wall(phyai_gym_help, repeats)
    imports_torch = subprocess.run(
        [sys.executable, "-c", "import sys, phyai_gym.cli; print(int('torch' in sys.modules))"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    return {
        "config": {"command": "python -m phyai_gym.cli --help", "repeats": repeats},
        "results": {
            "help_s_p50": round(statistics.median(help_), 4),
            "help_s_min": round(min(help_), 4),
            "python_start_s_p50": round(statistics.median(floor), 4),
            "imports_torch": imports_torch == "1",
        },
        "target": {"help_s_p50": "< 0.5 on an idle 2-core machine"},
    }


def bench_run() -> dict:
    seconds = wall(phyai_gym_run, 1)[0]
    return {"config": {"command": "phyai-gym run (defaults)"}, "results": {"wall_s": round(seconds, 2)}}


def bench_ppo(seed: int) -> dict:
    spec = importlib.util.spec_from_file_location("ppo_pi05", ROOT / "examples" / "ppo_pi05.py")
    ppo = importlib.util.module_from_spec(spec)
    sys.modules["ppo_pi05"] = ppo
    spec.loader.exec_module(ppo)
    args = ppo.Args(seed=seed, total_iterations=20, eval_episodes=256, csv=None, noise_level=1.0, learning_rate=3e-3,
                    quiet=True)  # fmt: skip
    start = time.perf_counter()
    result = ppo.train(args)
    seconds = time.perf_counter() - start
    import torch

    config = {"example": "examples/ppo_pi05.py", "seed": seed, "total_iterations": 20, "eval_episodes": 256,
              "num_envs": args.num_envs, "torch_threads": torch.get_num_threads()}  # fmt: skip
    return {
        "config": config,
        "results": {
            "wall_s": round(seconds, 1),
            "final_stochastic": result["final"]["stochastic"],
            "times_s": {k: round(v, 2) for k, v in result["times"].items()},
        },  # fmt: skip
    }


def bench_tokenizer(repeats: int) -> dict:
    from policies.pi05.tokenizer import build_standin_tokenizer, default_standin_dir

    folder = build_standin_tokenizer(default_standin_dir())  # built once per machine
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        build_standin_tokenizer(folder)
        times.append(time.perf_counter() - start)
    return {
        "config": {"call": "build_standin_tokenizer(cached folder)", "repeats": repeats},
        "results": {"cached_call_s_p50": round(statistics.median(times), 5)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--which", nargs="+", choices=WHICH, default=["help", "tokenizer"])
    parser.add_argument("--repeats", type=int, default=5, help="repeats of the short measurements (p50 reported)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the PPO run")
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"), help="folder of the JSONL files")
    args = parser.parse_args()
    base = environment()
    for which in args.which:
        load_before = os.getloadavg()[0]
        row = {
            "help": lambda: bench_help(args.repeats),
            "run": bench_run,
            "ppo": lambda: bench_ppo(args.seed),
            "tokenizer": lambda: bench_tokenizer(args.repeats),
        }[which]()
        load = {"loadavg_1m_before": round(load_before, 2), "loadavg_1m_after": round(os.getloadavg()[0], 2)}
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        append(Path(args.out_dir), {"measure": which, **base, **load, "time": stamp, **row})


if __name__ == "__main__":
    main()
