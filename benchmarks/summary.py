"""Regenerate ``benchmarks/results/SUMMARY.md``: the latest row of every case of every benchmark JSONL.

    python -m benchmarks.summary                    # rewrite SUMMARY.md from benchmarks/results/*.jsonl
    python -m benchmarks.summary --merge DIR        # first append DIR/<bench>.jsonl (a GPU run's $OUT) to results/
    python -m benchmarks.summary --check            # exit 1 if SUMMARY.md is not what the rows give

Each ``results/<bench>.jsonl`` is append-only, oldest row first, so the latest row of a case is its last one. A
benchmark that measures several things tells its rows apart by a ``kind`` field, and each kind is its own table
(`TABLES` key ``"<bench>.<kind>"``). A case is the GPU plus the fields `TABLES` names for that table; the table
shows the fields `TABLES` picks (a table missing from `TABLES` shows its ``case`` field and its first numeric
fields).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, append_jsonl


@dataclass(frozen=True)
class Table:
    """How one benchmark's rows are summarised."""

    case: tuple[str, ...]
    """Fields (dotted for nested dicts) that together with ``gpu`` identify a case."""
    metrics: tuple[str, ...]
    """Fields shown for the latest row of each case."""


TABLES: dict[str, Table] = {
    "policy": Table(
        ("case", "method", "value_source", "batch", "fused_kernels", "attention", "blas_library"),
        ("p50_ms", "samples_per_s", "prefix_ms_p50", "denoise_ms_p50", "achieved_tflops", "peak_mem_gib"),
    ),
    "model_eager": Table(("backend", "batch"), ("p50_ms", "peak_mem_gib", "finite", "status")),
    "startup": Table(("path",), ("total_s", "make_policy_s", "captures_at_start", "first_act_s", "to_first_action_s",
                                 "graphs", "peak_mem_gib_batch64_3cam")),
    "policy.public": Table(("case", "batch"), ("public_ms_p50", "harness_ms_p50", "host_ms", "public_over_harness",
                                               "prompt_tokens")),
    "batch_invariance": Table(("config",), ("initial_noise_equal", "actions_max_abs_diff", "log_prob_max_abs_diff")),
    "gpu_suite.cuda_tests": Table((), ("returncode", "summary")),
    "cli": Table(("measure",), ("results.help_s_p50", "results.cached_call_s_p50", "results.wall_s")),
    "gpu_suite": Table(("section",), ("status", "seconds")),
    "expert_attention": Table(("case", "batch"), ("keys", "sdpa_us", "gemm_us")),
    "attention_backend": Table(
        ("site", "case", "env_batch", "backend", "splits", "block_n"),
        ("status", "kernel", "max_rel_err", "us_per_call", "timing"),
    ),
    "profile": Table(
        ("case", "batch", "stage", "mode"), ("wall_ms", "kernel_ms", "kernels_per_call", "device_busy_ms", "lead_ms")
    ),
    "prefix_parts": Table(("part", "case", "variant"), ("us_per_call", "tflops", "tb_per_s")),
    "attention_variants": Table(
        ("site", "case", "env_batch", "variant", "block_m", "block_n", "num_stages"),
        ("us_per_call", "tflops", "routed", "max_rel_err", "status"),
    ),
    "expert_kernels": Table(
        ("case", "batch", "fused_kernels"),
        ("kernels_per_layer_step", "prefix_kernels_per_layer", "denoise_kernels_per_step_outside_layers"),
    ),
    "expert_kernels.check": Table(("case", "batch"), ("chains_max_abs_diff", "chains_max_abs", "graph_equals_eager")),
    "processor": Table(("device", "config.resize_mode", "batch"), ("p50_ms", "p90_ms", "samples_per_s")),
    "wrapper_overhead": Table(
        ("config.model", "config.cameras", "batch"),
        ("act_inputs_ms_p50", "wrapper_step_ms_p50", "processor_ms", "overhead_frac"),
    ),
    "cpu_sim_env_only": Table(
        ("env", "workers", "vectorization", "render", "image_size", "chunk", "mujoco_gl", "shadow_size"),
        ("env_steps_per_s", "on_demand_speedup"),
    ),
    "batched_sim.env_only": Table(
        ("task", "num_envs", "cameras", "image_size", "render"),
        ("env_steps_per_s", "step_ms_p50", "render_ms_p50", "images_per_s"),
    ),
    "batched_sim.rollout": Table(
        ("task", "config", "num_envs", "chunk", "cameras", "image_size"),
        ("env_steps_per_s", "policy_ms_p50", "sim_ms_p50", "render_ms_p50", "simulator_share",
         "policy_alone_env_steps_per_s"),
    ),
    "batched_sim.startup": Table(("task", "image_size", "kernel_cache"), ("first_step_s", "constructor_s")),
    "batched_sim.ppo": Table(
        ("task", "config", "num_envs", "chunk", "num_steps"),
        ("iterations", "finite", "rollout_s_mean", "update_s_mean", "sync_s_mean", "approx_kl_mean", "clipfrac_mean"),
    ),
    "batched_sim.eval": Table(("task", "policy", "episodes"), ("success_rate", "mean_return", "mean_length")),
    "cpu_sim_loop": Table(
        ("policy", "device", "env", "workers", "vectorization", "groups", "render", "image_size", "chunk", "mujoco_gl",
         "shadow_size"),
        ("env_steps_per_s", "on_demand_speedup", "policy_ms_per_chunk", "env_ms_per_chunk", "policy_share"),
    ),
    "wrapper_overlap": Table(
        ("config.policy", "config.num_envs", "config.action_chunk"),
        ("speedup.G2_over_G1", "speedup.G2_prefetch_over_G1", "speedup.G2_prefetch_env1_over_G1"),
    ),
    "weight_sync": Table(("config", "subset", "case"), ("p50_ms", "p90_ms", "ratio", "GB_per_s")),
    "weight_sync.phases": Table(
        ("config", "expected"), ("begin_ms", "update_ms", "finish_ms", "sync_after_ms", "total_ms")
    ),
    "weight_sync.profile": Table(("config", "source", "subset"), ("wall_ms_per_sync", "gpu_busy_ms_per_sync")),
    "weight_sync.host_overhead": Table(("label",), ("p50_ms_after", "p90_ms_after")),
    "weight_broadcast": Table(
        ("config", "bucket_bytes", "high_priority"),
        ("broadcast_weights_p50_ms", "raw_broadcast_p50_ms", "ratio_to_raw"),
    ),
    "soak.cpu": Table(("steps", "num_envs"), ("growth_mb", "limit_mb", "ms_per_step", "passed")),
    "soak.gpu": Table(
        ("config", "batch"), ("memory_growth_bytes", "captures_before", "captures_after", "ms_per_step", "passed")
    ),
    "lerobot_baseline": Table(("case", "batch"), ("p50_ms", "samples_per_s", "peak_mem_gib", "error")),
    "ppo_example": Table(("case",), ("iteration", "sps", "time_rollout", "time_train", "time_sync", "approx_kl")),
    "ppo_curves": Table(("case", "seed"), ("iteration", "success_rate", "final_stochastic", "final_deterministic")),
    "ppo.update": Table(("trainer", "setting", "minibatch"), ("samples_per_s", "minibatch_ms_p50", "peak_mem_gib",
                                                             "kernels_per_minibatch")),
    "update0_ratio": Table(("trainer", "setting", "batch", "check"),
                           ("mean_abs_log_ratio", "max_abs_log_ratio", "clip_fraction", "approx_kl")),
    "ppo.act_public": Table(("setting", "declared", "batch"),
                            ("samples_per_s", "p50_ms", "ratio_to_64", "bucket", "first_act_s")),
    "ppo.iteration": Table(
        ("config", "env", "flags", "concurrent_runs", "seed"),
        ("iteration_s_p50", "rollout_s_p50", "update_s_p50", "sync_s_p50", "final_success_deterministic",
         "max_abs_diff_non_time_columns"),
    ),
    "ppo.seeds": Table(("config", "flags", "iterations", "seeds"),
                       ("mean_deterministic", "final_success_deterministic", "mean_stochastic", "episodes_each",
                        "concurrent_runs", "failed_seeds")),
    "real_task_rl": Table(("env", "config", "settings.learning_rate", "settings.group_size", "settings.ppo_trainable",
                           "demos", "iterations", "seed"),
                          ("sft_success", "sft_ci", "ppo_success", "ppo_ci", "gain_points", "intervals_overlap",
                           "eval_episodes")),
    "libero_gpu_rollout": Table(("suite", "protocol", "policy", "num_envs", "groups", "render"),
                                ("env_steps_per_s", "policy_ms_per_chunk", "env_ms_per_chunk", "policy_share")),
    "ppo_health": Table(("config", "env", "action_chunk", "lr", "target_kl", "logprob_reduction", "flags", "iterations",
                         "seed"),
                        ("approx_kl_mean", "approx_kl_chunk_mean", "clipfrac_mean", "explained_variance", "healthy",
                         "success_deterministic")),
}
"""Case and shown fields per benchmark, or per ``"<bench>.<kind>"`` (add a line with a new benchmark)."""

