"""The PPO ratio's granularity (--logprob-reduction, docs/rl.md): what it changes and what it does not (tiny, CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.examples.test_ppo import _ppo_module

TINY = dict(num_envs=4, num_steps=2, eval_episodes=0, quiet=True, csv=None)


def test_logprob_reductions_agree_on_one_element_and_report_the_chunk_kl():
    ppo = _ppo_module()
    curves = {}
    for reduction in ("sum", "element"):
        result = ppo.train(ppo.Args(total_iterations=2, logprob_reduction=reduction, **TINY))
        curves[reduction] = result["curve"]
    # the target task's chunk is one 1-dim action: every granularity is the same ratio
    for a, b in zip(curves["sum"], curves["element"]):
        assert a["approx_kl_mean"] == b["approx_kl_mean"] and a["clipfrac"] == b["clipfrac"]
        assert a["approx_kl_chunk"] == pytest.approx(a["approx_kl_mean"], rel=1e-5, abs=1e-9)
    assert np.isfinite(curves["element"][-1]["approx_kl_chunk"])
    with pytest.raises(ValueError, match="--logprob-reduction"):
        ppo.Args(logprob_reduction="token")


def test_per_element_ratios_clip_less_than_the_summed_ratio_at_the_same_chunk_kl():
    ppo = _ppo_module()
    last = {}
    for reduction in ("sum", "element"):
        args = ppo.Args(env="scripted", action_chunk=2, total_iterations=2, logprob_reduction=reduction, **TINY)
        last[reduction] = ppo.train(args)["curve"][-1]
    s, e = last["sum"], last["element"]
    # the policy moved about as far either way (the step is Adam's, set by the learning rate) ...
    assert 0.5 < e["approx_kl_chunk"] / s["approx_kl_chunk"] < 2.0, (s, e)
    # ... but the summed ratio sees all C x A element changes at once: a larger KL and far more clipping
    assert e["approx_kl_mean"] < s["approx_kl_mean"] / 5 and e["clipfrac"] < s["clipfrac"] / 5, (s, e)
