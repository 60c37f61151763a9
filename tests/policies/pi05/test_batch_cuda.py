"""The trainer path on the GPU (run by benchmarks/gpu_suite.py; skipped on CPU): the graphs' kept prefix K/V equal
eager's, declared buckets are captured once, and the bf16 trainer reproduces the graph rollout's log-probs."""

from dataclasses import replace

import pytest
import torch
from test_scheduler_cuda import _inputs, _model, _policy

from phyai_gym.train.master_weights import MasterWeights
from policies.pi05.batch import RolloutBatch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_suite.py)"),
]


def _keeping(policy):
    policy.rollout = replace(policy.rollout, keep_prefix=True, method="sde", joint=True)
    return policy


def test_graph_prefix_kv_equals_eager_and_trainer_ratio_is_one():
    model = _model()
    graph, eager = _keeping(_policy(model, graphs=True)), _keeping(_policy(model, graphs=False))
    x = _inputs(5, 48, 40)
    a = graph.act_inputs(x, seeds=torch.arange(5))
    b = eager.act_inputs(x, seeds=torch.arange(5))
    assert torch.equal(a.prefix.kv, b.prefix.kv) and torch.equal(a.prefix.pooled, b.prefix.pooled)
    assert torch.equal(a.chains, b.chains)
    with torch.no_grad():
        ev = eager.evaluate(RolloutBatch.from_output(a))  # the trainer: eager, same bf16 weights, kept prefix
    log_ratio = (ev.log_prob - a.log_prob).abs()
    assert float(log_ratio.max()) < 0.05, log_ratio
    master = MasterWeights(p for _, p in eager.trainable_parameters())
    ev = eager.evaluate(RolloutBatch.from_output(a))
    (ev.log_prob.sum() + ev.values.sum()).backward()
    master.grads_to_masters()
    grads = [m.grad for m in master.parameters() if m.grad is not None]
    assert len(grads) > len(master.parameters()) // 2 and all(torch.isfinite(g).all() for g in grads)
    assert all(g.dtype == torch.float32 for g in grads)


def test_batch_sizes_are_captured_once_on_first_use_and_never_again():
    policy = _policy(_model(), graphs=True)
    assert policy.declare_batch_sizes([3, 5]) == ()  # the default buckets hold every size already
    for step in range(100):
        n = 3 if step % 2 else 5
        out = policy.act_inputs(_inputs(n, 48, 40, seed=step), env_ids=torch.arange(n))
        assert out.actions.shape[0] == n
    assert policy.scheduler.stats.captures == 2 * (1 + 1)  # 2 sizes x (prefix + the K in use), one prompt bucket
    assert policy.scheduler.bucket_for(3) == 3 and policy.scheduler.bucket_for(5) == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_evaluate_equals_eager_gradients_included(dtype):
    model = _model(dtype)
    rollout, trainer = _keeping(_policy(model, graphs=True)), _keeping(_policy(model, graphs=False))
    batch = RolloutBatch.from_output(rollout.act_inputs(_inputs(6, 48, 40), seeds=torch.arange(6)))

    def run(graphed: bool):
        trainer.model.zero_grad(set_to_none=True)
        ev = trainer.evaluate(batch, cuda_graphs=graphed)
        (ev.log_prob.sum() + ev.values.sum()).backward()
        grads = {n: p.grad.float().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        return ev.log_prob.detach().clone(), ev.values.detach().clone(), grads

    # float32: equal to float rounding. bfloat16: the backward's atomic index_add / GEMM split-K order differs between
    # capture and eager launches, so gradients agree to bf16 rounding: relative error of each gradient's norm.
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for _ in range(2):  # the first graphed call captures, the second replays
        eager, graphed = run(False), run(True)
        torch.testing.assert_close(graphed[0], eager[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graphed[1], eager[1], atol=1e-5, rtol=1e-5)
        assert graphed[2].keys() == eager[2].keys() and len(eager[2]) > 10
        rel = {n: float((graphed[2][n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in eager[2].items()}
        worst = max(rel, key=rel.get)
        assert rel[worst] <= tol, f"{worst}: |graphed - eager| / |eager| = {rel[worst]:.2e} > {tol:.0e}"
        with torch.no_grad():  # an optimizer step in place: the next replay reads the new weights
            trainer.model.expert.layers[0].mlp.down_proj.weight.mul_(1.5)


def test_graphed_micro_batches_accumulate_the_eager_whole_batch_gradients():
    # --micro-batch-size: two graphed halves, each backward summed on the float32 masters, against one eager backward
    model = _model(torch.bfloat16)
    rollout, trainer = _keeping(_policy(model, graphs=True)), _keeping(_policy(model, graphs=False))
    batch = RolloutBatch.from_output(rollout.act_inputs(_inputs(6, 48, 40), seeds=torch.arange(6)))
    master = MasterWeights(p for _, p in trainer.trainable_parameters())

    def masters_grads(parts: list[torch.Tensor], graphed: bool) -> list[torch.Tensor]:
        for m in master.parameters():
            m.grad = None
        for part in parts:
            ev = trainer.evaluate(batch.select(part), cuda_graphs=graphed)
            (ev.log_prob.sum() + ev.values.sum()).backward()
            master.grads_to_masters(accumulate=True)
        return [m.grad.clone() for m in master.parameters() if m.grad is not None]

    whole = masters_grads([torch.arange(6, device="cuda")], graphed=False)
    for _ in range(2):  # capture, then replay: the graphs' static gradient buffers must not be reused as .grad
        halves = masters_grads(list(torch.arange(6, device="cuda").split(3)), graphed=True)
        assert len(halves) == len(whole) > 10
        rel = [float((h - w).norm() / w.norm().clamp_min(1e-12)) for h, w in zip(halves, whole, strict=True)]
        assert max(rel) <= 2e-2, max(rel)  # bf16 rounding of each part's gradients (see the test above)
