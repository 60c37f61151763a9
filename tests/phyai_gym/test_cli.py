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
    assert "--preset: invalid choice: 'nope'" in err and "openpi_pi05_libero" in err


def test_preset_choices_are_the_known_presets():
    from phyai_gym.run import PRESETS
    from policies.pi05.presets import list_presets

    assert PRESETS == tuple(list_presets())  # spelled in phyai_gym.run so that --help imports no torch


@pytest.mark.parametrize("command", ["run", "eval"])
def test_help_shows_defaults_and_choices(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "N, sub-envs (default: 4)" in out and "one worker process per sub-env" in out
    assert "(default: async for MuJoCo envs under a CUDA policy, else sync)" in out
    assert "openpi_pi05_libero, lerobot_pi05" in out
    if command == "eval":
        assert "openpi_libero, lerobot_libero" in out and "--episodes 2 plans 20 episodes" in out
    else:
        assert "(default: Pusher-v5)" in out


# Issue 43, point 1: the `next:` line's commands run as written.
def test_run_next_line_eval_command_runs_as_written(capsys, tmp_path, monkeypatch):
    import shlex

    from phyai_gym.run import RunConfig, next_steps

    assert main(["run", "--env", "scripted", "--num-envs", "2", "--chunks", "1"]) == 0
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith("next:")
    command = last.split("`")[1]
    assert command.startswith("phyai-gym eval --env scripted ")
    assert "--env Pusher-v5 " in next_steps(RunConfig())  # the default env is named too: eval has none
    monkeypatch.chdir(tmp_path)  # --out runs/demo is relative
    assert main(shlex.split(command)[1:]) == 0
    assert "episodes: complete" in capsys.readouterr().out and (tmp_path / "runs/demo/episodes.jsonl").is_file()


# Issue 43, point 2: a preset without a checkpoint is refused before the first step, naming both.
def test_preset_without_checkpoint_is_refused_naming_preset_and_checkpoint(capsys):
    err = _error(capsys, ["run", "--env", "scripted", "--preset", "openpi_pi05_libero", "--chunks", "1"])
    assert "--preset openpi_pi05_libero: the preset's state has 8 dims, but --env scripted gives 4" in err
    assert "no --checkpoint was given" in err and "Fix: add --checkpoint DIR" in err
    assert "Traceback" not in err and "chunks" not in err  # refused before the progress bar exists


def test_an_error_in_the_chunk_loop_closes_the_bar_first(capsys, monkeypatch):
    run_module = sys.modules["phyai_gym.run"]  # `phyai_gym.run` the attribute is the function

    def fail(*args, **kwargs):
        raise ValueError("obs['state']: broken")

    monkeypatch.setattr(run_module, "table_row", fail)
    err = _error(capsys, ["run", "--env", "scripted", "--num-envs", "2", "--chunks", "3"])
    assert err.rstrip().splitlines()[-1] == "phyai-gym run: error: obs['state']: broken"  # on its own line, last


# Issue 43, point 7: Ctrl-C during `run` exits 130 with one line, no traceback.
def test_run_ctrl_c_exits_with_a_message(capsys, monkeypatch):
    run_module = sys.modules["phyai_gym.run"]  # `phyai_gym.run` the attribute is the function

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "table_row", interrupt)
    assert main(["run", "--env", "scripted", "--num-envs", "2", "--chunks", "3"]) == 130
    err = capsys.readouterr().err
    last = err.rstrip().splitlines()[-1]
    assert last == "phyai-gym run: interrupted (Ctrl-C); run writes no files, so nothing is lost."
    assert "Traceback" not in err


