from __future__ import annotations

import pytest

from phyai_gym.env_table import END, README, START, env_row, readme_rows, table


def test_readme_rows_of_the_in_process_envs_match_the_adapters():
    rows = readme_rows(README.read_text(encoding="utf-8"))
    for name in ("scripted", "target"):
        assert rows[name] == env_row(name)


def test_readme_row_of_mujoco_matches_the_adapter():
    pytest.importorskip("mujoco")
    assert readme_rows(README.read_text(encoding="utf-8"))["Pusher-v5"] == env_row("Pusher-v5")


@pytest.mark.slow
def test_readme_env_table_matches_the_adapters():  # builds every listed env once (LIBERO, ManiSkill: minutes)
    text = README.read_text(encoding="utf-8")
    generated, missing = table(text)
    if missing:
        pytest.skip(f"simulators not installed for {missing}; their README rows are not checked")
    assert text.split(START, 1)[1].split(END, 1)[0].strip() == generated.strip(), (
        "README's env table is stale: run python -m phyai_gym.env_table --write"
    )