BENCHES = frozenset(name.split(".")[0] for name in TABLES)
"""The benchmarks ``results/`` may hold a JSONL of."""

ENV_FIELDS = ("bench", "gpu", "gpu_count", "torch", "commit", "date", "host", "torch_threads")


def field(row: dict[str, Any], name: str) -> Any:
    """`row[name]`, following dots into nested dicts (None where a part is missing)."""
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def cell(value: Any) -> str:
    """A table cell: 4 significant digits for floats, short strings, blank for None."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    text = value if isinstance(value, str) else json.dumps(value)
    text = text.replace("|", "/").replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


def table_for(bench: str, rows: list[dict[str, Any]]) -> Table:
    """The registered `Table`, or one from the rows' ``case`` field and first numeric fields."""
    if bench in TABLES:
        return TABLES[bench]
    case = ("case",) if any("case" in r for r in rows) else ()
    numeric = [k for k, v in rows[-1].items() if k not in ENV_FIELDS + case and isinstance(v, (int, float))]
    return Table(case, tuple(numeric[:8]))


def latest(rows: list[dict[str, Any]], table: Table) -> list[dict[str, Any]]:
    """The last row of each case (GPU + case fields), in the order the cases first appeared."""
    last: dict[str, dict[str, Any]] = {}
    for row in rows:
        key = json.dumps([row.get("gpu"), *(field(row, name) for name in table.case)])
        last.pop(key, None)
        last[key] = row
    return sorted(last.values(), key=lambda r: [_order(r.get("gpu")), *(_order(field(r, n)) for n in table.case)])