@pytest.mark.slow
def test_run_ctrl_c_in_a_terminal_prints_no_traceback():
    import signal
    import time

    # as in a terminal: a suite started in the background of a non-interactive shell ignores SIGINT, and a child
    # inherits that (Python then keeps ignoring it), so the child gets the default disposition back
    proc = subprocess.Popen(
        [sys.executable, "-m", "phyai_gym.cli", "run", "--env", "scripted", "--num-envs", "2", "--chunks", "100000"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        line = ""
        while "loading the simulator" not in line:  # the handler is running: Ctrl-C now hits the run
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
        time.sleep(3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "interrupted (Ctrl-C)" in err


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


# Issue 43, point 5: fewer --episodes than the folder holds is refused (before the policy is built).
def test_eval_fewer_episodes_than_the_folder_holds_is_refused_up_front(capsys, tmp_path, monkeypatch):
    run_module = sys.modules["phyai_gym.run"]  # `phyai_gym.run` the attribute is the function

    assert main([*EVAL, "--out", str(tmp_path)]) == 0
    capsys.readouterr()

    def never(*args, **kwargs):
        raise AssertionError("the policy was built before the resume check")

    monkeypatch.setattr(run_module, "build_policy", never)
    argv = list(EVAL)
    argv[argv.index("--episodes") + 1] = "3"
    err = _error(capsys, [*argv, "--out", str(tmp_path)])
    assert "--episodes: " in err and "already holds episodes up to 10 per task" in err
    assert "Fix: pass --episodes 10 or more" in err and "Traceback" not in err
    err = _error(capsys, [*EVAL, "--out", str(tmp_path), "--seed", "5"])  # point 9: refused before the build too
    assert "field(s) seed" in err


def test_eval_bar_counts_env_steps_every_chunk(capsys, tmp_path):
    from phyai_gym.evaluation import evaluate_success
    from phyai_gym.make import make_env
    from policies.baseline import GaussianPolicy
    from wrappers import PolicyVectorEnv

    class Bar:
        def __init__(self, total, initial, unit):
            self.total, self.n, self.unit, self.updates, self.postfix = total, initial, unit, [], ""

        def update(self, k):
            self.n += k
            self.updates.append(k)

        def set_postfix_str(self, text):
            self.postfix = text

        def close(self):
            pass

    bars = []
    env = PolicyVectorEnv(make_env("scripted", 2, episode_lengths=(7, 12)), GaussianPolicy(3, action_horizon=5), 5)
    result = evaluate_success(env, 3, progress=lambda **kw: bars.append(Bar(**kw)) or bars[-1], episode_limit=20)
    env.close()
    bar = bars[0]
    assert bar.unit == "step" and len(bar.updates) > len(result.rows)  # advances per chunk, not per episode
    assert bar.n == bar.total == sum(r["length"] for r in result.rows)  # the plan shrank to what ran
    assert bar.postfix == "episodes 3/3"
    assert "plan: 1 task(s) x 3 episodes per task = 3 episodes" in capsys.readouterr().out


# Issue 43, point 6: an env without a success flag reports n/a, not a measured 0.
def test_summary_without_success_flag_is_not_a_rate():
    import math

    from phyai_gym.evaluation import summarize

    rows = [{"task": "t", "success": None, "success_once": None, "success_at_end": None, "return": 1.0, "length": 3}]
    (task,), overall = summarize(rows, ["t"])
    assert math.isnan(overall.success_rate) and math.isnan(overall.ci_low) and math.isnan(task.success_once)
    assert overall.mean_return == 1.0


@pytest.mark.slow
def test_eval_on_pusher_reports_no_success_rate(capsys, tmp_path):
    argv = ["eval", "--env", "Pusher-v5", "--policy", "tiny", "--num-envs", "2", "--episodes", "2", "--image-size"]
    argv += ["32", "--max-episode-steps", "5", "--action-chunk", "5", "--out", str(tmp_path)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "success: n/a -- Pusher-v5 reports no success flag" in captured.out
    overall = captured.out.split("\noverall")[1].splitlines()[0].split()
    assert overall[1:4] == ["n/a", "n/a", "n/a"]  # success, its interval, once (then at end, return, length)
    assert "0.000 [" not in captured.out and not (tmp_path / "success.png").exists()
    assert all(r["success"] is None for r in _rows(tmp_path / "episodes.jsonl")[1])
    assert "Traceback" not in captured.err


@pytest.mark.slow
def test_eval_on_mujoco_with_episode_limit(capsys, tmp_path):
    argv = ["eval", "--env", "Pusher-v5", "--policy", "tiny", "--num-envs", "2", "--episodes", "3", "--image-size"]
    argv += ["32", "--max-episode-steps", "10", "--action-chunk", "5", "--out", str(tmp_path)]
    assert main(argv) == 0
    header, rows = _rows(tmp_path / "episodes.jsonl")
    assert header["episode_limit"] == 10 and len(rows) == 3 and all(r["length"] == 10 for r in rows)


@pytest.mark.slow
def test_eval_in_groups_equals_one_group_episode_for_episode(capsys, tmp_path):
    """Two env groups with speculative calls (the CUDA default for MuJoCo) give the same episodes as one group."""
    argv = ["eval", "--env", "Pusher-v5", "--policy", "tiny", "--num-envs", "4", "--episodes", "6", "--image-size"]
    argv += ["32", "--max-episode-steps", "10", "--action-chunk", "3", "--stochastic", "--vectorization", "async"]
    results = {}
    for groups in (1, 2):
        assert main([*argv, "--groups", str(groups), "--out", str(tmp_path / str(groups))]) == 0
        results[groups] = [{k: v for k, v in r.items() if k != "slot"} for r in _rows(tmp_path / str(groups) /
                                                                                       "episodes.jsonl")[1]]
    assert len(results[1]) == 6 and results[2] == results[1]


def test_default_groups_overlap_mujoco_under_a_cuda_policy_only():
    from phyai_gym.run import RunConfig

    assert RunConfig(env="Pusher-v5", device="cuda").resolved_groups() == 2
    assert RunConfig(env="Pusher-v5", device="cuda").resolved_vectorization() == "async"
    assert RunConfig(env="Pusher-v5", device="cuda", vectorization="sync").resolved_groups() == 1
    assert RunConfig(env="Pusher-v5", device="cpu").resolved_groups() == 1  # policy and sim would share the cores
    assert RunConfig(env="Pusher-v5", device="cuda", num_envs=1).resolved_groups() == 1
    assert RunConfig(env="scripted", device="cuda").resolved_groups() == 1
    assert RunConfig(env="Pusher-v5", device="cuda", groups=3).resolved_groups() == 3
    assert RunConfig(env="Pusher-v5").resolved_vectorization() is None  # the env's own default (sync)
    assert RunConfig(env="libero_spatial", device="cuda").resolved_vectorization() == "async"
    assert RunConfig(env="libero_spatial", device="cuda").resolved_groups() == 1  # task i follows env index i
    assert RunConfig(env="libero_spatial", device="cpu").resolved_vectorization() is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--env", "libero_spatial", "--groups", "2"], "--groups 2: --env libero_spatial (libero) runs in one group"),
        (["--num-envs", "2", "--groups", "3", "--vectorization", "async"], "expected <= --num-envs (2), got 3"),
        (["--env", "Pusher-v5", "--groups", "0"], "--groups: expected >= 1, got 0"),
        (["--env", "Pusher-v5", "--groups", "2"], "--groups 2 needs --vectorization async"),
    ],
)
def test_bad_groups_are_refused_before_anything_is_built(capsys, argv, message):
    with pytest.raises(SystemExit):
        main(["run", *argv])
    assert message in capsys.readouterr().err


def test_eval_video_with_groups_is_refused(capsys, tmp_path):
    argv = ["eval", "--env", "Pusher-v5", "--policy", "tiny", "--groups", "2", "--video", "1", "--episodes", "1"]
    argv += ["--vectorization", "async"]
    with pytest.raises(SystemExit):
        main([*argv, "--out", str(tmp_path)])
    assert "--video records one vector env, --groups 2 asks for several" in capsys.readouterr().err
