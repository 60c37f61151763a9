"""Same 16 observations, seeds and env ids: one batch-16 call against two batch-8 calls (what G=1 and G=2 run).

    python -m benchmarks.bench_batch_invariance [--out DIR]   # tiny and full size on a GPU, tiny only on CPU

The initial noise of the chains must match bitwise (same per-env streams); the actions differ only by the
batch-shape-dependent rounding of the replayed graphs (GEMM kernels are chosen per shape).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import build_pi05, run_cli, write_rows

BENCH = "batch_invariance"


def run(out: Path | None = None, n: int = 16) -> list[dict[str, Any]]:
    """One row per config (tiny, and base on CUDA); appends to ``batch_invariance.jsonl``."""
    rng = np.random.default_rng(0)
    obs = {
        "images": {"image": rng.integers(0, 256, (n, 224, 224, 3), dtype=np.uint8)},
        "state": rng.uniform(-1, 1, (n, 23)).astype(np.float32),
        "task": tuple(f"push the puck to goal {i}" for i in range(n)),
    }

    def part(lo: int, hi: int) -> dict[str, Any]:
        return {"images": {"image": obs["images"]["image"][lo:hi]}, "state": obs["state"][lo:hi],
                "task": obs["task"][lo:hi]}  # fmt: skip

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    half = n // 2
    rows = []
    for config_name in ("tiny", "base") if device.type == "cuda" else ("tiny",):
        policy = build_pi05(config_name, device, {"image": "base_0_rgb"}, [half, n], 5, 10, 2, state_dim=23)
        full = policy.act(obs, seeds=list(range(n)), env_ids=list(range(n)), action_chunk=2)
        parts = [policy.act(part(lo, lo + half), seeds=list(range(lo, lo + half)), env_ids=list(range(lo, lo + half)),
                            action_chunk=2) for lo in (0, half)]  # fmt: skip

        def cat(name: str, parts: list[Any] = parts) -> torch.Tensor:
            return torch.cat([getattr(p, name) for p in parts]).float()

        actions, chains = full.actions.float(), full.chains.float()
        rows += write_rows(BENCH, [{
            "config": config_name, "dtype": str(policy.model.compute_dtype),
            "initial_noise_equal": bool(torch.equal(chains[:, 0], cat("chains")[:, 0])),
            "actions_max_abs_diff": float((actions - cat("actions")).abs().max()),
            "actions_max_abs": float(actions.abs().max()),
            "chain_max_abs_diff_per_step": [float(d) for d in (chains - cat("chains")).abs().amax((0, 2, 3))],
            "log_prob_max_abs_diff": float((full.log_prob.float() - cat("log_prob")).abs().max()),
        }], out)  # fmt: skip
        policy.close()
        del policy
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
