"""Graphs captured on first use (issue 41) on the GPU (run by benchmarks/gpu_suite.py; skipped on CPU): shapes met
in any order replay what eager computes, a new shape mid-run recaptures nothing and is not stale after a weight
sync, the warm-up list, and the CUDA processor's host path."""

import numpy as np
import pytest
import torch
from test_scheduler_cuda import _inputs, _model, _policy

from policies.pi05.config import Pi05Config
from policies.pi05.policy import Pi05Policy, RolloutConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_suite.py)"),
]

# (N, prompt tokens, K) in an order that meets large, small, new-prompt and repeated shapes
SHAPES = [(5, 200, 10), (1, 16, 5), (3, 48, 10), (8, 16, 5), (5, 16, 5), (1, 200, 10), (3, 48, 10), (5, 200, 10)]


def _act(policy, n, length, k, seed):
    policy.rollout = RolloutConfig(num_steps=k, action_chunk=4)
    return policy.act_inputs(_inputs(n, length, min(length, 40), seed=seed), seeds=range(n))


def test_shapes_captured_on_first_use_in_any_order_equal_eager():
    model = _model()
    graph, eager = _policy(model, True), _policy(model, False)
    assert graph.scheduler.stats.captures == 0  # nothing at construction
    seen = set()
    for i, (n, length, k) in enumerate(SHAPES):
        before = graph.scheduler.stats.captures
        a, b = _act(graph, n, length, k, i), _act(eager, n, length, k, i)
        for name in ("chains", "log_prob_elements", "values", "denoise_inds"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (n, length, k, name)
        bucket = graph.scheduler.prompt_bucket_for(length)
        new = {(n, bucket)} - {s[:2] for s in seen}, {(n, bucket, k)} - seen
        assert graph.scheduler.stats.captures - before == len(new[0]) + len(new[1])  # prefix and/or denoise
        seen |= {(n, bucket, k)}
    keys = graph.scheduler.stats.graph_keys
    assert len(keys) == len(set(keys)) == graph.scheduler.stats.captures


def test_a_new_shape_mid_run_recaptures_nothing_and_is_not_stale_after_sync_weights():
    old, new = _model(), _model()
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.01 * torch.randn_like(p))
    graph = _policy(_model(), True)
    ref_old, ref_new = _policy(old, False), _policy(new, False)
    _act(graph, 4, 48, 5, 0)  # shape A, captured under the old weights
    captures = graph.scheduler.stats.captures
    graph.sync_weights(new, expected="all")
    for seed, (n, length) in enumerate([(2, 200), (4, 48)]):  # shape B, first met after the sync; then A again
        got, want = _act(graph, n, length, 5, seed), _act(ref_new, n, length, 5, seed)
        assert torch.equal(got.chains, want.chains), (n, length)
    assert graph.scheduler.stats.captures == captures + 2  # B's prefix and denoise; A kept
    graph.sync_weights(old, expected="all")  # B was captured under the new weights: it must follow the old ones now
    for seed, (n, length) in enumerate([(2, 200), (4, 48)]):
        assert torch.equal(_act(graph, n, length, 5, seed).chains, _act(ref_old, n, length, 5, seed).chains)
    assert graph.scheduler.stats.captures == captures + 2


def test_warmup_list_is_captured_at_construction_and_reused():
    from dataclasses import replace

    from test_scheduler_cuda import _Proc

    from policies.pi05.scheduler import SchedulerConfig

    sched = SchedulerConfig(max_batch_size=8, num_steps=(5, 10), prompt_buckets=(16, 48, 200),
                            camera_sets=((0, 1, 2),), warmup=((8, 48), (3, 16)))  # fmt: skip
    policy = Pi05Policy(_model(), _Proc((0, 1, 2)), RolloutConfig(num_steps=5, action_chunk=4), sched)
    assert policy.scheduler.stats.captures == 2 * (1 + 2)  # 2 shapes x (prefix + 2 K)
    _act(policy, 8, 40, 10, 0)
    _act(policy, 3, 12, 5, 1)
    assert policy.scheduler.stats.captures == 6
    lazy = Pi05Policy(policy.model, _Proc((0, 1, 2)), policy.rollout, replace(sched, warmup=()))
    assert lazy.scheduler.stats.captures == 0


def test_cuda_processor_takes_uint8_to_the_device_and_matches_the_cpu_processor(standin_tokenizer):
    from policies.pi05.processor import Pi05Processor

    kw = dict(action_dim=7, tokenizer=standin_tokenizer, prompt_format="state", norm_mode="identity",
              camera_map={"image": "base_0_rgb", "wrist": "left_wrist_0_rgb"})  # fmt: skip
    cuda = Pi05Processor.for_config(Pi05Config.tiny(max_token_len=200), device="cuda", **kw)
    cpu = Pi05Processor.for_config(Pi05Config.tiny(max_token_len=200), device="cpu", **kw)
    rng = np.random.default_rng(0)
    for n in (1, 4, 1):  # repeated calls reuse the pinned staging memory
        obs = {"images": {"image": rng.integers(0, 256, (n, 256, 256, 3), dtype=np.uint8),
                          "wrist": rng.integers(0, 256, (n, 256, 256, 3), dtype=np.uint8)},
               "state": rng.uniform(-1, 1, (n, 8)).astype(np.float32), "task": ["pick up the cube"] * n}  # fmt: skip
        a, b = cuda(obs), cpu(obs)
        assert a.images.device.type == "cuda" and a.images.dtype == torch.uint8
        assert torch.equal(a.images.cpu(), b.images)  # the device resize == the CPU reference
        assert torch.equal(a.tokens.cpu(), b.tokens) and torch.equal(a.lengths.cpu(), b.lengths)
        assert torch.equal(a.state.cpu(), b.state)