def _order(value: Any) -> tuple[int, float, str]:
    """Sort key: numbers by value before everything else by text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, cell(value))


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON rows of one JSONL file (blank lines skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def render(results: Path = RESULTS) -> str:
    """SUMMARY.md for every ``*.jsonl`` under `results`."""
    lines = [
        "# Benchmark results: latest row per case",
        "",
        "Generated by `python -m benchmarks.summary` from `benchmarks/results/<bench>.jsonl`; do not edit by hand.",
        "Each JSONL is append-only (oldest first); every row has the full configuration, `gpu`, `torch` and",
        "`commit`. What the numbers mean and where the time goes: `benchmarks/README.md`.",
    ]
    for path in sorted(results.glob("*.jsonl")):
        rows = read_rows(path)
        if not rows:
            continue
        lines += ["", f"## {path.stem} (`{path.name}`, {len(rows)} rows)"]
        kinds = list(dict.fromkeys(row.get("kind") for row in rows))  # in the order they first appear
        for kind in kinds:
            part = [row for row in rows if row.get("kind") == kind]
            name = path.stem if kind is None else f"{path.stem}.{kind}"
            if len(kinds) > 1:
                lines += ["", f"### {name} ({len(part)} rows)"]
            lines += _table(table_for(name, part), part)
    return "\n".join(lines) + "\n"


def _table(table: Table, rows: list[dict[str, Any]]) -> list[str]:
    """The markdown lines of one table: the latest row of each case."""
    header = ["gpu", *table.case, *table.metrics, "commit"]
    lines = ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in latest(rows, table):
        values = [row.get("gpu"), *(field(row, n) for n in (*table.case, *table.metrics))]
        values.append(str(row.get("commit", ""))[:7])
        lines.append("| " + " | ".join(cell(v) for v in values) + " |")
    return lines


def merge(source: Path, results: Path = RESULTS) -> list[str]:
    """Append the rows of every ``source/<bench>.jsonl`` to ``results/<bench>.jsonl``; returns the benches merged."""
    merged = []
    for path in sorted(source.glob("*.jsonl")):
        rows = read_rows(path)
        if rows:
            append_jsonl(results / path.name, rows)
            merged.append(path.stem)
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--merge", type=Path, default=None, help="folder of <bench>.jsonl files to append first")
    parser.add_argument("--check", action="store_true", help="only check that SUMMARY.md is up to date")
    parser.add_argument("--results", type=Path, default=RESULTS, help="results folder (default: benchmarks/results)")
    args = parser.parse_args(argv)
    summary = args.results / "SUMMARY.md"
    if args.check:
        if not summary.exists() or summary.read_text() != render(args.results):
            print(f"{summary} is stale: run `python -m benchmarks.summary`", file=sys.stderr)
            return 1
        return 0
    if args.merge is not None:
        print("merged:", ", ".join(merge(args.merge, args.results)) or "nothing")
    summary.write_text(render(args.results))
    print(f"wrote {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
