"""benchmarks/bench_ppo.py's `bench_seeds`: several seeds of the PPO example, one spawned process each, two at a time.

The tiny config on the CPU (the GPU run is `--config base --device cuda`); what is checked is the bookkeeping:
one ``iteration`` row per seed (in ppo.jsonl), written by the parent alone, an error row for a seed whose run
fails (the others keep theirs), and a ``seeds`` row whose means are those of the seeds that finished.
"""

import inspect

import numpy as np
import pytest

from benchmarks import bench_ppo, summary

FLAGS = ("--num-envs", "4", "--eval-episodes", "8", "--quiet")


def test_bench_seeds_runs_each_seed_and_writes_their_mean(tmp_path):
    # seed -1 fails inside its child (np.random.seed refuses it) after starting like the others
    result = bench_ppo.bench_seeds(tmp_path, seeds=(3, 5, -1), flags=FLAGS, iterations=1, config="tiny", device="cpu")

    written = summary.read_rows(tmp_path / "ppo.jsonl")
    assert {r["bench"] for r in written} == {"ppo"}
    rows = [r for r in written if r["kind"] == "iteration"]
    assert sorted(r["seed"] for r in rows) == [3, 5]
    for row in rows:
        assert row["config"] == "tiny" and row["iterations"] == 1
        assert row["concurrent_runs"] == 2 and row["flags"] == " ".join(FLAGS) and row["eval_episodes"] == 8
        assert 0.0 <= row["final_success_deterministic"] <= 1.0
        assert (tmp_path / f"ppo_seed{row['seed']}.csv").exists()  # each run its own curve
    (error,) = [r for r in written if r["kind"] == "iteration_error"]
    assert error["seed"] == -1 and "ValueError" in error["error"] and error["concurrent_runs"] == 2

    (seeds_row,) = [r for r in written if r["kind"] == "seeds"]
    by_seed = {r["seed"]: r for r in rows}
    for mode in ("deterministic", "stochastic"):
        values = [by_seed[s][f"final_success_{mode}"] for s in (3, 5)]
        assert seeds_row[f"final_success_{mode}"] == [*values, None]
        assert seeds_row[f"mean_{mode}"] == float(np.mean(values))
    assert seeds_row["seeds"] == [3, 5, -1] and seeds_row["failed_seeds"] == [-1]
    assert seeds_row["episodes_each"] == 8 and seeds_row["concurrent_runs"] == 2
    assert seeds_row["flags"] == " ".join(FLAGS) and result["mean_deterministic"] == seeds_row["mean_deterministic"]


def test_the_ppo_section_does_not_run_the_seeds_by_default():
    assert "seeds" in bench_ppo.WHICH and "seeds" not in bench_ppo.DEFAULT
    assert inspect.signature(bench_ppo.run).parameters["which"].default == ("update", "ratio", "act", "iteration")


def test_bench_seeds_refuses_a_concurrency_below_one(tmp_path):
    with pytest.raises(ValueError, match=r"concurrent: expected an int >= 1, got 0\. Fix: pass e\.g\. 2\."):
        bench_ppo.bench_seeds(tmp_path, seeds=(1,), concurrent=0, config="tiny", device="cpu")
    assert not any(tmp_path.iterdir())  # refused before anything is written
