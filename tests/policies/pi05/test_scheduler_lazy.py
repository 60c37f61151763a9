"""Shapes met on first use (issue 41) on CPU: which graph keys exist when, bucket choice for every N, the warm-up
list, a new prompt bucket mid-run; the host path (resize, bounded task cache); padded vs exact batches.

On CPU nothing is captured, but the scheduler keeps the same bookkeeping as on CUDA (`SchedulerStats.graph_keys`:
each key once, in first-use order); `test_scheduler_lazy_cuda.py` checks the real graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import SLOTS, make_inputs, make_model
from test_scheduler import make_scheduler, run, streams

from policies.base import RolloutConfig
from policies.pi05.image_ops import resize_with_pad
from policies.pi05.processor import Pi05Processor, ProcessorConfig
from policies.pi05.prompt import PromptBuilder, host_tokenize
from policies.pi05.scheduler import Pi05Scheduler, SchedulerConfig


def _keys(n: int, length: int, ks=(5,), cams=SLOTS) -> list[tuple]:
    """Graph keys a shape creates: the prefix, then one denoise graph per K."""
    return [(n, length, cams)] + [(n, length, cams, k, False) for k in ks]


def test_nothing_at_setup_then_each_shape_once_and_a_new_prompt_bucket_adds_only_its_own() -> None:
    sched = make_scheduler(max_batch_size=4)
    assert sched.stats.graph_keys == [] and sched.stats.captures == 0
    run(sched, make_inputs(3, seed=1), *streams(3))
    assert sched.stats.graph_keys == _keys(3, 16)
    run(sched, make_inputs(3, seed=2), *streams(3))  # the same shape: replayed, nothing new
    run(sched, make_inputs(1, seed=3), *streams(1))
    assert sched.stats.graph_keys == _keys(3, 16) + _keys(1, 16)
    run(sched, make_inputs(3, seed=4, prompt=20), *streams(3))  # a new prompt bucket mid-run (48)
    assert sched.stats.graph_keys == _keys(3, 16) + _keys(1, 16) + _keys(3, 48)
    run(sched, make_inputs(3, seed=5), *streams(3))  # back to the first shape: still nothing recaptured
    sched.prefix_value(make_inputs(2, seed=6))  # the value path needs only the prefix graph
    assert sched.stats.graph_keys[-1] == (2, 16, SLOTS) and len(set(sched.stats.graph_keys)) == 7
    run(sched, make_inputs(9, seed=7), *streams(9))  # split 4 + 4 + 1: bucket 4 is new, bucket 1 is not
    assert sched.stats.graph_keys[7:] == _keys(4, 16) and sched.stats.captures == 0


@pytest.mark.parametrize("max_batch_size", [64, 48])
def test_every_batch_size_runs_unpadded_by_default(max_batch_size: int) -> None:
    sched = Pi05Scheduler(make_model(0), SchedulerConfig(max_batch_size=max_batch_size, prompt_buckets=(16,)))
    assert all(sched.bucket_for(n) == n for n in range(1, max_batch_size + 1))
    # above max_batch_size: full chunks and an exact remainder
    assert sched._chunk_buckets(2 * max_batch_size + 5) == {max_batch_size, 5}
    # a coarse grid still pads every N to the smallest bucket >= N
    coarse = Pi05Scheduler(make_model(0), SchedulerConfig(max_batch_size=64, batch_buckets=(8, 16, 32, 64)))
    assert [coarse.bucket_for(n) for n in (1, 8, 9, 33, 64)] == [8, 8, 16, 64, 64]


def test_warmup_list_is_captured_at_setup_and_not_again() -> None:
    sched = make_scheduler(max_batch_size=4, warmup=((3, 20), (1, 16), (3, 48)))  # (3, 48): the same bucket as (3, 20)
    assert sched.stats.graph_keys == _keys(3, 48, ks=(3, 5)) + _keys(1, 16, ks=(3, 5))
    run(sched, make_inputs(3, seed=1, prompt=20), *streams(3))
    run(sched, make_inputs(1, seed=1), *streams(1), opts=RolloutConfig(num_steps=3, action_dim=7))
    assert len(sched.stats.graph_keys) == 6
    assert sched.warmup([(3, 30), (2, 16)]) == 3  # 3 x 48 exists; 2 x 16: prefix + 2 K
    grid = make_scheduler(max_batch_size=2, num_steps=(5,), warmup="all")
    assert grid.stats.graph_keys == _keys(2, 16) + _keys(2, 48) + _keys(1, 16) + _keys(1, 48)


def test_bad_warmup_names_the_argument() -> None:
    with pytest.raises(ValueError, match=r"SchedulerConfig.warmup\[0\]\[0\] \(batch_size\).*1\.\.max_batch_size \(4\)"):
        SchedulerConfig(max_batch_size=4, warmup=((8, 16),))
    with pytest.raises(TypeError, match=r"SchedulerConfig.warmup: .*'all'"):
        SchedulerConfig(warmup="some")
    with pytest.raises(TypeError, match=r"SchedulerConfig.warmup\[0\]: .*pair"):
        SchedulerConfig(warmup=(4, 16))
    with pytest.raises(ValueError, match=r"shapes\[0\]\[1\] \(prompt_length\)"):
        make_scheduler().warmup([(1, 0)])


def test_make_policy_captures_nothing_until_the_first_call_unless_asked() -> None:
    from phyai_gym.make import make_policy

    obs = {"images": {"image": np.zeros((5, 64, 64, 3), np.uint8)}, "state": np.zeros((5, 4), np.float32),
           "task": ["push the block"] * 5}  # fmt: skip
    policy = make_policy(action_dim=1, max_batch_size=8)
    assert policy.scheduler.stats.graph_keys == []
    policy.act(obs)
    assert [key[0] for key in policy.scheduler.stats.graph_keys] == [5, 5]  # unpadded: prefix and denoise at N=5
    warm = make_policy(action_dim=1, max_batch_size=8, warmup=((5, 16),))
    assert len(warm.scheduler.stats.graph_keys) == 2


def test_padded_and_exact_batches_give_the_same_rows() -> None:
    exact = make_scheduler(max_batch_size=4)
    padded = make_scheduler(max_batch_size=4, batch_buckets=(1, 2, 4))
    x, (seeds, counters) = make_inputs(3, seed=8), streams(3)
    a, a_inds = run(exact, x, seeds, counters)
    b, b_inds = run(padded, x, seeds, counters)
    assert exact.stats.graph_keys[0][0] == 3 and padded.stats.graph_keys[0][0] == 4
    assert torch.equal(a.chain[:, 0], b.chain[:, 0]) and torch.equal(a_inds, b_inds)  # the draws: bitwise
    torch.testing.assert_close(a.chain, b.chain, atol=1e-5, rtol=1e-5)  # CPU GEMMs: ulps across batch sizes
    torch.testing.assert_close(a.log_prob_elements, b.log_prob_elements, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ host path
def test_processor_resizes_uint8_on_its_device_like_the_reference(standin_tokenizer) -> None:
    cfg = ProcessorConfig(camera_map={"image": "base_0_rgb", "wrist": "left_wrist_0_rgb"}, image_size=224,
                          prompt_format="text", tokenizer=str(standin_tokenizer), action_dim=7)  # fmt: skip
    proc = Pi05Processor(cfg)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (2, 256, 256, 3), dtype=np.uint8)
    wrist = rng.integers(0, 256, (2, 128, 160, 3), dtype=np.uint8)
    x = proc({"images": {"image": base, "wrist": wrist}, "task": ["a", "b"]})
    assert x.images.dtype == torch.uint8
    for j, img in enumerate((base, wrist)):
        for i in range(2):  # one image at a time through the reference resize
            assert torch.equal(x.images[i, j], resize_with_pad(torch.from_numpy(img[i]), 224, "antialias"))


def test_task_tokens_are_cached_identical_and_bounded(standin_tok) -> None:
    builder = PromptBuilder(standin_tok, "state", max_token_len=48, max_cached_tasks=2)
    state = torch.tensor([[0.1, -0.5], [0.7, 0.0], [-1.0, 0.99]])
    calls = [["open", "close", "open"], ["open", "close", "open"], ["push", "pull", "push"],
             ["open", "close", "lift"], ["open", "open", "open"]]  # fmt: skip
    largest = 0
    for step, tasks in enumerate(calls):
        tokens, lengths = builder(tasks, state)
        bins = ((state + 1) * 128).floor().clamp(-1, 255).int().tolist()
        for i, task in enumerate(tasks):
            want = host_tokenize(standin_tok, task, "state", bins[i])
            assert lengths[i].item() == len(want) and tokens[i, : len(want)].tolist() == want
        largest = max(largest, len(set(tasks)))
        assert builder.num_cached_tasks <= max(2, largest)  # the bound, or a larger call's own tasks
        if step == 2:  # "push", "pull": the table started over without "open" and "close"
            assert builder.num_cached_tasks == 2
    with pytest.raises(ValueError, match="max_cached_tasks"):
        PromptBuilder(standin_tok, "text", max_cached_tasks=0)
