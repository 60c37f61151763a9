"""`evaluate()` against an independent float64 recomputation from the stored chain, gradcheck through it,
and which parameters its gradients reach.

The reference below uses the model only for network pieces (prefix cache, expert pass, time condition,
head MLP layers); the schedule, sigma, transition mean/std, noise-head bounds, Gaussian density, crop,
step reduction, value pooling and entropy are written out here in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import expert_side, float64_copy, make_inputs, make_policy, perturb_
from torch import nn

from policies.pi05.evaluate import evaluate_rollout
from policies.pi05.model import Pi05Model

METHODS = [("sde", False), ("sde", True), ("noise", False), ("ode", False)]


def _mlp(layers: nn.Sequential, h: torch.Tensor, act) -> torch.Tensor:
    for layer in layers:
        h = h @ layer.weight.T + layer.bias if isinstance(layer, nn.Linear) else act(h)
    return h


def reference_evaluate(model: Pi05Model, inputs, chains, inds, method, joint, noise_level, chunk, adim):
    """float64 log-prob elements (B, C, A), values (B,), entropy (B,) from the stored chain."""
    cfg = model.config
    b, k1 = chains.shape[:2]
    k = k1 - 1
    chains = chains.double()
    emb, valid = model.embed_prefix(inputs.images, inputs.image_mask, inputs.tokens, inputs.token_mask)
    cache = model.run_prefix(emb, valid, need_output=cfg.value_source == "prefix")
    # schedule: RLinf's float32 linspace (reference section 2.1), everything after it in float64
    times = torch.cat([torch.linspace(1.0, 1.0 / k, k), torch.zeros(1)]).double()
    deltas = times[:-1] - times[1:]
    t_den = times.clone()
    t_den[0] = times[1]
    sigmas = noise_level * torch.sqrt(times[:-1] / (1.0 - t_den[:-1]))
    lo, hi = (2 * math.log(s) for s in cfg.noise_std_range)

    def log_normal(x, mean, std):
        return -torch.log(std) - 0.5 * math.log(2 * math.pi) - 0.5 * ((x - mean) / std) ** 2

    def step(x, i):
        mods = model.modulations(model.time_condition(times[i].expand(x.shape[0])))
        out = model.expert_step(cache, x, mods)
        return out @ model.action_out_proj.weight.T + model.action_out_proj.bias, out

    def mean_std(x, v, out, i):
        ode = x - deltas[i] * v
        if method == "sde":
            x1_hat = x + (1 - times[i]) * v
            return ode - sigmas[i] ** 2 * deltas[i] / (2 * times[i]) * x1_hat, torch.sqrt(deltas[i]) * sigmas[i]
        r = _mlp(model.noise_head.mlp, out, torch.tanh)
        return ode, torch.exp(0.5 * (lo + (hi - lo) * (torch.tanh(r) + 1) / 2))

    def suffix_value(out):
        width = min(chunk, out.shape[1]) if cfg.value_chunk_only else out.shape[1]
        return _mlp(model.value_head.mlp, out[:, :width].mean(dim=1), torch.relu)[:, 0]

    lp = torch.zeros(b, chunk, adim, dtype=torch.float64)
    values = torch.zeros(b, dtype=torch.float64)
    entropy = torch.zeros(b, dtype=torch.float64)
    if method == "ode":
        pass
    elif method == "sde" and not joint:
        for row in range(b):
            j = int(inds[row, 0])
            x = chains[row : row + 1, j]
            v, out = step_row(model, cache, row, x, times[j])
            mean, std = mean_std(x, v, out, j)
            lp[row] = log_normal(chains[row, j + 1], mean[0], std)[:chunk, :adim]
            if model.value_head is not None and cfg.value_source == "suffix":
                values[row] = suffix_value(out)[0]
    else:
        total = log_normal(chains[:, 0], torch.zeros(()), torch.ones(()))
        ent = torch.zeros(b, dtype=torch.float64)
        for i in range(k):
            v, out = step(chains[:, i], i)
            mean, std = mean_std(chains[:, i], v, out, i)
            total = total + log_normal(chains[:, i + 1], mean, std)
            if model.value_head is not None and cfg.value_source == "suffix":
                values = values + suffix_value(out) / k
            if method == "noise":
                ent = ent + (0.5 * torch.log(2 * math.pi * math.e * std[:, :chunk, :adim] ** 2)).mean(dim=(1, 2)) / k
        lp = (total / (k + 1))[:, :chunk, :adim]
        entropy = ent
    if method == "ode" and model.value_head is not None and cfg.value_source == "suffix":
        for i in range(k):
            values = values + suffix_value(step(chains[:, i], i)[1]) / k
    if model.value_head is not None and cfg.value_source == "prefix":
        w = valid.double()[..., None]
        pooled = (cache.output.double() * w).sum(dim=1) / w.sum(dim=1)
        values = _mlp(model.value_head.mlp, pooled, torch.relu)[:, 0]
    return lp, values, entropy


def step_row(model, cache, row, x, t):
    """One expert pass for a single row of the cache (the reference loops over rows for per-env j)."""
    from policies.pi05.model import PrefixCache

    sub = PrefixCache(
        [kk[row : row + 1] for kk in cache.keys],
        [vv[row : row + 1] for vv in cache.values],
        cache.key_mask[row : row + 1],
        cache.num_valid[row : row + 1],
    )
    out = model.expert_step(sub, x, model.modulations(model.time_condition(t.reshape(1))))
    return out @ model.action_out_proj.weight.T + model.action_out_proj.bias, out


@pytest.mark.parametrize("value_source", ["suffix", "prefix"])
@pytest.mark.parametrize("method,joint", METHODS)
def test_evaluate_after_update_matches_float64_reference(method: str, joint: bool, value_source: str) -> None:
    policy = make_policy(value_source, method=method, joint=joint, noise_level=0.45, action_chunk=3, num_steps=(4,))
    x = make_inputs(3, seed=11)
    batch = policy.act_inputs(x, seeds=[21, 22, 23])
    perturb_(expert_side(policy.model), seed=5)
    with torch.no_grad():
        ev = policy.evaluate(batch)
        model64 = float64_copy(policy.model)
        ref_lp, ref_values, ref_entropy = reference_evaluate(
            model64, x, batch.chains, batch.denoise_inds, method, joint, 0.45, 3, 7
        )
        # evaluate_rollout itself in float64 on the float64 model: agrees to float64 round-off
        ev64 = evaluate_rollout(model64, _stored(x, batch.chains.double(), batch), _opts(policy, batch), False)
    assert ev64.log_prob_elements.dtype == torch.float64
    torch.testing.assert_close(ev64.log_prob_elements, ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ev64.values, ref_values, atol=1e-9, rtol=1e-8)
    torch.testing.assert_close(ev64.entropy, ref_entropy, atol=1e-9, rtol=1e-8)
    # the fp32 evaluate agrees to fp32 accuracy (|d mu| / s^2 amplification at s ~ 0.1)
    torch.testing.assert_close(ev.log_prob_elements.double(), ref_lp, atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(ev.log_prob.double(), ref_lp.sum(dim=(1, 2)), atol=5e-3, rtol=1e-4)
    torch.testing.assert_close(ev.values.double(), ref_values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ev.entropy.double(), ref_entropy, atol=1e-5, rtol=1e-5)
    if method != "ode":  # the update moved the log-probs (the comparison above is not vacuous)
        assert (ev.log_prob - batch.log_prob).abs().min() > 1e-3


def _stored(inputs, chains, out):
    from policies.pi05.batch import RolloutBatch

    return RolloutBatch(inputs, chains, out.denoise_inds, out.log_prob, out.values, out.header)


def _opts(policy, batch):
    from policies.base import RolloutConfig

    h = batch.header
    return RolloutConfig(method=h.method, num_steps=h.num_steps, noise_level=h.noise_level,
                           joint=h.joint and h.method == "sde", action_chunk=h.action_chunk, action_dim=h.action_dim)


class _Evaluate(nn.Module):
    """`evaluate_rollout` as a module call so that `torch.func.functional_call` can swap parameters."""

    def __init__(self, model, inputs, chains, out, opts) -> None:
        super().__init__()
        self.model = model
        self.inputs, self.chains, self.out, self.opts = inputs, chains, out, opts

    def forward(self, chains=None):
        batch = _stored(self.inputs, self.chains if chains is None else chains, self.out)
        ev = evaluate_rollout(self.model, batch, self.opts, train_prefix=False)
        return torch.cat([ev.log_prob, ev.values, ev.entropy])


GRAD_PARAMS = [
    ("model.expert.layers.0.self_attn.q_proj.weight", (1, 2)),
    ("model.expert.layers.1.mlp.down_proj.weight", (3, 5)),
    ("model.expert.layers.0.input_layernorm.dense.bias", (7,)),
    ("model.expert.norm.dense.weight", (50, 3)),
    ("model.action_in_proj.weight", (0, 0)),
    ("model.time_mlp_in.bias", (1,)),
    ("model.action_out_proj.bias", (2,)),
    ("model.value_head.mlp.0.weight", (0, 0)),
    ("model.noise_head.mlp.0.weight", (1, 1)),
]


@pytest.mark.parametrize("method,joint", [("sde", False), ("noise", False)])
def test_gradcheck_through_evaluate_float64(method: str, joint: bool) -> None:
    policy = make_policy("suffix", method=method, joint=joint, action_chunk=2, num_steps=(3,))
    x = make_inputs(2, seed=12)
    batch = policy.act_inputs(x, seeds=[1, 2])
    model64 = float64_copy(policy.model)
    wrapper = _Evaluate(model64, x, batch.chains.double(), batch, _opts(policy, batch))
    base = dict(wrapper.named_parameters())

    def f(delta: torch.Tensor) -> torch.Tensor:
        params = {}
        for n, (name, idx) in enumerate(GRAD_PARAMS):
            bump = torch.zeros_like(base[name])
            bump[idx] = 1.0
            params[name] = base[name].detach() + bump * delta[n]
        return torch.func.functional_call(wrapper, params, ())

    delta = torch.zeros(len(GRAD_PARAMS), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (delta,), eps=1e-6, atol=1e-6, rtol=1e-4)
    # and w.r.t. a few entries of the stored chain (x_j, x_{j+1}, x_0, inside and outside the crop)
    chains = batch.chains.double()
    j = int(batch.denoise_inds[0, 0]) if method == "sde" else 1
    where = [(0, j, 0, 0), (0, j + 1, 1, 3), (1, 0, 0, 1), (1, j + 1, 5, 20), (0, j, 4, 31)]

    def g(dx: torch.Tensor) -> torch.Tensor:
        bumped = chains.clone()
        for n, idx in enumerate(where):
            bumped[idx] = bumped[idx] + dx[n]
        return wrapper(bumped)

    dx = torch.zeros(len(where), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(g, (dx,), eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("trainable", ["expert", "all"])
def test_gradients_reach_only_the_trainable_parameters(trainable: str) -> None:
    policy = make_policy("prefix", method="noise", trainable=trainable)
    model = policy.model
    x = make_inputs(2, seed=13)
    batch = policy.act_inputs(x, seeds=[3, 4])
    ev = policy.evaluate(batch)
    (ev.log_prob.sum() + ev.values.sum() + ev.entropy.sum()).backward()
    trainable_names = {n for n, _ in policy.trainable_parameters()}
    frozen_prefixes = ("vision.", "llm.", "projector.")
    for name, p in model.named_parameters():
        frozen = name.startswith(frozen_prefixes)
        if trainable == "expert" and frozen:
            assert not p.requires_grad and p.grad is None, name
            assert name not in trainable_names
            continue
        assert p.requires_grad and name in trainable_names, name
        assert p.grad is not None, name
        if name == "llm.embed_tokens.weight":  # only the rows of valid prompt ids (pad id 0 gets none)
            used = torch.unique(x.tokens[x.token_mask].long())
            assert 0 not in used.tolist() and (~x.token_mask).any()
            assert (p.grad[used].abs().sum(dim=1) > 0).all()
            unused = torch.ones(p.shape[0], dtype=torch.bool)
            unused[used] = False
            assert torch.equal(p.grad[unused], torch.zeros_like(p.grad[unused]))
        else:
            assert p.grad.abs().sum() > 0, name
    if trainable == "expert":
        assert trainable_names == {n for n, _ in model.named_parameters() if not n.startswith(frozen_prefixes)}
