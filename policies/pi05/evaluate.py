"""Differentiable re-evaluation of stored rollouts for PPO: log-probs, values and entropy (DESIGN C4, C5, C9).

From what a rollout stored (uint8 images, tokens, the fp32 chain, denoise indices, header) this recomputes the
transition log-probs of the executed steps with gradients through the trainable parameters:
  non-joint SDE : one expert row per env at its step j (x_j -> x_{j+1}); values from step j (suffix source)
  joint / noise : K rows per env plus log N(x_0; 0, I), averaged over the K+1 terms; values averaged
All rows go through the expert in ONE pass (B x K rows for the joint methods, each with its own t_i): the stored
chain fixes every x_i, so the K steps are independent given it, and one pass launches K times fewer kernels.

It computes what the rollout computed, in the rollout's precision: the adaRMS modulations from the same batched
table cast to the compute dtype, the fused [q;k;v] / [gate;up] GEMMs, the "gemm" attention math and the
single-rounding GeGLU. The frozen prefix (trainable = "expert") is never differentiated: it comes from the
rollout's own K/V when the batch kept them (`RolloutConfig.keep_prefix`), else it is recomputed without autograd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..base import RolloutConfig
from .batch import RolloutBatch, StoredPrefix
from .model import Pi05Model, PrefixCache
from .rollout import run_prefix_stage
from .sampler import NO_NOISE_HEAD, StepTables, gaussian_log_prob, transition


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


def _rows(opts: RolloutConfig, denoise_inds: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample index, step index) of every expert row: (b, j_b) for non-joint SDE, else (b, i) for i < K."""
    b = denoise_inds.shape[0]
    dev = denoise_inds.device
    if opts.method == "sde" and not opts.is_joint:
        return torch.arange(b, device=dev), denoise_inds[:, 0].long()
    return torch.arange(b, device=dev).repeat_interleave(k), torch.arange(k, device=dev).repeat(b)


def _expand(cache: PrefixCache, rows: torch.Tensor) -> PrefixCache:
    """The cache's rows `rows` (one per expert row)."""
    return PrefixCache(
        keys=[k.index_select(0, rows) for k in cache.keys],
        values=[v.index_select(0, rows) for v in cache.values],
        key_mask=cache.key_mask.index_select(0, rows),
        num_valid=cache.num_valid.index_select(0, rows),
    )


def evaluate_rollout(
    model: Pi05Model, batch: RolloutBatch, opts: RolloutConfig, train_prefix: bool, steps: StepTables | None = None
) -> EvalOutput:
    """Recompute log-probs / values / entropy for the stored chains (B, K+1, H, D) of `batch`.

    `steps` are the schedule tables of K on the batch's device (built here when not given).
    """
    if opts.method == "noise" and model.noise_head is None:
        raise ValueError(NO_NOISE_HEAD)
    chains, k = batch.chains, opts.num_steps
    c, a = opts.action_chunk, opts.action_dim
    b, dtype, dev = chains.shape[0], chains.dtype, chains.device

    # ---- prefix: the rollout's K/V, or recomputed (differentiable only when it is trained) ----------------------
    if batch.prefix is not None and not train_prefix:
        cache, pooled = batch.prefix.cache(), batch.prefix.pooled
    else:
        inputs = batch.inputs
        with torch.set_grad_enabled(train_prefix and torch.is_grad_enabled()):
            cache = run_prefix_stage(model, inputs.images, inputs.image_mask, inputs.tokens, inputs.lengths)
            pooled = model.prefix_pooled(cache) if cache.output is not None else None

    # ---- one expert pass over every (sample, step) row ---------------------------------------------------------
    rows_b, rows_i = _rows(opts, batch.denoise_inds, k)
    steps = steps or StepTables.build(k, dev)
    cond = model.time_condition(steps.times[:-1])  # (K, We), as the rollout tables
    table = model.modulation_table(cond).to(model.compute_dtype)  # (n_norms, K, 3We), the rollout's step table
    mods = [tuple(m[:, None].chunk(3, dim=-1)) for m in table.index_select(1, rows_i)]  # (R, 1, We) x 3 per norm
    x = chains[rows_b, rows_i]  # (R, H, D)
    row_cache = _expand(cache, rows_b) if rows_b.shape[0] != b else cache
    out = model.expert_step(row_cache, x, mods, fused=model.fused_weights())  # (R, H, We) float32
    v = model.velocity(out).to(dtype)
    learned = model.noise_head(out).to(dtype) if opts.method == "noise" else None

    one = torch.ones((), dtype=dtype, device=dev)
    sigmas = steps.sigmas(opts.noise_level).to(dtype)
    bc = lambda z: z.to(dtype)[rows_i][:, None, None]
    stochastic = one * float(opts.method != "ode")
    sde_on, noise_on = one * float(opts.method == "sde"), one * float(opts.method == "noise")
    mean, std = transition(
        x, v, bc(steps.times[:-1]), bc(steps.deltas), bc(sigmas), stochastic, sde_on, noise_on, learned
    )
    lp_rows = gaussian_log_prob(chains[rows_b, rows_i + 1], mean, std)  # (R, H, D)

    # ---- per sample: the rollout's accumulation (C4) -------------------------------------------------------------
    if opts.is_joint:
        w = 1.0 / (k + 1)
        x0 = chains[:, 0]
        lp = w * gaussian_log_prob(x0, torch.zeros_like(x0), torch.ones_like(x0))
        per_step = lp_rows.view(b, k, *lp_rows.shape[1:])
        for i in range(k):
            lp = lp + w * per_step[:, i]
    elif opts.method == "ode":  # every step deterministic: log-probs 0
        lp = lp_rows.view(b, k, *lp_rows.shape[1:]).sum(dim=1)
    else:
        lp = lp_rows
    elements = lp[:, :c, :a]

    if model.config.value_source == "suffix" and model.value_head is not None:
        chunk_pool = model.config.value_chunk_only
        values = model.suffix_value(out, min(c, chains.shape[2]) if chunk_pool else None)
        values = values.view(b, -1).mean(dim=1)
    elif model.value_head is not None and pooled is not None:
        values = model.value_head(pooled)
    else:
        values = torch.zeros(b, dtype=dtype, device=dev)
    if learned is not None:
        entropy = 0.5 * torch.log(2.0 * math.pi * math.e * learned[:, :c, :a] ** 2).mean(dim=(1, 2))
        entropy = entropy.view(b, -1).mean(dim=1)
    else:
        entropy = torch.zeros(b, dtype=dtype, device=dev)
    return EvalOutput(elements, elements.sum(dim=(1, 2)), values.to(dtype), entropy)


