"""`RolloutBatch` / `StoredPrefix`: what a rollout keeps for `evaluate()`, and the trainer path that uses it (C9).

The core check: a trainer with a frozen prefix that reuses the rollout's prefix K/V computes exactly (bit for bit
in float32) what recomputing the prefix gives, gradients included.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import SLOTS, StandInProcessor, expert_side, make_inputs, make_policy, perturb_

from phyai_gym.train.master_weights import MasterWeights
from policies.pi05.batch import RolloutBatch
from policies.pi05.policy import Pi05Policy

CASES = [("prefix", "sde", True), ("suffix", "sde", False), ("suffix", "noise", False), ("prefix", "ode", False)]


def _grads(policy, batch) -> list[torch.Tensor]:
    policy.model.zero_grad(set_to_none=True)
    ev = policy.evaluate(batch)
    (ev.log_prob.sum() + ev.values.sum() + ev.entropy.sum()).backward()
    return [p.grad.clone() for _, p in policy.trainable_parameters() if p.grad is not None]


@pytest.mark.parametrize("value_source,method,joint", CASES)
def test_prefix_reuse_equals_recomputation_bit_exactly(value_source: str, method: str, joint: bool) -> None:
    overrides = {"noise_head": True} if method == "noise" else {}
    policy = make_policy(value_source, method=method, joint=joint, keep_prefix=True, model_overrides=overrides)
    out = policy.act_inputs(make_inputs(3, seed=4), seeds=[5, 6, 7])
    assert out.prefix is not None and out.prefix.kv.shape[:3] == (3, policy.config.llm.depth, 2)
    perturb_(expert_side(policy.model), seed=1)  # a trainer one update later: the ratio is not trivially 1
    kept = RolloutBatch.from_output(out)
    recomputed = replace(kept, prefix=None)
    a, b = policy.evaluate(kept), policy.evaluate(recomputed)
    for name in ("log_prob_elements", "values", "entropy"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.log_prob, out.log_prob) or method == "ode"
    for ga, gb in zip(_grads(policy, kept), _grads(policy, recomputed)):
        assert torch.equal(ga, gb)


def test_kept_prefix_is_not_differentiated_and_trainable_all_recomputes() -> None:
    policy = make_policy("prefix", method="sde", joint=True, keep_prefix=True)
    out = policy.act_inputs(make_inputs(2, seed=1), seeds=[1, 2])
    batch = RolloutBatch.from_output(out)
    _grads(policy, batch)
    assert all(p.grad is None for n, p in policy.model.named_parameters() if n.startswith("llm."))
    policy.set_trainable("all")
    _grads(policy, batch)  # the prefix is trainable now: recomputed with autograd, the kept K/V ignored
    assert policy.model.llm.layers[0].mlp.up_proj.weight.grad is not None


def test_cat_and_select_across_prompt_buckets() -> None:
    """Two calls with different prompt buckets concatenate (tokens and K/V right-padded, padding masked)."""
    policy = make_policy("prefix", method="sde", joint=True, keep_prefix=True)
    short, long_ = make_inputs(2, seed=2, prompt=8), make_inputs(3, seed=3)
    policy.scheduler.prompt_buckets = (8, *policy.scheduler.prompt_buckets)  # both lengths served eagerly
    parts = [RolloutBatch.from_output(policy.act_inputs(x, seeds=s)) for x, s in ((short, [1, 2]), (long_, [3, 4, 5]))]
    assert parts[0].prefix.kv.shape[4] < parts[1].prefix.kv.shape[4]
    batch = RolloutBatch.cat(parts)
    assert batch.batch_size == 5 and batch.prefix.kv.shape[4] == parts[1].prefix.kv.shape[4]
    whole = policy.evaluate(batch)
    for part, rows in zip(parts, (slice(0, 2), slice(2, 5))):
        alone = policy.evaluate(part)
        torch.testing.assert_close(whole.log_prob[rows], alone.log_prob, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(whole.values[rows], alone.values, atol=1e-6, rtol=1e-6)
        picked = policy.evaluate(batch.select(torch.arange(rows.start, rows.stop)))
        torch.testing.assert_close(picked.log_prob, alone.log_prob, atol=1e-5, rtol=1e-6)


def test_encode_prefix_matches_the_kept_prefix() -> None:
    policy = make_policy("prefix", method="sde", joint=True, keep_prefix=True)
    out = policy.act_inputs(make_inputs(3, seed=8), seeds=[1, 2, 3])
    kept = RolloutBatch.from_output(out)
    encoded = policy.encode_prefix(replace(kept, prefix=None))
    torch.testing.assert_close(encoded.prefix.kv, kept.prefix.kv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(policy.evaluate(encoded).log_prob, policy.evaluate(kept).log_prob, atol=1e-4, rtol=0)


def test_cat_refuses_mixed_headers_and_a_prefix_of_another_dtype() -> None:
    policy = make_policy("prefix", method="sde", joint=True, keep_prefix=True)
    a = RolloutBatch.from_output(policy.act_inputs(make_inputs(2, seed=1), seeds=[1, 2]))
    b = replace(a, header=replace(a.header, weight_version=a.header.weight_version + 1))
    with pytest.raises(ValueError, match="RolloutBatch.cat: expected batches with one header"):
        RolloutBatch.cat([a, b])
    half = replace(a, prefix=replace(a.prefix, kv=a.prefix.kv.to(torch.bfloat16)))
    with pytest.raises(ValueError, match=r"prefix K/V are torch.bfloat16 but this model computes in torch.float32"):
        policy.evaluate(half)


def test_bf16_trainer_with_float32_master_weights() -> None:
    """The default trainer path: compute in the rollout's bf16, step float32 masters, round them back."""
    fp32 = make_policy("prefix", method="sde", joint=True, keep_prefix=True)
    model = fp32.model.set_precision(torch.bfloat16)
    policy = Pi05Policy(model, StandInProcessor(SLOTS), fp32.rollout, replace(fp32.scheduler.config))
    out = policy.act_inputs(make_inputs(2, seed=1), seeds=[1, 2])
    assert out.prefix.kv.dtype == torch.bfloat16
    params = [p for _, p in policy.trainable_parameters()]
    master = MasterWeights(params)
    low = [(m, p) for m, p in zip(master.parameters(), params) if p.dtype == torch.bfloat16]
    assert low and all(m.dtype == torch.float32 for m in master.parameters())
    assert all(m is p for m, p in zip(master.parameters(), params) if p.dtype == torch.float32)  # fp32 islands
    optimizer = torch.optim.SGD(master.parameters(), lr=1e-4)
    before = [m.detach().clone() for m, _ in low]
    for _ in range(3):
        ev = policy.evaluate(RolloutBatch.from_output(out))
        assert ev.log_prob.dtype == torch.float32
        (-ev.log_prob.mean()).backward()
        master.grads_to_masters()
        assert all(p.grad is None for _, p in low) and all(m.grad.dtype == torch.float32 for m, _ in low)
        optimizer.step()
        optimizer.zero_grad()
        master.masters_to_model()
    assert any(not torch.equal(b, m) for b, (m, _) in zip(before, low))
    assert all(torch.equal(p, m.to(torch.bfloat16)) for m, p in low)


