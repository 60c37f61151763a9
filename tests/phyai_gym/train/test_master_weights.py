"""MasterWeights: bfloat16 gradients summed on the float32 masters across micro-batches."""

from __future__ import annotations

import torch

from phyai_gym.train.master_weights import MasterWeights


def test_accumulate_adds_each_backward_in_float32_and_plain_copy_replaces() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3).to(torch.bfloat16)
    master = MasterWeights(model.parameters())
    per_part = []
    for part in torch.randn(6, 8, dtype=torch.bfloat16).split(2):
        model(part).float().square().sum().backward()
        per_part.append([p.grad.float() for p in model.parameters()])
        master.grads_to_masters(accumulate=True)
        assert all(p.grad is None for p in model.parameters())  # released: the next part starts from none
    summed = [per_part[0][i] + per_part[1][i] + per_part[2][i] for i in range(2)]
    assert all(torch.equal(m.grad, s) for m, s in zip(master.parameters(), summed, strict=True))
    model(torch.ones(1, 8, dtype=torch.bfloat16)).float().sum().backward()
    last = [p.grad.float() for p in model.parameters()]
    master.grads_to_masters()  # without accumulate: the masters get this backward's gradients only
    assert all(torch.equal(m.grad, g) for m, g in zip(master.parameters(), last, strict=True))


class _StaticGradient(torch.autograd.Function):
    """x * w whose backward returns one reused buffer as w's gradient, as a replayed CUDA graph does."""

    @staticmethod
    def forward(ctx, x, w, buffer):
        ctx.save_for_backward(x)
        ctx.buffer = buffer
        return x * w

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        ctx.buffer.copy_((grad * x).sum(dim=0))  # the replay overwrites the buffer autograd may hold as w.grad
        return None, ctx.buffer.detach(), None


def test_accumulate_keeps_a_float32_parameters_sum_when_its_gradient_was_a_reused_buffer() -> None:
    w = torch.nn.Parameter(torch.ones(4))  # float32: its own master
    master, buffer = MasterWeights([w]), torch.zeros(4)
    parts = [torch.full((2, 4), 1.0), torch.full((2, 4), 3.0)]
    for part in parts:
        _StaticGradient.apply(part, w, buffer).sum().backward()
        master.grads_to_masters(accumulate=True)
    assert torch.equal(w.grad, torch.full((4,), 2.0 + 6.0))  # not 2 x 6: the first part's sum was kept
