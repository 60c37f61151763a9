"""Checkpoints of examples/ppo_pi05.py outlive the run: they load with `make_policy` and act bit for bit as the
trained policy did, and ``--resume`` continues a run to the very curve a straight run writes (tiny config, CPU)."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from phyai_gym.cli import main as cli_main
from phyai_gym.make import make_env, make_policy
from policies.pi05.checkpoint import CheckpointError
from tests.examples.test_ppo import _ppo_module

TINY = dict(num_envs=4, num_steps=2, eval_episodes=0, quiet=True)


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """The curve's PNG is test_curves.py's business; rendering it costs seconds per run here."""
    monkeypatch.setattr("phyai_gym.train.curves.plot_curves", lambda *args, **kwargs: None)


def _curve(path) -> list[dict[str, str]]:
    """The CSV's rows without the wall-time columns."""
    with open(path, newline="") as handle:
        return [{k: v for k, v in row.items() if not k.startswith("time_") and k != "sps"}
                for row in csv.DictReader(handle)]  # fmt: skip


def test_checkpoint_loads_with_make_policy_and_acts_bitwise(tmp_path):
    ppo = _ppo_module()
    result = ppo.train(ppo.Args(total_iterations=2, run_dir=str(tmp_path / "run"), **TINY))
    folder = tmp_path / "run" / "checkpoints" / "last" / "pretrained_model"
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "model.safetensors", "policy_config.json", "processor_config.json"]  # fmt: skip
    loaded = make_policy(folder)
    from_run = make_policy(tmp_path / "run")  # a run folder stands for its newest checkpoint
    trained = result["policy"]
    assert loaded.weight_version == 0 and trained.weight_version == 3  # initial sync + one per iteration
    env = make_env("target", 4)
    obs, _ = env.reset(seed=123)
    for deterministic in (False, True):
        a = trained.act(obs, seeds=[5, 6, 7, 8], deterministic=deterministic)
        b = loaded.act(obs, seeds=[5, 6, 7, 8], deterministic=deterministic)
        assert torch.equal(a.actions, b.actions)
        assert torch.equal(a.log_prob_elements, b.log_prob_elements)
        assert torch.equal(from_run.act(obs, seeds=[5, 6, 7, 8], deterministic=deterministic).actions, b.actions)
    env.close()
    steps = json.loads((folder.parent / "training_state" / "training_step.json").read_text())
    assert steps == {"iteration": 2, "global_step": 16, "weight_version": 3}
    assert cli_main(["eval", "--checkpoint", str(folder), "--env", "target", "--episodes", "4"]) == 0


def test_a_run_folder_without_a_checkpoint_is_refused_with_the_fix(tmp_path):
    (tmp_path / "run" / "checkpoints" / "000002.tmp").mkdir(parents=True)  # a run killed while saving its first
    with pytest.raises(CheckpointError, match=r"checkpoint: expected a checkpoint folder.*no 'last' checkpoint yet"):
        make_policy(tmp_path / "run")


def test_resume_after_2_of_4_iterations_gives_the_straight_curve(tmp_path):
    ppo = _ppo_module()
    common = dict(reset_every_iteration=True, norm_reward=True, **TINY)  # the normalizer state is restored too
    ppo.train(ppo.Args(total_iterations=4, run_dir=str(tmp_path / "straight"), **common))
    ppo.train(ppo.Args(total_iterations=2, run_dir=str(tmp_path / "split"), **common))
    resumed = ppo.train(ppo.Args(total_iterations=4, resume=str(tmp_path / "split"), quiet=True))
    straight, split = _curve(tmp_path / "straight" / "curve.csv"), _curve(tmp_path / "split" / "curve.csv")
    assert len(straight) == 4
    assert split == straight
    assert [int(r["iteration"]) for r in resumed["curve"]] == [1, 2, 3, 4]
    assert (tmp_path / "split" / "checkpoints" / "last").resolve().name == "000004"
    again = ppo.train(ppo.Args(total_iterations=4, resume=str(tmp_path / "split"), quiet=True))  # nothing left to run
    assert _curve(tmp_path / "split" / "curve.csv") == straight and len(again["curve"]) == 4


def test_resume_drops_rows_written_after_its_checkpoint(tmp_path):
    ppo = _ppo_module()
    run = tmp_path / "run"
    ppo.train(ppo.Args(total_iterations=3, run_dir=str(run), save_every=1, keep_checkpoints=2, **TINY))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["000002", "000003", "last"]  # 000001 pruned
    (run / "checkpoints" / "last").unlink()
    (run / "checkpoints" / "last").symlink_to("000002")  # as if killed before iteration 3's checkpoint
    ppo.train(ppo.Args(total_iterations=3, resume=str(run), quiet=True))
    assert [r["iteration"] for r in _curve(run / "curve.csv")] == ["1", "2", "3"]


def test_run_dir_and_resume_refusals(tmp_path):
    ppo = _ppo_module()
    run = tmp_path / "run"
    ppo.train(ppo.Args(total_iterations=1, run_dir=str(run), **TINY))
    with pytest.raises(FileExistsError, match="--resume"):
        ppo.train(ppo.Args(total_iterations=1, run_dir=str(run), **TINY))
    with pytest.raises(ValueError, match="--learning-rate: a resumed run keeps its own flags"):
        ppo.parse_args(["--resume", str(run), "--learning-rate", "0.1"])
    args = ppo.parse_args(["--resume", str(run), "--total-iterations", "3"])
    assert (args.total_iterations, args.num_envs, args.eval_episodes) == (3, 4, 0)  # the rest: the run's own
    assert ppo.parse_args(["--resume", str(run), "--save-every", "1"]).save_every == 1  # the run dir is the resumed
    with pytest.raises(ValueError, match="--save-every"):
        ppo.Args(save_every=2)
    with pytest.raises(FileNotFoundError, match="args.json"):
        ppo.train(ppo.Args(resume=str(tmp_path / "nothing")))
