"""Policy-level rollout tests on CPU (eager scheduler path): update-0 ratio, batch-composition equivalence in
stochastic modes, value sources and pooling windows.

A rollout stores the chain; `evaluate()` recomputes from it. Before any weight update the ratio
exp(evaluate - rollout) must be 1 (reference/rl_rollout.md section 3.1).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import make_inputs, make_policy

from policies.pi05.rollout import run_prefix_stage
from policies.pi05.sampler import StepTables

METHODS = [("ode", False), ("sde", False), ("sde", True), ("noise", False)]


@pytest.mark.parametrize("value_source", ["suffix", "prefix"])
@pytest.mark.parametrize("method,joint", METHODS)
def test_update0_ratio_is_one(method: str, joint: bool, value_source: str) -> None:
    policy = make_policy(value_source, method=method, joint=joint, action_chunk=4)
    x = make_inputs(3, seed=1)
    out = policy.act_inputs(x, seeds=[3, 4, 5])
    assert out.actions.shape == (3, 4, 7) and out.log_prob_elements.shape == (3, 4, 7)
    assert out.chains.shape == (3, 6, 10, 32) and out.denoise_inds.shape == (3, 5)
    assert out.header.method == method and out.header.is_joint == (joint or method == "noise")
    with torch.no_grad():
        ev = policy.evaluate(out)
    ratio = torch.exp(ev.log_prob - out.log_prob)
    torch.testing.assert_close(ratio, torch.ones(3), atol=1e-4, rtol=0)
    torch.testing.assert_close(ev.log_prob_elements, out.log_prob_elements, atol=1e-5, rtol=1e-5)
    if method == "ode":
        assert torch.equal(out.log_prob, torch.zeros(3)) and torch.equal(ev.log_prob, torch.zeros(3))
        assert (out.denoise_inds == -1).all()
    else:
        assert (out.log_prob_elements != 0).all()
    # values: the prefix source and the joint suffix source use the same definition on both sides
    if value_source == "prefix" or method != "sde" or joint:
        torch.testing.assert_close(ev.values, out.values, atol=1e-5, rtol=1e-5)
    # entropy is nonzero only for the learned-noise method
    assert (ev.entropy != 0).all() if method == "noise" else torch.equal(ev.entropy, torch.zeros(3))
    # the executed actions are the last chain element, cropped
    assert torch.equal(out.actions, out.chains[:, -1, :4, :7]) and torch.equal(out.model_actions, out.chains[:, -1])


def _compare(batch, singles, index) -> None:
    """Random draws (x_0, denoise indices) bitwise; the rest to CPU GEMM tolerance (ulps across batch sizes)."""
    chains = batch.chains[index]
    assert torch.equal(chains[:, 0], singles.chains[:, 0])
    assert torch.equal(batch.denoise_inds[index], singles.denoise_inds)
    torch.testing.assert_close(chains, singles.chains, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch.log_prob[index], singles.log_prob, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(batch.log_prob_elements[index], singles.log_prob_elements, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(batch.values[index], singles.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("joint", [False, True])
def test_sde_outputs_do_not_depend_on_batch_composition(joint: bool) -> None:
    """Batch of N == N single calls == reordered == split over max_batch_size == padded bucket."""
    policy = make_policy("suffix", method="sde", joint=joint, max_batch_size=4)
    policy.scheduler.config.batch_buckets = (1, 2, 4)  # coarser than the default (every size), so 3 rows pad
    n = 6
    x = make_inputs(n, seed=2)
    seeds = torch.tensor([10, 11, 12, 13, 14, 15]) * 1000 + 7
    batch = policy.act_inputs(x, seeds=seeds)  # split 4 + 2
    singles = [policy.act_inputs(x.select(slice(i, i + 1)), seeds=seeds[i : i + 1]) for i in range(n)]
    stacked = type(batch)(
        actions=torch.cat([s.actions for s in singles]),
        log_prob=torch.cat([s.log_prob for s in singles]),
        log_prob_elements=torch.cat([s.log_prob_elements for s in singles]),
        values=torch.cat([s.values for s in singles]),
        chains=torch.cat([s.chains for s in singles]),
        denoise_inds=torch.cat([s.denoise_inds for s in singles]),
    )
    _compare(batch, stacked, slice(None))
    # reordered
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    reordered = policy.act_inputs(x.select(perm), seeds=seeds[perm])
    _compare(reordered, _rows(stacked, perm), slice(None))
    # padded: 3 rows run in the bucket of 4
    padded = policy.act_inputs(x.select(slice(1, 4)), seeds=seeds[1:4])
    assert policy.scheduler.bucket_for(3) == 4
    _compare(padded, _rows(stacked, torch.arange(1, 4)), slice(None))
    # the draws really are per env: different envs got different x_0 and (generally) different j
    assert not torch.equal(batch.chains[0, 0], batch.chains[1, 0])


def _rows(out, index):
    return replace(
        out,
        actions=out.actions[index],
        log_prob=out.log_prob[index],
        log_prob_elements=out.log_prob_elements[index],
        values=out.values[index],
        chains=out.chains[index],
        denoise_inds=out.denoise_inds[index],
    )


def test_streams_advance_per_env_and_follow_env_ids() -> None:
    policy = make_policy("none", method="sde")
    x = make_inputs(4, seed=3)
    first = policy.act_inputs(x, seeds=[1, 2, 3, 4])
    second = policy.act_inputs(x)  # counters advanced: new draws
    assert not torch.equal(first.chains[:, 0], second.chains[:, 0])
    # env 2 alone at its third call == env 2 inside a batch at its third call
    twin = make_policy("none", method="sde")
    twin.act_inputs(x, seeds=[1, 2, 3, 4])
    twin.act_inputs(x)
    alone = twin.act_inputs(x.select(slice(2, 3)), env_ids=[2])
    third = policy.act_inputs(x.select(torch.tensor([3, 2])), env_ids=[3, 2])
    assert torch.equal(third.chains[1:, 0], alone.chains[:, 0])
    # an env that did not act keeps its counter
    assert int(twin.streams.counters[0]) == 2 and int(twin.streams.counters[2]) == 3


def test_deterministic_calls_ignore_the_stream_draw_of_j() -> None:
    policy = make_policy("suffix", method="sde")
    x = make_inputs(2, seed=4)
    det = policy.act_inputs(x, seeds=[5, 6], deterministic=True)
    assert det.header.method == "ode" and torch.equal(det.log_prob, torch.zeros(2))
    again = policy.act_inputs(x, seeds=[5, 6], deterministic=True)
    assert torch.equal(det.chains, again.chains)
    # the ODE chain starts from the same x_0 as the stochastic call of that stream
    sto = policy.act_inputs(x, seeds=[5, 6])
    assert torch.equal(sto.chains[:, 0], det.chains[:, 0])


# ------------------------------------------------------------------------------------------- value sources
def _expert_outputs(model, x, chains):
    """Expert final-norm outputs at every step of the stored chains (B, K, H, We), float32."""
    k = chains.shape[1] - 1
    times = StepTables.build(k).times
    cache = run_prefix_stage(model, x.images, x.image_mask, x.tokens, x.lengths)
    outs = []
    for i in range(k):
        mods = model.modulations(model.time_condition(times[i].expand(chains.shape[0])))
        outs.append(model.expert_step(cache, chains[:, i], mods))
    return torch.stack(outs, dim=1)


@pytest.mark.parametrize("chunk_only", [False, True])
def test_suffix_value_pools_all_h_or_first_c(chunk_only: bool) -> None:
    policy = make_policy("suffix", method="sde", action_chunk=3, model_overrides={"value_chunk_only": chunk_only})
    model = policy.model
    x = make_inputs(3, seed=5)
    out = policy.act_inputs(x, seeds=[7, 8, 9])
    with torch.no_grad():
        feats = _expert_outputs(model, x, out.chains)  # (B, K, H, We)
        width = 3 if chunk_only else feats.shape[2]
        per_step = model.value_head.mlp(feats[:, :, :width].mean(dim=2))[..., 0]  # (B, K)
        other = model.value_head.mlp(feats[:, :, : (feats.shape[2] if chunk_only else 3)].mean(dim=2))[..., 0]
        ev = policy.evaluate(out)
    # rollout: mean over the K steps; evaluate (non-joint): the value at the stochastic step j
    torch.testing.assert_close(out.values, per_step.mean(dim=1), atol=1e-5, rtol=1e-5)
    j = out.denoise_inds[:, 0]
    torch.testing.assert_close(ev.values, per_step[torch.arange(3), j], atol=1e-5, rtol=1e-5)
    # the other window gives different values (so the check above is sensitive to the window)
    assert (other.mean(dim=1) - out.values).abs().min() > 1e-6


def _prefix_value_reference(model, x):
    with torch.no_grad():
        emb, valid = model.embed_prefix(x.images, x.image_mask, x.tokens, x.token_mask)
        cache = model.run_prefix(emb, valid, need_output=True)
        w = valid.double()[..., None]
        pooled = (cache.output.double() * w).sum(1) / w.sum(1)
        return _mlp64(model, pooled)


def _mlp64(model, pooled):
    h = pooled
    layers = list(model.value_head.mlp)
    for layer in layers:
        if isinstance(layer, torch.nn.Linear):
            h = h @ layer.weight.double().T + layer.bias.double()
        else:
            h = torch.relu(h)
    return h[..., 0]


def test_prefix_value_is_the_mean_over_valid_prefix_tokens_only() -> None:
    policy = make_policy("prefix", method="sde")
    model = policy.model
    x = make_inputs(3, seed=6)
    assert not bool(x.image_mask[1, 0]) and (x.lengths < 16).any()
    out = policy.act_inputs(x, seeds=[1, 2, 3])
    torch.testing.assert_close(out.values.double(), _prefix_value_reference(model, x), atol=1e-5, rtol=1e-5)
    # garbage in padded token ids and in the masked camera's pixels changes nothing
    tokens = x.tokens.clone()
    pad = torch.arange(16)[None, :] >= x.lengths[:, None]
    tokens[pad] = 777
    images = x.images.clone()
    images[1, 0] = 255 - images[1, 0]
    y = replace(x, tokens=tokens, images=images)
    out2 = policy.act_inputs(y, seeds=[1, 2, 3])
    torch.testing.assert_close(out2.values, out.values, atol=1e-6, rtol=0)
    torch.testing.assert_close(out2.chains, out.chains, atol=1e-6, rtol=0)
    torch.testing.assert_close(policy.value(y), out.values, atol=1e-6, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(policy.evaluate(out2).values, out.values, atol=1e-6, rtol=0)
    # ... while a valid token or an unmasked camera does change it
    tokens3 = x.tokens.clone()
    tokens3[:, 1] += 1
    assert (policy.value(replace(x, tokens=tokens3)) - out.values).abs().min() > 0


def test_policy_value_matches_rollout_definition() -> None:
    policy = make_policy("suffix", method="sde")
    x = make_inputs(2, seed=7)
    det = policy.act_inputs(x, seeds=[4, 5], deterministic=True)
    policy.streams.set_seeds(torch.arange(2), torch.tensor([4, 5]))
    v = policy.value(x)
    torch.testing.assert_close(v, det.values, atol=1e-6, rtol=0)
    assert policy.streams.counters[:2].tolist() == [0, 0]  # value() consumes no stream


@pytest.mark.parametrize("method,joint", METHODS)
def test_no_value_head_returns_zeros(method: str, joint: bool) -> None:
    policy = make_policy("none", method=method, joint=joint)
    assert policy.model.value_head is None
    x = make_inputs(2, seed=8)
    out = policy.act_inputs(x, seeds=[1, 2])
    assert torch.equal(out.values, torch.zeros(2)) and out.header.value_source == "none"
    with torch.no_grad():
        assert torch.equal(policy.evaluate(out).values, torch.zeros(2))
    assert torch.equal(policy.value(x), torch.zeros(2))


def test_evaluate_refuses_a_mismatched_header() -> None:
    policy = make_policy("suffix", method="sde", noise_level=0.5)
    out = policy.act_inputs(make_inputs(1), seeds=[0])
    policy.rollout = replace(policy.rollout, noise_level=0.3)
    with pytest.raises(ValueError, match="noise_level"):
        policy.evaluate(out)
    policy.rollout = replace(policy.rollout, noise_level=0.5, method="noise")
    with pytest.raises(ValueError, match="method"):
        policy.evaluate(out)


@pytest.mark.parametrize("method,joint", [("ode", False), ("sde", False), ("sde", True)])
def test_denoise_without_the_noise_head_changes_no_bit(method: str, joint: bool, monkeypatch) -> None:
    """Methods other than "noise" run the denoise stage without the noise head; their outputs are the same bits."""
    import policies.pi05.scheduler as scheduler_module

    policy = make_policy("suffix", method=method, joint=joint, noise_level=0.7)
    assert policy.model.noise_head is not None
    x = make_inputs(3, seed=4)
    without = policy.act_inputs(x, seeds=[1, 2, 3])
    stage = scheduler_module.run_denoise_stage
    monkeypatch.setattr(scheduler_module, "run_denoise_stage", lambda *args: stage(*args[:8], True))
    with_head = policy.act_inputs(x, seeds=[1, 2, 3])
    for name in ("chains", "log_prob_elements", "log_prob", "values"):
        assert torch.equal(getattr(without, name), getattr(with_head, name)), name


def test_a_policy_switched_to_the_noise_method_runs_the_noise_head() -> None:
    """`policy.rollout` changed to "noise" after construction: the same outputs as a policy built for "noise"."""
    switched = make_policy("suffix", method="sde", joint=True)
    assert not switched.scheduler.config.learned_noise
    switched.rollout = replace(switched.rollout, method="noise")
    built = make_policy("suffix", method="noise")
    assert built.scheduler.config.learned_noise
    x = make_inputs(2, seed=5)
    a, b = switched.act_inputs(x, seeds=[4, 5]), built.act_inputs(x, seeds=[4, 5])
    assert torch.equal(a.chains, b.chains) and torch.equal(a.log_prob, b.log_prob)
    sde = make_policy("suffix", method="sde", joint=True).act_inputs(x, seeds=[4, 5])
    assert not torch.equal(a.chains[:, 1:], sde.chains[:, 1:])  # the learned std, not the SDE's


def test_noise_method_without_a_noise_head_is_refused() -> None:
    """Without the head the learned std would silently be 0 (an ODE chain with a bogus x_0-only log-prob)."""
    policy = make_policy("suffix", method="noise", model_overrides={"noise_head": False})
    x = make_inputs(1)
    with pytest.raises(ValueError, match="noise_head"):
        policy.act_inputs(x, seeds=[0])
    assert policy.act_inputs(x, seeds=[0], deterministic=True).header.method == "ode"
    sde = make_policy("suffix", method="noise").act_inputs(x, seeds=[0])
    with pytest.raises(ValueError, match="noise_head"):
        policy.evaluate(sde)
