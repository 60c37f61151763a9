"""Differentiable re-evaluation of stored rollouts for PPO: log-probs, values and entropy (DESIGN C4-C5).

From what a rollout stored (uint8 images, tokens, the fp32 chain, denoise indices, header) this recomputes
the transition log-probs of the executed steps with gradients through the trainable parameters:
  non-joint SDE : one expert pass per env at its step j (x_j -> x_{j+1}); values from step j (suffix source)
  joint / noise : all K transitions plus log N(x_0; 0, I), averaged over the K+1 rows; values averaged
Frozen parts (the VLM prefix by default) run without autograd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .inputs import ModelInputs
from .model import Pi05Model
from .rollout import prefix_values, run_prefix_stage
from .sampler import NO_NOISE_HEAD, SamplingOptions, StepTables, gaussian_log_prob, transition


@dataclass
class EvalOutput:
    """Recomputed quantities, differentiable w.r.t. the trainable parameters.

    Attributes:
        log_prob_elements: (B, C, A) element log-probs.
        log_prob: (B,) their sum over C x A.
        values: (B,) critic values.
        entropy: (B,) mean Gaussian entropy over steps x C x A (non-zero for the `noise` method).
    """

    log_prob_elements: torch.Tensor
    log_prob: torch.Tensor
    values: torch.Tensor
    entropy: torch.Tensor


def evaluate_rollout(
    model: Pi05Model,
    inputs: ModelInputs,
    chains: torch.Tensor,
    denoise_inds: torch.Tensor,
    opts: SamplingOptions,
    train_prefix: bool,
) -> EvalOutput:
    """Recompute log-probs / values / entropy for stored chains (B, K+1, H, D)."""
    if opts.method == "noise" and model.noise_head is None:
        raise ValueError(NO_NOISE_HEAD)
    k = opts.num_steps
    c, a = opts.action_chunk, opts.action_dim
    tables = StepTables.build(k, chains.device)
    with torch.set_grad_enabled(train_prefix and torch.is_grad_enabled()):
        cache = run_prefix_stage(model, inputs.images, inputs.image_mask, inputs.tokens, inputs.lengths)
    chunk_pool = model.config.value_source == "suffix" and model.config.value_chunk_only
    pooled_len = min(c, chains.shape[2]) if chunk_pool else None
    b = chains.shape[0]
    dtype = chains.dtype
    sigmas = tables.sigmas(opts.noise_level).to(dtype)
    times, deltas = tables.times.to(dtype), tables.deltas.to(dtype)

    def step(x: torch.Tensor, t: torch.Tensor):
        out = model.expert_step(cache, x, model.modulations(model.time_condition(t)))
        return model.velocity(out).to(dtype), out.to(dtype)

    one = torch.ones((), dtype=dtype, device=chains.device)
    sde_on = one * float(opts.method == "sde")
    noise_on = one * float(opts.method == "noise")
    suffix_values = []
    entropies = []
    if opts.method == "sde" and not opts.is_joint:
        j = denoise_inds[:, 0].long()
        rows = torch.arange(b, device=chains.device)
        x, x_next = chains[rows, j], chains[rows, j + 1]
        t = times[j]
        v, out = step(x, t)
        bc = lambda z: z[:, None, None]
        mean, std = transition(x, v, bc(t), bc(deltas[j]), bc(sigmas[j]), one, sde_on, noise_on, None)
        lp = gaussian_log_prob(x_next, mean, std)
        suffix_values.append(out)
    else:
        lp = torch.zeros_like(chains[:, 0])
        if opts.is_joint:
            x0 = chains[:, 0]
            lp = gaussian_log_prob(x0, torch.zeros_like(x0), torch.ones_like(x0))
        stochastic = one * float(opts.method != "ode")
        for i in range(k):
            x = chains[:, i]
            v, out = step(x, times[i].expand(b))
            learned = model.noise_head(out) if (opts.method == "noise" and model.noise_head is not None) else None
            mean, std = transition(x, v, times[i], deltas[i], sigmas[i], stochastic, sde_on, noise_on, learned)
            lp = lp + gaussian_log_prob(chains[:, i + 1], mean, std)
            suffix_values.append(out)
            if learned is not None:
                entropies.append(0.5 * torch.log(2.0 * math.pi * math.e * learned[:, :c, :a] ** 2).mean(dim=(1, 2)))
        if opts.is_joint:
            lp = lp / (k + 1)
    elements = lp[:, :c, :a]
    if model.config.value_source == "suffix" and model.value_head is not None:
        values = torch.stack([model.suffix_value(o, pooled_len) for o in suffix_values]).mean(dim=0)
    else:
        pv = prefix_values(model, cache)
        values = pv if pv is not None else torch.zeros(b, dtype=dtype, device=chains.device)
    entropy = torch.stack(entropies).mean(dim=0) if entropies else torch.zeros(b, dtype=dtype, device=chains.device)
    return EvalOutput(elements, elements.sum(dim=(1, 2)), values.to(dtype), entropy)
