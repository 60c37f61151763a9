"""One PI0.5 rollout call as a pure tensor function (prefix, K denoise steps, log-probs, values).

`RolloutTables` holds what depends only on the weights and the schedule: per K the step tables and the
adaRMS modulation of every expert norm at every t_i (so no time MLP or adaRMS Dense runs per step). The
eager CPU path and the captured CUDA graphs run these same functions; `refresh()` recomputes the tables
in place after a weight update so captured graphs stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import StoredPrefix
from .gemma import Modulation
from .model import Pi05Model, PrefixCache
from .sampler import Controls, StepTables, denoise


@dataclass
class KTables:
    """Schedule and modulation tables for one K, refreshed in place.

    Attributes:
        steps: t, Delta and sigma tables.
        modulation: (n_norms, K, 3 * We) float32 [1 + scale | shift | gate] of every adaRMS norm at every t_i.
        step_table: the same in the compute dtype, what the denoise loop reads (no per-step cast).
    """

    steps: StepTables
    modulation: torch.Tensor
    step_table: torch.Tensor

    def step_mods(self, i: int) -> list[Modulation]:
        """(1 + scale, shift, gate) of every norm at step i, each (1, 1, We), views of the table."""
        rows = self.step_table[:, i]  # (n_norms, 3We)
        return [tuple(r[None, None].chunk(3, dim=-1)) for r in rows]  # type: ignore[misc]


class RolloutTables:
    """Per-K tables for the declared K values.

    Example:
        >>> from policies.pi05.config import Pi05Config
        >>> model = Pi05Model(Pi05Config.tiny())
        >>> tables = RolloutTables(model, (5,))
        >>> tables[5].modulation.shape  # 2 layers x 2 norms + final, K=5, 3 x 40
        torch.Size([5, 5, 120])
    """

    def __init__(self, model: Pi05Model, num_steps: tuple[int, ...]) -> None:
        self.model = model
        device = next(model.parameters()).device
        self.tables: dict[int, KTables] = {}
        self.embeddings: dict[int, dict[torch.dtype, torch.Tensor]] = {}  # per K: the step times' sincos, per dtype
        dtype = model.compute_dtype
        for k in num_steps:
            steps = StepTables.build(k, device)
            modulation = self._modulation(steps)
            self.tables[k] = KTables(steps, modulation, modulation.to(dtype))

    def _modulation(self, steps: StepTables) -> torch.Tensor:
        """(n_norms, K, 3We) [1 + scale | shift | gate] from the current weights."""
        with torch.no_grad():
            embeddings = self.embeddings.setdefault(len(steps.deltas), {})
            cond = self.model.time_condition(steps.times[:-1], embeddings)  # (K, We)
            return self.model.modulation_table(cond)

    def __getitem__(self, k: int) -> KTables:
        return self.tables[k]

    def __contains__(self, k: int) -> bool:
        return k in self.tables

    def refresh(self) -> None:
        """Recompute every table in place from the current weights (storage kept: captured graphs stay valid)."""
        for table in self.tables.values():
            table.modulation.copy_(self._modulation(table.steps))
            table.step_table.copy_(table.modulation)


@dataclass
class RolloutOutputs:
    """Raw per-row outputs of one rollout (full H x D)."""

    chain: torch.Tensor  # (B, K+1, H, D)
    log_prob_elements: torch.Tensor  # (B, H, D), zero outside the crop
    values: torch.Tensor  # (B,)
    prefix: StoredPrefix | None = None  # the prefix K/V, when the caller keeps it for evaluate()


def run_prefix_stage(
    model: Pi05Model,
    images,
    image_mask,
    tokens,
    lengths,
    kv_out: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    fused_kernels: bool = False,
) -> PrefixCache:
    """Vision for all envs x cameras in one pass, then the LM over the prefix (value output if needed).

    `kv_out`: per-layer K/V destinations (the scheduler's cache slots); `fused_kernels`: see `Pi05Model.run_prefix`.
    """
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    token_mask = positions[None, :] < lengths[:, None]
    emb, valid = model.embed_prefix(images, image_mask, tokens, token_mask, use_kernels=fused_kernels)
    need_output = model.config.value_source == "prefix"
    return model.run_prefix(emb, valid, need_output=need_output, kv_out=kv_out, use_kernels=fused_kernels)


def prefix_values(model: Pi05Model, cache: PrefixCache) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(pooled LM output (B, W), critic (B,)) from the prefix, or None when the value source is not the prefix."""
    if model.config.value_source == "prefix" and model.value_head is not None:
        pooled = model.prefix_pooled(cache)
        return pooled, model.value_head(pooled)
    return None


def run_denoise_stage(
    model: Pi05Model,
    cache: PrefixCache,
    tables: KTables,
    x0: torch.Tensor,
    xi: torch.Tensor,
    ctrl: Controls,
    prefix_value: torch.Tensor | None,
    fused_kernels: bool = False,
    learned_noise: bool = True,
) -> RolloutOutputs:
    """K unrolled expert steps with the rollout math; values from the prefix or the pooled suffix.

    `fused_kernels`: run the expert layers and each step's sampler math as the fused kernels of `kernels.py`
    where they serve. `learned_noise`: run the noise head (if any). Only method "noise" reads its std; every
    other method multiplies it by 0 (`Controls.learned_std_on`), so leaving it out changes no output bit.
    """

    def velocity_fn(x: torch.Tensor, i: int):
        out = model.expert_step(cache, x, tables.step_mods(i), use_fused=True, use_kernels=fused_kernels)
        return model.velocity(out), out

    value_fn = None
    if model.config.value_source == "suffix" and model.value_head is not None:
        value_fn = model.value_head.forward
    head = model.noise_head.forward if learned_noise and model.noise_head is not None else None
    result = denoise(velocity_fn, x0, xi, tables.steps, ctrl, head, value_fn, fused_kernels)
    if result.suffix_values is not None:
        values = result.suffix_values
    elif prefix_value is not None:
        values = prefix_value
    else:
        values = torch.zeros(x0.shape[0], device=x0.device)
    return RolloutOutputs(result.chain, result.log_prob_elements, values)
