from __future__ import annotations

import json

import pytest

from phyai_gym.evaluation import evaluate_success, plan_episodes, read_jsonl, wilson_interval
from phyai_gym.make import make_env
from policies.baseline import GaussianPolicy
from wrappers import PolicyVectorEnv


def test_plan_is_fixed_up_front_and_interleaves_tasks():
    plan = plan_episodes(["a", "b", "c"], 2, seed=5)
    assert [e.episode_id for e in plan] == list(range(6))
    assert [e.task for e in plan] == ["a", "b", "c"] * 2
    assert [e.init_state_id for e in plan] == [0, 0, 0, 1, 1, 1]
    assert [e.seed for e in plan] == list(range(5, 11))


WILSON_REFERENCE = [(0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0), (5, 10, 0.2366, 0.7634)]


@pytest.mark.parametrize(("k", "n", "low", "high"), WILSON_REFERENCE)
def test_wilson_interval_matches_reference_values(k, n, low, high):
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(low, abs=1e-4) and hi == pytest.approx(high, abs=1e-4)


def _env(num_envs: int) -> PolicyVectorEnv:
    # scripted episodes of different lengths: slot 0 finishes 3x as often as slot 1
    venv = make_env("scripted", num_envs, episode_lengths=[(1,), (3,)][:num_envs])
    return PolicyVectorEnv(venv, GaussianPolicy(3, action_horizon=1), 1, deterministic=True)


def test_short_episodes_are_not_over_sampled():
    env = _env(2)
    result = evaluate_success(env, episodes_per_task=6)
    env.close()
    assert [r["episode_id"] for r in result.rows] == list(range(6)) and result.complete
    assert result.overall.episodes == 6  # not more episodes from the fast slot


def test_api_resume_appends_only_missing_episodes(tmp_path):
    env = _env(2)
    first = evaluate_success(env, 5, out_dir=tmp_path, max_episodes_this_run=2)
    assert len(first.rows) == 2 and not first.complete
    second = evaluate_success(env, 5, out_dir=tmp_path)
    env.close()
    header, rows = read_jsonl(tmp_path / "episodes.jsonl")
    assert header is not None and second.complete
    assert sorted(r["episode_id"] for r in rows) == list(range(5))


def test_torn_last_line_is_ignored(tmp_path):
    env = _env(2)
    evaluate_success(env, 3, out_dir=tmp_path, max_episodes_this_run=1)
    with open(tmp_path / "episodes.jsonl", "a") as handle:
        handle.write(json.dumps({"type": "episode", "episode_id": 2})[:20])  # crash mid-write
    result = evaluate_success(env, 3, out_dir=tmp_path)
    env.close()
    assert result.complete and sorted(r["episode_id"] for r in result.rows) == [0, 1, 2]


def test_probing_a_missing_attribute_leaves_async_workers_alive():
    """An async worker asked for an attribute it lacks shuts down; `sub_env_attr` asks `has_wrapper_attr` first."""
    from phyai_gym.run import episode_limit, sub_env_attr

    env = make_env("Pusher-v5", 2, image_size=16, vectorization="async")
    try:
        assert sub_env_attr(env, "settle_steps") is None  # Pusher has none (LIBERO has)
        assert episode_limit(env) == 100
        env.reset(seed=0)
        env.step(env.action_space.sample())  # both workers still answer
    finally:
        env.close()
