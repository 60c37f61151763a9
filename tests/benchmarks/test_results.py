"""benchmarks/results/ is data: one JSONL per benchmark, a SUMMARY.md that matches the rows, no logs or traces."""

import json

from benchmarks import summary
from benchmarks.common import RESULTS, percentiles, write_rows


def test_results_folder_holds_only_jsonl_plots_and_the_summary():
    files = sorted(p.name for p in RESULTS.iterdir())
    assert [f for f in files if not f.endswith((".jsonl", ".png")) and f != "SUMMARY.md"] == []
    # one JSONL per benchmark the summary knows: no per-run files, no stray benchmark names
    assert [f for f in files if f.endswith(".jsonl") and f[: -len(".jsonl")] not in summary.BENCHES] == []


def test_every_row_names_its_benchmark_commit_and_gpu():
    for path in RESULTS.glob("*.jsonl"):
        for row in summary.read_rows(path):
            assert row["bench"] == path.stem, path.name
            assert row["commit"] and row["gpu"], (path.name, row)


def test_summary_md_is_what_the_rows_give():
    assert (RESULTS / "SUMMARY.md").read_text() == summary.render(RESULTS), "run `python -m benchmarks.summary`"


def test_summary_shows_the_latest_row_of_each_case(tmp_path):
    run = tmp_path / "run"
    write_rows("policy", [{"case": "a", "method": "ode", "value_source": "none", "batch": 1, "p50_ms": 40.0}], run,
               echo=False)  # fmt: skip
    write_rows("policy", [{"case": "a", "method": "ode", "value_source": "none", "batch": 1, "p50_ms": 30.0},
                          {"case": "b", "method": "ode", "value_source": "none", "batch": 8, "p50_ms": 50.0}], run,
               echo=False)  # fmt: skip
    results = tmp_path / "results"
    assert summary.merge(run, results) == ["policy"]
    rows = summary.read_rows(results / "policy.jsonl")
    assert [r["p50_ms"] for r in rows] == [40.0, 30.0, 50.0]
    text = summary.render(results)
    assert "| 30 |" in text and "| 50 |" in text and "| 40 |" not in text
    assert summary.main(["--results", str(results)]) == 0
    assert summary.main(["--results", str(results), "--check"]) == 0
    with (results / "policy.jsonl").open("a") as handle:
        handle.write(json.dumps({**rows[0], "p50_ms": 20.0}) + "\n")
    assert summary.main(["--results", str(results), "--check"]) == 1


def test_percentiles_are_nearest_rank():
    assert percentiles([5.0, 1.0, 3.0, 2.0, 4.0]) == (3.0, 5.0)
    assert percentiles(list(range(10))) == (5, 9)
