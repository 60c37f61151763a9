"""Pi05Scheduler on CPU (the eager path on the same static buffers the CUDA graphs use): buckets, padding,
splitting, declared keys, output ownership, table refresh."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPT, expert_side, make_inputs, make_model, make_policy, perturb_

from policies.base import RolloutConfig
from policies.pi05.scheduler import GraphKeyError, Pi05Scheduler, SchedulerConfig, default_batch_buckets

OPTS = RolloutConfig(method="sde", num_steps=5, noise_level=0.5, action_chunk=4, action_dim=7)


def make_scheduler(max_batch_size: int = 4, **kw) -> Pi05Scheduler:
    model = make_model(0, value_source=kw.pop("value_source", "suffix"))
    cfg = SchedulerConfig(max_batch_size=max_batch_size, num_steps=kw.pop("num_steps", (3, 5)),
                          camera_sets=kw.pop("camera_sets", ((0, 1),)), prompt_buckets=(PROMPT,), **kw)
    sched = Pi05Scheduler(model, cfg)
    sched.setup()
    return sched


@pytest.fixture(scope="module")
def sched() -> Pi05Scheduler:
    return make_scheduler(batch_buckets=(1, 2, 4))


def streams(n: int, offset: int = 0):
    return torch.arange(n, dtype=torch.int64) * 101 + 5 + offset, torch.arange(n, dtype=torch.int64) % 3


def run(sched, x, seeds, counters, opts=OPTS):
    out, inds = sched.rollout(x, seeds, counters, opts)
    return out, inds


def test_default_buckets_and_bucket_choice() -> None:
    assert default_batch_buckets(64) == tuple(range(1, 65))
    assert default_batch_buckets(1) == (1,)
    cfg = SchedulerConfig(max_batch_size=6, prompt_buckets=(48, 16, 16))
    assert cfg.batch_buckets == (1, 2, 3, 4, 5, 6) and cfg.prompt_buckets == (16, 48)
    with pytest.raises(ValueError, match="max_batch_size"):
        SchedulerConfig(max_batch_size=8, batch_buckets=(1, 4))
    with pytest.raises(ValueError, match="max_batch_size"):
        SchedulerConfig(max_batch_size=0)
    sched = Pi05Scheduler(make_model(0), SchedulerConfig(max_batch_size=6, num_steps=(5,), prompt_buckets=(16,)))
    assert [sched.bucket_for(n) for n in range(1, 7)] == [1, 2, 3, 4, 5, 6]
    sched = Pi05Scheduler(make_model(0), SchedulerConfig(max_batch_size=6, batch_buckets=(1, 2, 4, 6),
                                                         num_steps=(5,), prompt_buckets=(16,)))  # fmt: skip
    assert [sched.bucket_for(n) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    # prompt buckets are capped at max_token_len (48 for tiny), which is always a bucket
    assert sched.prompt_buckets == (16, 48)
    assert [sched.prompt_bucket_for(n) for n in (1, 16, 17, 48)] == [16, 16, 48, 48]
    with pytest.raises(GraphKeyError, match="max_token_len"):
        sched.prompt_bucket_for(49)


def test_rollout_uses_the_smallest_bucket_and_prompt_bucket(sched, monkeypatch) -> None:
    calls = []
    original = sched._run_denoise
    monkeypatch.setattr(sched, "_run_denoise", lambda b, length, cams, k, learned: (
        calls.append((b, length, cams, k)), original(b, length, cams, k, learned)))
    for n in (1, 2, 3, 4):
        seeds, counters = streams(n)
        out, inds = run(sched, make_inputs(n, seed=n), seeds, counters)
        assert out.chain.shape == (n, 6, 10, 32) and inds.shape == (n, 5)
    x = make_inputs(2, seed=9, prompt=20)  # 20 tokens -> prompt bucket 48
    run(sched, x, *streams(2), opts=RolloutConfig(num_steps=3, action_chunk=4, action_dim=7))
    assert calls == [(1, 16, (0, 1), 5), (2, 16, (0, 1), 5), (4, 16, (0, 1), 5), (4, 16, (0, 1), 5),
                     (2, 48, (0, 1), 3)]


def _fill_garbage_(sched) -> None:
    """Large finite garbage in every static buffer (float 1e30 / -1e30, ints large, masks flipped)."""
    buf = sched.buffers
    gen = torch.Generator().manual_seed(0)
    tensors = [buf.chain, buf.log_prob, buf.out_values, buf.prefix_value, buf.denoise_inds, buf.num_valid,
               buf.key_mask, buf.image_mask, buf.images, *buf.keys, *buf.values]
    for t in tensors:
        if t.dtype == torch.bool:
            t.copy_(torch.rand(t.shape, generator=gen) > 0.5)
        elif t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
        elif t.is_floating_point():
            t.copy_(torch.where(torch.rand(t.shape, generator=gen) > 0.5, 1e30, -1e30).to(t.dtype))
        else:
            t.fill_(10**6)
    buf.tokens.fill_(999)
    buf.lengths.fill_(PROMPT)
    buf.seeds.fill_(123456789)
    buf.counters.fill_(987654321)


def test_garbage_in_static_buffers_does_not_change_results(sched) -> None:
    x = make_inputs(3, seed=21)
    seeds, counters = streams(3)
    clean, inds = run(sched, x, seeds, counters)
    _fill_garbage_(sched)
    dirty, inds2 = run(sched, x, seeds, counters)
    assert torch.isfinite(dirty.chain).all()
    assert torch.equal(clean.chain, dirty.chain) and torch.equal(clean.log_prob_elements, dirty.log_prob_elements)
    assert torch.equal(clean.values, dirty.values) and torch.equal(inds, inds2)


def test_pad_rows_do_not_change_real_rows(sched) -> None:
    """Whatever the pad rows of a bucket hold (images, prompts, masks, streams), real rows are unchanged."""
    x = make_inputs(3, seed=22)
    seeds, counters = streams(3)
    ref, ref_inds = run(sched, x, seeds, counters)
    buf, gen = sched.buffers, torch.Generator().manual_seed(1)
    sched._load(x, seeds, counters, OPTS, 4, PROMPT)
    # garbage pad row 3: random pixels, a camera masked, a full-length random prompt, another stream
    buf.images[3].copy_(torch.randint(0, 256, buf.images[3].shape, generator=gen, dtype=torch.uint8))
    buf.image_mask[3, 1] = False
    buf.tokens[3].copy_(torch.randint(1, 50000, buf.tokens[3].shape, generator=gen, dtype=torch.int32))
    buf.lengths[3] = PROMPT
    buf.seeds[3], buf.counters[3] = 2**40 + 1, 77
    sched._run_prefix(4, PROMPT, (0, 1))
    sched._run_denoise(4, PROMPT, (0, 1), 5)
    assert torch.equal(buf.chain[:3, :6], ref.chain)
    assert torch.equal(buf.log_prob[:3], ref.log_prob_elements)
    assert torch.equal(buf.out_values[:3], ref.values) and torch.equal(buf.denoise_inds[:3, :5], ref_inds)
    assert not torch.equal(buf.chain[3, 0], ref.chain[0, 0])  # the pad row really ran with other inputs


def test_padded_and_split_calls_match_single_calls() -> None:
    sched = make_scheduler(max_batch_size=4, batch_buckets=(1, 2, 4))
    n = 9  # 4 + 4 + 1
    x = make_inputs(n, seed=23)
    seeds, counters = streams(n)
    before = sched.stats.eager_calls
    out, inds = run(sched, x, seeds, counters)
    assert sched.stats.eager_calls - before == 6  # 3 chunks x (prefix + denoise)
    for i in range(n):
        one, one_inds = run(sched, x.select(slice(i, i + 1)), seeds[i : i + 1], counters[i : i + 1])
        assert torch.equal(out.chain[i, 0], one.chain[0, 0]) and torch.equal(inds[i], one_inds[0])
        torch.testing.assert_close(out.chain[i], one.chain[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.log_prob_elements[i], one.log_prob_elements[0], atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(out.values[i], one.values[0], atol=1e-5, rtol=1e-5)
    # 3 rows padded to bucket 4 == the same rows inside a full batch
    part, part_inds = run(sched, x.select(slice(4, 7)), seeds[4:7], counters[4:7])
    assert torch.equal(part.chain[:, 0], out.chain[4:7, 0]) and torch.equal(part_inds, inds[4:7])
    torch.testing.assert_close(part.chain, out.chain[4:7], atol=1e-5, rtol=1e-5)


def test_undeclared_keys_raise_graph_key_error_naming_the_setup_argument(sched) -> None:
    x = make_inputs(1)
    with pytest.raises(GraphKeyError, match=r"num_steps=4 .*setup\(num_steps=\(3, 5\)\)"):
        run(sched, x, *streams(1), opts=RolloutConfig(num_steps=4, action_dim=7))
    y = make_inputs(1, slots=(0, 2))
    with pytest.raises(GraphKeyError, match=r"camera set \(0, 2\) .*setup\(camera_sets="):
        run(sched, y, *streams(1))
    with pytest.raises(GraphKeyError, match=r"camera_sets"):
        sched.prefix_value(y)
    assert issubclass(GraphKeyError, ValueError)
    fresh = Pi05Scheduler(make_model(0), SchedulerConfig(max_batch_size=2, num_steps=(5,), prompt_buckets=(16,)))
    with pytest.raises(RuntimeError, match="setup"):
        run(fresh, x, *streams(1))


def test_other_declared_camera_set_runs(sched) -> None:
    multi = make_scheduler(max_batch_size=2, num_steps=(5,), camera_sets=((0, 1), (0, 2), (0, 1, 2)))
    for slots in ((0, 2), (0, 1, 2)):
        x = make_inputs(2, seed=24, slots=slots)
        out, _ = run(multi, x, *streams(2))
        assert torch.isfinite(out.chain).all()


def test_outputs_do_not_alias_static_buffers(sched) -> None:
    x = make_inputs(2, seed=25)
    seeds, counters = streams(2)
    first, inds = run(sched, x, seeds, counters)
    buf = sched.buffers
    owned = [first.chain, first.log_prob_elements, first.values, inds]
    statics = [buf.chain, buf.log_prob, buf.out_values, buf.denoise_inds]
    for out, static in zip(owned, statics):
        assert out.untyped_storage().data_ptr() != static.untyped_storage().data_ptr()
    snapshot = [t.clone() for t in owned]
    # mutating a returned tensor does not change the next call ...
    for t in owned:
        t.fill_(-7)
    second, inds2 = run(sched, x, seeds, counters)
    for got, want in zip([second.chain, second.log_prob_elements, second.values, inds2], snapshot):
        assert torch.equal(got, want)
    # ... and a later call (or a write to the buffers) does not change an earlier result
    run(sched, make_inputs(2, seed=26), *streams(2, offset=1))
    for static in statics:
        static.fill_(3)
    for got, want in zip([second.chain, second.log_prob_elements, second.values, inds2], snapshot):
        assert torch.equal(got, want)


def test_prefix_value_path_is_padded_and_row_independent() -> None:
    sched = make_scheduler(max_batch_size=4, value_source="prefix", num_steps=(5,), batch_buckets=(1, 2, 4))
    x = make_inputs(3, seed=27)
    both = sched.prefix_value(x)  # bucket 4
    for i in range(3):
        torch.testing.assert_close(sched.prefix_value(x.select(slice(i, i + 1))), both[i : i + 1], atol=1e-6, rtol=0)
    out, _ = run(sched, x, *streams(3))
    torch.testing.assert_close(out.values, both, atol=1e-6, rtol=0)


def test_refresh_tables_after_a_weight_change() -> None:
    """The per-K adaRMS tables depend on the weights: stale until `refresh_tables()`, then == a fresh setup."""
    policy = make_policy("suffix", method="sde", num_steps=(5,))
    x = make_inputs(2, seed=28)
    before = policy.act_inputs(x, seeds=[1, 2])
    perturb_(expert_side(policy.model), seed=3)
    policy.scheduler.refresh_tables()
    after = policy.act_inputs(x, seeds=[1, 2])
    fresh = Pi05Scheduler(policy.model, policy.scheduler.config)
    fresh.setup()
    ref, _ = fresh.rollout(x, torch.tensor([1, 2]), torch.zeros(2, dtype=torch.int64), policy.sampling_options())
    assert torch.equal(after.chains, ref.chain)
    assert not torch.allclose(after.chains[:, -1], before.chains[:, -1])