def test_declare_batch_sizes_gives_each_size_its_bucket() -> None:
    policy = make_policy("prefix", max_batch_size=4)
    assert policy.scheduler.bucket_for(3) == 3 and policy.declare_batch_sizes([3, 6]) == ()  # default: every size
    policy.scheduler.config.batch_buckets = (1, 2, 4)  # a coarser grid, as SchedulerConfig(batch_buckets=...) gives
    assert policy.scheduler.bucket_for(3) == 4
    assert policy.declare_batch_sizes([3, 6]) == (3,)  # 6 = 4 + 2: the remainder has its bucket already
    assert policy.scheduler.bucket_for(3) == 3 and policy.declare_batch_sizes([3]) == ()
    x = make_inputs(3, seed=2)
    torch.testing.assert_close(policy.act_inputs(x, seeds=[1, 2, 3]).chains, make_policy("prefix", max_batch_size=4)
                               .act_inputs(x, seeds=[1, 2, 3]).chains, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"batch sizes: expected positive ints, got 0 in \[0\]"):
        policy.declare_batch_sizes([0])


def test_trainer_sharing_the_rollout_prefix_computes_the_same() -> None:
    rollout = make_policy("prefix", method="sde", joint=True, keep_prefix=True)
    trainer = make_policy("prefix", method="sde", joint=True, keep_prefix=True)
    batch = RolloutBatch.from_output(rollout.act_inputs(make_inputs(2, seed=3), seeds=[1, 2]))
    recomputed = replace(batch, prefix=None)
    before = trainer.evaluate(recomputed).log_prob
    trainer.model.share_prefix(rollout.model)
    assert trainer.model.llm is rollout.model.llm and trainer.model.vision is rollout.model.vision
    assert torch.equal(trainer.evaluate(recomputed).log_prob, before)
    _grads(trainer, batch)
    assert all(p.grad is None for p in rollout.model.llm.parameters())  # the shared prefix stays frozen
    other = make_policy("prefix", model_overrides={"dtype": "float32"})
    other.model.double()
    with pytest.raises(ValueError, match=r"share_prefix\(other\): expected a model of the same prefix geometry"):
        trainer.model.share_prefix(other.model)


def test_buckets_declared_by_the_wrapper_serve_100_steps_with_autoresets() -> None:
    """PolicyVectorEnv declares N; every call then runs at bucket N and no bucket is ever added again."""
    from phyai_gym.make import make_env, make_policy
    from wrappers import PolicyVectorEnv

    policy = make_policy(action_dim=1, max_batch_size=4)
    policy.scheduler.config.batch_buckets = (1, 2, 4)  # a coarser grid than the default (every size)
    envs = PolicyVectorEnv(make_env("target", 3, num_targets=2, episode_length=2), policy, action_chunk=1)
    buckets = policy.scheduler.config.batch_buckets
    assert policy.scheduler.bucket_for(3) == 3
    served = []
    run_denoise = policy.scheduler._run_denoise  # act() calls (final values of finished rows run the prefix only)
    policy.scheduler._run_denoise = lambda b, *args: served.append(b) or run_denoise(b, *args)
    envs.reset(seed=0)
    resets = 0
    for _ in range(100):
        _, _, terminated, truncated, _ = envs.step()
        resets += int((terminated | truncated).sum())
    envs.close()
    assert resets >= 100 and set(served) == {3} and policy.scheduler.config.batch_buckets == buckets
