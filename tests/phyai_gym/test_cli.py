from __future__ import annotations

import pytest

from phyai_gym.cli import build_parser, main


def test_run_scripted_prints_table_and_summary(capsys):
    assert main(["run", "--env", "scripted", "--num-envs", "2", "--chunks", "3", "--action-chunk", "4"]) == 0
    out = capsys.readouterr().out
    assert "log-prob" in out and "|action|" in out and "summary: 3 chunks, 24 env steps" in out


@pytest.mark.slow
def test_run_pusher_default_env(capsys):
    assert main(["run", "--num-envs", "4", "--chunks", "1", "--action-chunk", "2", "--image-size", "32"]) == 0
    assert "env=Pusher-v5 num_envs=4" in capsys.readouterr().out


def test_parser_requires_a_command():
    with pytest.raises(SystemExit):
        build_parser().parse_args([])
