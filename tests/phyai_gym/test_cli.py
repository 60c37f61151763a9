from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from phyai_gym.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_run_scripted_prints_table_and_summary(capsys):
    assert main(["run", "--env", "scripted", "--num-envs", "2", "--chunks", "3", "--action-chunk", "4"]) == 0
    out = capsys.readouterr().out
    assert "log-prob" in out and "|action|" in out and "summary: 3 chunks, 24 env steps" in out
    assert "RANDOM weights" in out and "STAND-IN tokenizer" in out  # the default policy is the tiny PI0.5


def test_run_gaussian_baseline_still_available(capsys):
    assert main(["run", "--env", "scripted", "--policy", "gaussian", "--num-envs", "2", "--chunks", "1"]) == 0
    assert "Gaussian baseline" in capsys.readouterr().out


@pytest.mark.slow
def test_run_pusher_tiny_pi05_few_chunks(capsys):
    args = ["run", "--num-envs", "4", "--chunks", "1", "--action-chunk", "2", "--image-size", "32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "env=Pusher-v5 num_envs=4" in out and "PI0.5 tiny()" in out and "summary: 1 chunks, 8 env steps" in out


@pytest.mark.slow
def test_run_true_default():  # its wall time is measured by benchmarks/bench_cli.py
    proc = subprocess.run(
        [sys.executable, "-m", "phyai_gym.cli", "run"], cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "env=Pusher-v5 num_envs=4" in proc.stdout and "episode_limit=100" in proc.stdout
    assert "summary: 20 chunks, 400 env steps" in proc.stdout and "finished episodes 4," in proc.stdout
    assert "columns: means over the N envs" in proc.stdout and proc.stdout.rstrip().splitlines()[-1].startswith("next:")
    assert "chunks" in proc.stderr  # the tqdm bar


def test_parser_requires_a_command():
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_unknown_env_is_refused_with_the_accepted_names(capsys):
    err = _error(capsys, ["run", "--env", "NoSuchEnv-v0"])
    assert "unknown env 'NoSuchEnv-v0'" in err and "Pusher-v5" in err and "libero_spatial" in err


def test_missing_checkpoint_folder(capsys, tmp_path):
    err = _error(capsys, ["run", "--env", "scripted", "--checkpoint", str(tmp_path / "nope")])
    assert "--checkpoint" in err and "no such folder" in err


def test_checkpoint_folder_without_weights(capsys, tmp_path):
    err = _error(capsys, ["eval", "--env", "scripted", "--checkpoint", str(tmp_path), "--episodes", "1"])
    assert "no model.safetensors" in err


def test_unknown_preset(capsys, tmp_path):
    err = _error(capsys, ["eval", "--env", "scripted", "--policy", "tiny", "--preset", "nope", "--episodes", "1"])
    assert "--preset 'nope' is unknown" in err and "openpi_pi05_libero" in err


def test_conflicting_options(capsys, tmp_path):
    err = _error(capsys, ["run", "--env", "scripted", "--checkpoint", str(tmp_path), "--policy", "tiny"])
    assert "conflicting options" in err and "--checkpoint" in err and "--policy" in err
    err = _error(capsys, ["eval", "--env", "scripted", "--policy", "tiny", "--episodes", "1", "--video", "2"])
    assert "conflicting options: --video needs --out" in err
    err = _error(capsys, ["eval", "--env", "scripted", "--policy", "tiny", "--episodes", "1", "--task-ids", "0"])
    assert "--task-ids applies to LIBERO" in err


def test_eval_without_checkpoint_or_policy(capsys):
    err = _error(capsys, ["eval", "--env", "scripted", "--episodes", "1"])
    assert "eval needs --checkpoint DIR" in err and "--policy tiny" in err


def test_missing_simulator_names_the_extra(capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_libero(name, *args, **kwargs):
        if name.startswith("wrappers.adapters.libero") or name == "libero" or name.startswith("libero."):
            raise ImportError("No module named 'libero'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_libero)
    monkeypatch.delitem(sys.modules, "wrappers.adapters.libero", raising=False)
    err = _error(capsys, ["run", "--env", "libero_spatial"])
    assert "phyai-gym[libero]" in err


EVAL = ["eval", "--env", "target", "--policy", "tiny", "--num-envs", "3", "--action-chunk", "1", "--episodes", "10"]


def _rows(path: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["type"] == "header"
    return lines[0], [r for r in lines[1:] if r["type"] == "episode"]


def test_eval_writes_jsonl_and_csv(capsys, tmp_path):
    assert main([*EVAL, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "95% CI (Wilson)" in out and "episodes: complete" in out
    header, rows = _rows(tmp_path / "episodes.jsonl")
    for key in ("checkpoint_sha256", "preset", "action_chunk", "episode_limit", "settle_steps", "seed", "commit"):
        assert key in header
    assert header["action_chunk"] == 1 and header["episode_limit"] == 1 and header["seed"] == 0
    assert sorted(r["episode_id"] for r in rows) == list(range(10))
    assert [r["seed"] for r in sorted(rows, key=lambda r: r["episode_id"])] == list(range(10))
    with open(tmp_path / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [t["task"] for t in table] == ["move to the target", "overall"]
    assert int(table[-1]["episodes"]) == 10
    assert float(table[-1]["ci_low"]) <= float(table[-1]["success_rate"]) <= float(table[-1]["ci_high"])


def test_eval_resumes_without_repeats_or_losses(capsys, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    assert main([*EVAL, "--out", str(full)]) == 0
    assert main([*EVAL, "--out", str(part), "--max-episodes-this-run", "4"]) == 0
    assert "partial (4/10" in capsys.readouterr().out
    _, first = _rows(part / "episodes.jsonl")
    assert len(first) == 4
    assert main([*EVAL, "--out", str(part)]) == 0  # resume
    header, resumed = _rows(part / "episodes.jsonl")
    ids = [r["episode_id"] for r in resumed]
    assert sorted(ids) == list(range(10)) and len(ids) == len(set(ids))  # no repeats, no losses
    _, reference = _rows(full / "episodes.jsonl")
    by_id = {r["episode_id"]: (r["success"], round(r["return"], 5)) for r in reference}
    assert {r["episode_id"]: (r["success"], round(r["return"], 5)) for r in resumed} == by_id  # same episodes
    assert main([*EVAL, "--out", str(part)]) == 0  # nothing left: no new rows
    assert len(_rows(part / "episodes.jsonl")[1]) == 10


def test_eval_resume_refuses_other_settings(capsys, tmp_path):
    assert main([*EVAL, "--out", str(tmp_path), "--max-episodes-this-run", "2"]) == 0
    err = _error(capsys, [*EVAL, "--out", str(tmp_path), "--seed", "5"])
    assert "holds episodes of a different run" in err and "seed" in err


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"--policy": "gaussian"}, "policy"),
        ({"--action-chunk": "2"}, "action_chunk"),
        ({"--max-episode-steps": "3"}, "episode_limit"),
        ({"--env": "scripted"}, "env"),
        ({"--protocol": "phyai", "--preset": "lerobot_pi05"}, "preset"),
    ],
    ids=lambda v: v if isinstance(v, str) else "+".join(v),
)
def test_eval_resume_names_the_differing_field(capsys, tmp_path, change, field):
    assert main([*EVAL, "--out", str(tmp_path), "--max-episodes-this-run", "1"]) == 0
    capsys.readouterr()
    argv = list(EVAL)
    for flag, value in change.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    err = _error(capsys, [*argv, "--out", str(tmp_path)])
    assert f"field(s) {field}" in err or f", {field}" in err, err
    assert "Episodes of two runs would be mixed" in err
    _, rows = _rows(tmp_path / "episodes.jsonl")
    assert len(rows) == 1  # the refused run wrote nothing


def test_eval_header_names_protocol_and_both_success_metrics(capsys, tmp_path):
    assert main([*EVAL, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "protocol: phyai (primary metric: success_once)" in out and "at end" in out
    header, rows = _rows(tmp_path / "episodes.jsonl")
    assert header["protocol"] == "phyai" and header["primary_metric"] == "success_once"
    assert all({"success_once", "success_at_end"} <= set(r) and r["success"] == r["success_once"] for r in rows)
    with open(tmp_path / "results.csv") as handle:
        assert {"success_once", "success_at_end"} <= set(next(csv.DictReader(handle)))


def test_eval_keyboard_interrupt_keeps_finished_episodes(capsys, tmp_path, monkeypatch):
    import phyai_gym.evaluation as evaluation

    calls = {"n": 0}
    real_dumps = evaluation.json.dumps

    def interrupt_after_three(obj, *args, **kwargs):
        if obj.get("type") == "episode":
            calls["n"] += 1
            if calls["n"] == 4:
                raise KeyboardInterrupt
        return real_dumps(obj, *args, **kwargs)

    monkeypatch.setattr(evaluation.json, "dumps", interrupt_after_three)
    assert main([*EVAL, "--out", str(tmp_path)]) == 130
    assert "run the same command again to resume" in capsys.readouterr().out
    monkeypatch.setattr(evaluation.json, "dumps", real_dumps)
    assert len(_rows(tmp_path / "episodes.jsonl")[1]) == 3
    assert main([*EVAL, "--out", str(tmp_path)]) == 0
    ids = [r["episode_id"] for r in _rows(tmp_path / "episodes.jsonl")[1]]
    assert sorted(ids) == list(range(10))


def test_eval_video_has_every_env_step_at_the_env_frame_rate(capsys, tmp_path):
    imageio = pytest.importorskip("imageio.v2")
    pytest.importorskip("imageio_ffmpeg")
    argv = ["eval", "--env", "scripted", "--policy", "tiny", "--num-envs", "2", "--action-chunk", "5"]
    assert main([*argv, "--episodes", "2", "--out", str(tmp_path), "--video", "1"]) == 0
    out = capsys.readouterr().out
    video = tmp_path / "videos" / "episode_00000.mp4"
    assert f"video:    {video}" in out
    length = {r["episode_id"]: r["length"] for r in _rows(tmp_path / "episodes.jsonl")[1]}[0]
    reader = imageio.get_reader(video)
    assert reader.count_frames() == length + 1  # the reset frame and one per env step (not one per chunk)
    assert reader.get_meta_data()["fps"] == 20.0  # the scripted env declares no render_fps: the default


def test_eval_resume_line_and_where_every_file_went(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    assert main([*EVAL, "--out", str(tmp_path), "--max-episodes-this-run", "4"]) == 0
    capsys.readouterr()
    assert main([*EVAL, "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert f"resuming: 4 of 10 episodes done ({tmp_path / 'episodes.jsonl'})" in captured.out
    assert "4/10" in captured.err and "10/10" in captured.err  # the bar starts at the resumed count, has a total
    for label, name in (("episodes", "episodes.jsonl"), ("results", "results.csv"), ("plot", "success.png")):
        assert f"{label + ':':<10}{tmp_path / name}" in captured.out
        assert (tmp_path / name).stat().st_size > 0


def test_eval_interrupt_message_is_not_on_the_bar(capsys, tmp_path, monkeypatch):
    import phyai_gym.evaluation as evaluation

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluation, "_seed_stream", interrupt)  # inside the episode loop, at the first new episode
    assert main([*EVAL, "--out", str(tmp_path)]) == 130
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1].startswith("interrupted; finished episodes are in ")
    assert "interrupted" not in captured.err


@pytest.mark.slow
def test_eval_on_mujoco_with_episode_limit(capsys, tmp_path):
    argv = ["eval", "--env", "Pusher-v5", "--policy", "tiny", "--num-envs", "2", "--episodes", "3", "--image-size"]
    argv += ["32", "--max-episode-steps", "10", "--action-chunk", "5", "--out", str(tmp_path)]
    assert main(argv) == 0
    header, rows = _rows(tmp_path / "episodes.jsonl")
    assert header["episode_limit"] == 10 and len(rows) == 3 and all(r["length"] == 10 for r in rows)
