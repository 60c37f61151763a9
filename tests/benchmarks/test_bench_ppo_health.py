"""benchmarks/bench_ppo_health.py: one ppo_health row per run, its means over the curve, extra example flags."""

from __future__ import annotations

import json

from benchmarks import bench_ppo_health


def test_one_short_run_gives_one_row_with_the_means_and_the_flags(tmp_path):
    bench_ppo_health.main(["--env", "target", "--iterations", "2", "--num-envs", "4", "--num-steps", "2",
                           "--reductions", "element", "--flags", "--update-epochs 2 --norm-reward",
                           "--out", str(tmp_path)])  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "ppo_health.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert (row["bench"], row["env"], row["logprob_reduction"], row["iterations"]) == ("ppo_health", "target",
                                                                                        "element", 2)  # fmt: skip
    assert (row["update_epochs"], row["norm_reward"], row["flags"]) == (2, True, "--update-epochs 2 --norm-reward")
    assert row["approx_kl_first"] == 0.0  # the trainer recomputes the rollout's log-probs
    assert row["healthy"] == (row["approx_kl_mean"] <= 0.05 and row["clipfrac_mean"] <= 0.3)
