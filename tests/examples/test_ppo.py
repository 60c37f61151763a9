"""PPO end to end: tiny PI0.5 on the target task beats the best constant action by >= 20 points (3 seeds).

Wall time is a benchmark's business (benchmarks/bench_cli.py --which ppo), not these tests'.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from policies.pi05.policy import Pi05Policy
from wrappers.adapters.target_task import TargetEnv

ROOT = Path(__file__).resolve().parents[2]
PPO_ITERATIONS = 20


def _ppo_module():
    spec = importlib.util.spec_from_file_location("ppo_pi05", ROOT / "examples" / "ppo_pi05.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ppo_pi05"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def best_constant_action_success(episodes: int = 400, num_targets: int = 2) -> float:
    """Success rate of the best constant action (a grid over [-1, 1]) on the same episode distribution."""
    env = TargetEnv(num_targets=num_targets)
    best = 0.0
    for action in np.linspace(-1.0, 1.0, 41, dtype=np.float32):
        wins = 0
        for episode in range(episodes):
            env.reset(seed=10_000 + episode)
            wins += env.step(np.array([action], np.float32))[4]["is_success"]
        best = max(best, wins / episodes)
    return best


def test_best_constant_action_is_about_chance():
    assert 0.45 <= best_constant_action_success() <= 0.6


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ppo_beats_best_constant_action(seed, tmp_path):
    ppo = _ppo_module()
    args = ppo.Args(seed=seed, total_iterations=PPO_ITERATIONS, eval_episodes=256, csv=str(tmp_path / "curve.csv"),
                    noise_level=1.0, learning_rate=3e-3, quiet=True)  # fmt: skip
    result = ppo.train(args)
    baseline = best_constant_action_success()
    success = result["final"]["stochastic"]
    print(f"seed {seed}: best constant {baseline:.3f}, PPO {success:.3f} "
          f"(deterministic {result['final']['deterministic']:.3f})")  # fmt: skip
    assert success >= baseline + 0.20
    curve = result["curve"]
    assert abs(curve[0]["approx_kl_first"]) < 1e-4  # trainer recomputes the rollout's log-probs (ratio = 1)
    assert [row["weight_version"] for row in curve] == list(range(2, PPO_ITERATIONS + 2))  # one sync per iteration
    assert (tmp_path / "curve.csv").read_text().startswith("iteration,global_step,success_rate")


def test_interrupted_run_leaves_its_curve_and_plot(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    import torch

    ppo = _ppo_module()
    args = ppo.Args(num_envs=4, num_steps=2, total_iterations=6, eval_episodes=0, csv=str(tmp_path / "curve.csv"))
    steps_per_iteration = args.update_epochs * args.num_minibatches
    real_step, calls = torch.optim.Adam.step, {"n": 0}

    def ctrl_c_in_iteration_3(self, *a, **kw):  # Ctrl-C during the third update
        calls["n"] += 1
        if calls["n"] > 2 * steps_per_iteration:
            raise KeyboardInterrupt
        return real_step(self, *a, **kw)

    monkeypatch.setattr(torch.optim.Adam, "step", ctrl_c_in_iteration_3)
    with pytest.raises(KeyboardInterrupt):
        ppo.train(args)
    lines = (tmp_path / "curve.csv").read_text().splitlines()
    assert lines[0].startswith("iteration,global_step,success_rate")
    assert [r.split(",")[0] for r in lines[1:]] == ["1", "2"]  # both finished iterations, flushed
    assert (tmp_path / "curve.png").read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert "torch CPU threads: 1 (default for small models on the CPU" in out
    assert "iter 1/6 |" in out and "ETA" in out
    assert f"curve (2/6 iterations): {tmp_path / 'curve.csv'}, {tmp_path / 'curve.png'}" in out


def test_command_line_has_help_defaults_and_boolean_pairs(capsys):
    ppo = _ppo_module()
    argv = ["--quiet", "--no-joint", "--total-iterations", "3", "--csv", "none", "--learning-rate", "1e-3"]
    args = ppo.parse_args(argv)
    assert (args.quiet, args.joint, args.total_iterations, args.csv, args.learning_rate) == (True, False, 3, None, 1e-3)
    assert ppo.parse_args([]).quiet is False
    with pytest.raises(SystemExit):
        ppo.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--quiet, --no-quiet no per-iteration line (default: False)" in text
    assert "--num-envs NUM_ENVS N, parallel envs (per rank under torchrun: G ranks step G*N envs) (default: 32)" in text


def test_target_kl_ends_the_update_before_a_step_past_it(tmp_path):
    ppo = _ppo_module()
    common = dict(num_envs=8, total_iterations=2, eval_episodes=0, csv=None, quiet=True)
    full = ppo.train(ppo.Args(**common))["curve"]
    assert [row["update_steps"] for row in full] == [8, 8]  # 4 epochs x 2 minibatches
    stopped = ppo.train(ppo.Args(**common, target_kl=1e-6))["curve"]
    assert [row["update_steps"] for row in stopped] == [1, 1]  # after one step every minibatch is past 1e-6
    assert all(row["approx_kl"] > 1e-6 >= row["approx_kl_first"] for row in stopped)
    # the default stop: none for the tiny config, 0.1 for base-sized policies; inf switches it off
    assert ppo.Args().target_kl is None and ppo.Args(config="base").target_kl == 0.1
    assert ppo.parse_args(["--config", "base", "--target-kl", "inf"]).target_kl == float("inf")
    message = r"^--target-kl: expected an approx-KL > 0, got 0\.0\. Fix: pass e\.g\. 0\.5\.$"
    with pytest.raises(ValueError, match=message):
        ppo.Args(target_kl=0.0)


def test_micro_batches_give_the_whole_minibatch_update():
    ppo = _ppo_module()
    common = dict(num_envs=8, num_steps=4, total_iterations=1, eval_episodes=0, csv=None, quiet=True)  # minibatch 16
    whole = ppo.train(ppo.Args(**common))
    micro = ppo.train(ppo.Args(**common, micro_batch_size=4))
    assert whole["curve"][0]["update_steps"] == micro["curve"][0]["update_steps"] == 8
    for key in ("approx_kl", "approx_kl_max", "approx_kl_chunk", "clipfrac", "pg_loss", "v_loss"):
        assert micro["curve"][0][key] == pytest.approx(whole["curve"][0][key], rel=1e-4, abs=1e-9), key
    weights = [(a, b) for a, b in zip(whole["trainer"].model.parameters(), micro["trainer"].model.parameters())]
    for a, b in weights:
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    message = (r"^--micro-batch-size: expected a divisor of the minibatch size 16 \(num_envs x num_steps / "
               r"num_minibatches\), got 5\. Fix: pass e\.g\. --micro-batch-size 8\.$")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        ppo.Args(**common, micro_batch_size=5)


def test_out_of_memory_in_the_update_names_the_micro_batch_fix(monkeypatch):
    ppo = _ppo_module()

    def out_of_memory(self, batch, *, cuda_graphs=False):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Pi05Policy, "evaluate", out_of_memory)  # as a GPU's allocator raises it
    message = (r"(?s)CUDA out of memory.*forward and backward of 16 samples at once ran the device out of "
               r"memory\. Fix: pass --micro-batch-size 8 \(the same update, the minibatch of 16 in smaller parts\)\.$")
    with pytest.raises(torch.OutOfMemoryError, match=message):
        ppo.train(ppo.Args(num_envs=8, num_steps=4, total_iterations=1, eval_episodes=0, csv=None, quiet=True))
    assert ppo.out_of_memory_fix(1, 16).endswith("Fix: a smaller policy or image size.")
    assert "--micro-batch-size 4 " in ppo.out_of_memory_fix(8, 12)  # a divisor of the minibatch
