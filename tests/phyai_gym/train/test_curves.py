from __future__ import annotations

import importlib.util

import pytest

from phyai_gym.train.curves import CurveLog, main


def test_rows_are_on_disk_before_close_and_the_plot_comes_at_close(tmp_path):
    log = CurveLog(tmp_path / "curve.csv", total=3)
    log.log({"iteration": 1, "success_rate": float("nan"), "time_rollout": 1.0})
    log.log({"iteration": 2, "success_rate": 0.5, "time_rollout": 1.5})
    assert (tmp_path / "curve.csv").read_text().splitlines()[1:] == ["1,nan,1.0", "2,0.5,1.5"]  # a crash keeps them
    assert log.progress(2).startswith("iter 2/3 |") and "ETA" in log.progress(2)
    assert not (tmp_path / "curve.png").exists()
    files = log.close()
    plotted = importlib.util.find_spec("matplotlib") is not None
    assert files == [tmp_path / "curve.csv", *([tmp_path / "curve.png"] if plotted else [])]
    assert log.close() == files  # written once


def test_replot_a_csv(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "run.csv").write_text("iteration,global_step,approx_kl\n1,10,0.1\n2,20,0.05\n")
    assert main([str(tmp_path / "run.csv")]) == 0
    assert capsys.readouterr().out == f"plot: {tmp_path / 'run.png'}\n"


def test_total_must_be_positive():
    with pytest.raises(ValueError, match="CurveLog: total must be >= 1 \\(the planned iterations\\), got 0"):
        CurveLog(None, total=0)


def test_an_existing_csv_is_kept_aside_not_appended_to_or_overwritten(tmp_path):
    (tmp_path / "curve.csv").write_text("iteration,success_rate\n1,0.1\n2,0.2\n")  # an earlier (crashed) run
    (tmp_path / "curve.1.csv").write_text("iteration\n1\n")  # an even earlier one
    log = CurveLog(tmp_path / "curve.csv", total=2)
    assert (tmp_path / "curve.csv").exists() and log.kept is None  # nothing moves before the first row
    log.log({"iteration": 1, "success_rate": 0.5})
    log.close()
    assert log.kept == tmp_path / "curve.2.csv"
    assert log.kept.read_text() == "iteration,success_rate\n1,0.1\n2,0.2\n"
    assert (tmp_path / "curve.1.csv").read_text() == "iteration\n1\n"
    assert (tmp_path / "curve.csv").read_text().splitlines() == ["iteration,success_rate", "1,0.5"]


def test_resume_continues_the_csv_and_drops_rows_after_the_checkpoint(tmp_path):
    log = CurveLog(tmp_path / "curve.csv", total=4)
    for k in (1, 2, 3):  # iteration 3 logged, but the run died before its checkpoint
        log.log({"iteration": k, "approx_kl": 0.1 * k})
    log.close()
    log = CurveLog(tmp_path / "curve.csv", total=4, resume_after=2)
    log.log({"iteration": 3, "approx_kl": 0.5})
    log.close()
    assert (tmp_path / "curve.csv").read_text().splitlines() == ["iteration,approx_kl", "1,0.1", "2,0.2", "3,0.5"]
    assert [int(r["iteration"]) for r in log.rows] == [1, 2, 3] and log.kept is None


def test_tensorboard_missing_names_the_package(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(ImportError, match="pip install tensorboard"):
        CurveLog(tmp_path / "curve.csv", total=1, tensorboard=tmp_path / "tb")


def test_tensorboard_gets_every_numeric_column_at_its_global_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = CurveLog(None, total=2, tensorboard=tmp_path / "tb")
    log.log({"iteration": 1, "global_step": 64, "approx_kl": 0.02, "sps": 30.0, "time_rollout": 1.5, "note": "x"})
    log.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["charts/sps", "losses/approx_kl", "time/time_rollout"]
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("losses/approx_kl")] == [(64, 0.02)]
