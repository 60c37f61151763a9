import json
import os

import pytest

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco is imported (Mesa renders it on CPU)
pytest.importorskip("mujoco")

from benchmarks import bench_cpu_sim  # noqa: E402


@pytest.mark.slow
def test_env_only_writes_one_row_per_render_mode(tmp_path):
    args = bench_cpu_sim.parse_args(
        ["--workers", "1", "--vectorization", "sync", "--image-size", "16", "--chunks", "1", "--rounds", "1",
         "--out", str(tmp_path)]
    )  # fmt: skip
    bench_cpu_sim.run(args)
    rows = [json.loads(line) for line in (tmp_path / "cpu_sim_env_only.jsonl").read_text().splitlines()]
    assert [row["render"] for row in rows] == ["every_step", "on_demand"]
    for row in rows:
        assert row["env"] == "Pusher-v5" and row["chunk"] == 5 and row["workers"] == 1
        assert row["env_steps"] == 5 and row["env_steps_per_s"] > 0
        assert {"gpu", "cpu", "torch", "commit", "mujoco_gl", "vectorization", "image_size"} <= row.keys()