class _KeptPrefixEvaluate(torch.nn.Module):
    """`evaluate_rollout` of a kept-prefix batch as a module of tensors (what `make_graphed_callables` takes)."""

    def __init__(self, model: Pi05Model, opts: RolloutConfig, steps: StepTables) -> None:
        super().__init__()
        self.model, self.opts, self.steps = model, opts, steps

    def forward(self, chains, denoise_inds, kv, key_mask, *pooled):
        prefix = StoredPrefix(kv, key_mask, pooled[0] if pooled else None)
        unused = chains[:, 0, 0, 0]  # the batch's old log-probs and values do not enter the recomputation
        batch = RolloutBatch(None, chains, denoise_inds, unused, unused, self.opts, prefix)  # type: ignore[arg-type]
        out = evaluate_rollout(self.model, batch, self.opts, train_prefix=False, steps=self.steps)
        return out.log_prob_elements, out.values, out.entropy


class GraphedEvaluate:
    """`evaluate_rollout` for kept-prefix batches with its forward and backward replayed as CUDA graphs.

    The trainer's update is bound by launch overhead (thousands of small kernels per minibatch); one pair of graphs
    per batch shape and settings (`torch.cuda.make_graphed_callables`, captured on first use) replays them. The
    model's parameters get the same gradients as from the eager call; weights changed in place (an optimizer step,
    a weight commit) are read by the next replay.

    Example:
        >>> graphed = GraphedEvaluate(policy.model)  # doctest: +SKIP
        >>> out = graphed(batch.select(mb), batch.header)  # doctest: +SKIP
    """

    def __init__(self, model: Pi05Model) -> None:
        self.model = model
        self.graphs: dict[tuple, Any] = {}
        self.steps: dict[int, StepTables] = {}

    def __call__(self, batch: RolloutBatch, opts: RolloutConfig) -> EvalOutput:
        """The same outputs as ``evaluate_rollout(model, batch, opts, train_prefix=False)``."""
        prefix = batch.prefix
        assert prefix is not None
        args = (batch.chains, batch.denoise_inds, prefix.kv, prefix.key_mask)
        args += () if prefix.pooled is None else (prefix.pooled,)
        key = (replace(opts, weight_version=0), tuple((a.shape, a.dtype) for a in args))
        fn = self.graphs.get(key)
        if fn is None:
            k = opts.num_steps
            steps = self.steps.setdefault(k, StepTables.build(k, batch.chains.device))
            module = _KeptPrefixEvaluate(self.model, opts, steps)
            sample = tuple(a.detach().clone() for a in args)
            fn = self.graphs[key] = torch.cuda.make_graphed_callables(module, sample, allow_unused_input=True)
        elements, values, entropy = fn(*args)
        return EvalOutput(elements, elements.sum(dim=(1, 2)), values, entropy)
