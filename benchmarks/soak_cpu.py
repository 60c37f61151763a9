"""CPU soak: resident memory stays flat over 10,000 `PolicyVectorEnv.step()` calls of a tiny PI0.5.

One *step* is one ``PolicyVectorEnv.step()`` call (``step(None)``): one ``policy.act()`` on the N observations
plus C sub-steps of every sub-env (frozen/autoreset bookkeeping, episode statistics, final values included).
The env is the non-rendering scripted env (`wrappers.adapters.scripted`, 8x8 images, episodes of 7 and 12
steps so resets happen every few chunks); the policy is `Pi05Config.tiny()` with random weights and the
locally built stand-in tokenizer, sampling with its rollout method (``sde``), so every code path of a PPO
rollout runs. Resident memory (psutil, else ``VmRSS`` from /proc/self/status) is read after step 1,000
(warm-up done: allocator pools and caches filled) and after the last step; the growth must be <= 50 MB.

    python -m benchmarks.soak_cpu                      # 10,000 steps, appends to benchmarks/results/soak.jsonl
    python -m benchmarks.soak_cpu --steps 2000 --checkpoint 500 --out /tmp/soak

Exit status 1 when the growth exceeds the limit (the row is written either way).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
import warnings
from pathlib import Path

from benchmarks.common import write_rows
from policies.pi05.config import Pi05Config
from policies.pi05.policy import Pi05Policy
from policies.pi05.tokenizer import build_standin_tokenizer
from wrappers import PolicyVectorEnv
from wrappers.adapters.scripted import make_scripted_env

BENCH = "soak"
LIMIT_MB = 50.0


def rss_mb() -> float:
    """Resident set size of this process in MB (10**6 bytes)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss / 1e6
    except ImportError:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("cannot read resident memory: install psutil or run on Linux")


def soak(steps: int = 10_000, num_envs: int = 2, action_chunk: int = 5, checkpoint: int = 1_000,
         log_every: int = 1_000) -> dict:
    """Runs `steps` wrapper steps; returns the JSONL row (RSS in MB at `checkpoint` and at the end)."""
    warnings.simplefilter("ignore")  # the random policy has no state statistics: one warning, not the point here
    tokenizer = build_standin_tokenizer(tempfile.mkdtemp(prefix="soak_tok_"))
    policy = Pi05Policy.from_config(
        Pi05Config.tiny(), action_dim=3, seed=0, tokenizer=str(tokenizer), camera_map={"image": "base_0_rgb"}
    )
    env = PolicyVectorEnv(make_scripted_env(num_envs, episode_lengths=(7, 12)), policy, action_chunk=action_chunk)
    env.reset(seed=0)
    rss: dict[int, float] = {}
    episodes = 0
    start = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            _, _, terminated, truncated, _ = env.step()
            episodes += int(terminated.sum() + truncated.sum())
            if step == checkpoint or step == steps:
                gc.collect()
                rss[step] = rss_mb()
            if step % log_every == 0:
                print(f"step {step}: rss {rss_mb():.1f} MB, {time.perf_counter() - start:.0f} s", flush=True)
    finally:
        env.close()
    seconds = time.perf_counter() - start
    growth = rss[steps] - rss[checkpoint]
    return {
        "kind": "cpu",
        "step_definition": "one PolicyVectorEnv.step(None) call = 1 policy.act + action_chunk sub-steps per env",
        "steps": steps,
        "num_envs": num_envs,
        "action_chunk": action_chunk,
        "env_steps": steps * num_envs * action_chunk,
        "episodes": episodes,
        "policy": "Pi05Config.tiny(), random weights, stand-in tokenizer, method sde, K=5",
        f"rss_mb_at_{checkpoint}": round(rss[checkpoint], 2),
        f"rss_mb_at_{steps}": round(rss[steps], 2),
        "growth_mb": round(growth, 2),
        "limit_mb": LIMIT_MB,
        "passed": growth <= LIMIT_MB,
        "seconds": round(seconds, 1),
        "ms_per_step": round(seconds / steps * 1e3, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--num-envs", type=int, default=2)
    parser.add_argument("--action-chunk", type=int, default=5)
    parser.add_argument("--checkpoint", type=int, default=1_000, help="step after which the baseline RSS is read")
    parser.add_argument("--out", type=Path, default=None, help="folder for soak.jsonl (default: results/)")
    args = parser.parse_args()
    if not 1 <= args.checkpoint < args.steps:
        parser.error(f"--checkpoint: expected 1 <= checkpoint < steps ({args.steps}), got {args.checkpoint}")
    row = write_rows(BENCH, [soak(args.steps, args.num_envs, args.action_chunk, args.checkpoint)], args.out)[0]
    if not row["passed"]:
        print(f"FAIL: resident memory grew {row['growth_mb']} MB > {LIMIT_MB} MB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
