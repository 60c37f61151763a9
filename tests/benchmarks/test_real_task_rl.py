"""benchmarks/real_task_rl.py end to end at toy sizes: SFT, eval, PPO, eval per seed, rows with Wilson intervals."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from benchmarks import real_task_rl
from benchmarks.summary import read_rows


def test_two_seeds_give_a_row_each_and_a_pooled_row(tmp_path):
    pytest.importorskip("mujoco_warp")
    args = real_task_rl.Args(seeds=2, demos=2, sft_steps=2, image_size=16, ppo_iterations=1, num_envs=2,
                             num_steps=2, eval_episodes=2, eval_envs=2, work_dir=str(tmp_path / "work"),
                             out=str(tmp_path))  # fmt: skip
    rows = real_task_rl.run(args)
    assert [r["seed"] for r in rows] == [1, 2, "pooled"] and rows[-1]["seeds"] == [1, 2]
    for r in rows[:2]:
        assert r["sft_episodes"] == r["ppo_episodes"] == 2 and len(r["ppo_rollout_success"]) == 1
        assert 0.0 <= r["sft_ci"][0] <= r["sft_success"] <= r["sft_ci"][1] <= 1.0
        assert r["ppo_target_kl"] == 0.1  # PPO's default stop for a checkpoint, though --target-kl was left out
    assert rows[-1]["sft_episodes"] == 4 and rows[-1]["sft_successes"] == sum(r["sft_successes"] for r in rows[:2])
    assert read_rows(tmp_path / "real_task_rl.jsonl") == rows
    assert (tmp_path / "work" / "seed2" / "ppo" / "checkpoints" / "last" / "pretrained_model").is_dir()


def test_a_rerun_in_the_same_work_dir_keeps_the_sft_and_resumes_ppo(tmp_path):
    pytest.importorskip("mujoco_warp")
    work = tmp_path / "work" / "seed1"
    args = real_task_rl.Args(seeds=1, demos=2, sft_steps=2, image_size=16, ppo_iterations=1, save_every=1,
                             num_envs=2, num_steps=2, eval_episodes=2, eval_envs=2, anneal_lr=True, target_kl=0.5,
                             ppo_trainable="all", vf_coef=0.0,
                             work_dir=str(tmp_path / "work"), out=str(tmp_path))  # fmt: skip
    first = real_task_rl.run(args)[0]
    weights = (work / "sft" / "model.safetensors").read_bytes()
    second = real_task_rl.run(replace(args, ppo_iterations=2))[0]
    assert (work / "sft" / "model.safetensors").read_bytes() == weights
    assert second["sft_successes"] == first["sft_successes"] and second["sft_s"] is None  # no SFT the second time
    assert second["ppo_rollout_success"][:1] == first["ppo_rollout_success"] and len(second["ppo_rollout_success"]) == 2
    assert int(real_task_rl.latest_checkpoint(work / "ppo").name) == 2 and (work / "eval_ppo_2").is_dir()
    ppo_args = json.loads((work / "ppo" / "args.json").read_text())  # reached PPO, kept on resume
    assert ppo_args["anneal_lr"] is True and ppo_args["target_kl"] == 0.5
    assert ppo_args["trainable"] == "all" and ppo_args["vf_coef"] == 0.0
    assert " annealed kl<=0.5 " in second["config"] and " trainable=all vf=0" in second["config"]
    assert second["ppo_iteration_s"] > first["ppo_iteration_s"] > 0  # both starts' iterations, from the curve
    assert first["ppo_target_kl"] == second["ppo_target_kl"] == 0.5


@pytest.mark.parametrize("flags", [{"ppo_trainable": "prefix"}, {"sft_trainable": "none"}, {"vf_coef": -0.5}])
def test_bad_ppo_flags_are_refused_when_the_args_are_built(flags):
    name = "--" + next(iter(flags)).replace("_", "-")
    with pytest.raises(ValueError, match=name):
        real_task_rl.Args(**flags)  # not after the SFT, where PPO would refuse them
