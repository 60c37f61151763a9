"""What a rollout keeps for `evaluate()`: the `RolloutBatch` a PPO update draws minibatches from.

A `RolloutBatch` holds, per sample, the model inputs (uint8 images, token ids), the sampled fp32 denoise chain,
the stochastic step indices, the rollout's log-prob and value, and its settings (header). With
`RolloutConfig.keep_prefix` it also holds the prefix K/V the rollout computed (`StoredPrefix`), so that a trainer
whose prefix is frozen never recomputes it and attends to exactly the numbers the rollout attended to.

Batches from several calls concatenate (`RolloutBatch.cat`): token rows and prefix K/V of different prompt
buckets are right-padded, the padding masked as invalid keys (a masked key contributes exactly 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..base import PolicyOutput, RolloutConfig
from .inputs import ModelInputs
from .model import PrefixCache


@dataclass
class StoredPrefix:
    """The prefix K/V of every LM layer for N samples, as the rollout computed them.

    Attributes:
        kv: (N, depth, 2, Nkv, T, hd) post-RoPE keys ([:, :, 0]) and values ([:, :, 1]) in the compute dtype;
            T = used cameras x patches + the prompt bucket. About 10 MB per sample in the LIBERO RL setting
            (2 cameras, 48-token bucket, bf16) and 25 MB at 3 cameras / 200 tokens.
        key_mask: (N, T) bool, True for valid prefix tokens.
        pooled: (N, W) float32 mean LM output over valid tokens (the prefix value source's input), or None.
    """

    kv: torch.Tensor
    key_mask: torch.Tensor
    pooled: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        """N."""
        return self.kv.shape[0]

    def select(self, index: torch.Tensor | slice) -> StoredPrefix:
        """Rows `index`."""
        pooled = None if self.pooled is None else self.pooled[index]
        return StoredPrefix(self.kv[index], self.key_mask[index], pooled)

    def cache(self) -> PrefixCache:
        """The `PrefixCache` the expert attends to (views of `kv`)."""
        layers = self.kv.unbind(dim=1)
        return PrefixCache(
            keys=[kv[:, 0] for kv in layers],
            values=[kv[:, 1] for kv in layers],
            key_mask=self.key_mask,
            num_valid=self.key_mask.long().sum(dim=1),
        )

    @staticmethod
    def cat(parts: Sequence[StoredPrefix]) -> StoredPrefix:
        """Concatenate along N, right-padding T (padded keys are invalid)."""
        t = max(p.kv.shape[4] for p in parts)
        kv = torch.cat([F.pad(p.kv, (0, 0, 0, t - p.kv.shape[4])) for p in parts])
        mask = torch.cat([F.pad(p.key_mask, (0, t - p.key_mask.shape[1])) for p in parts])
        pooled = None if any(p.pooled is None for p in parts) else torch.cat([p.pooled for p in parts])
        return StoredPrefix(kv, mask, pooled)


@dataclass
class RolloutBatch:
    """Stored rollout samples for PPO's re-evaluation (`Pi05Policy.evaluate(batch)`).

    Attributes:
        inputs: the processed observations (uint8 images, token ids and lengths, camera masks).
        chains: (B, K+1, H, D) float32 denoise chains x_0 .. x_K.
        denoise_inds: (B, K) int64 stochastic step indices (-1 = deterministic).
        log_prob: (B,) float32 log-probs of the rollout (the PPO ratio's denominator).
        values: (B,) float32 critic values of the rollout.
        header: the settings the samples were drawn with (`evaluate()` checks them).
        prefix: the rollout's prefix K/V (`RolloutConfig.keep_prefix`), or None (the trainer computes it).

    Example:
        >>> from policies.pi05 import Pi05Config, Pi05Policy
        >>> import numpy as np
        >>> policy = Pi05Policy.from_config(Pi05Config.tiny(), action_dim=2, seed=0)  # doctest: +SKIP
        >>> obs = {"images": {"image": np.zeros((4, 32, 32, 3), np.uint8)},
        ...        "state": np.zeros((4, 2), np.float32), "task": ["push"] * 4}  # doctest: +SKIP
        >>> batch = RolloutBatch.cat([RolloutBatch.from_output(policy.act(obs)) for _ in range(2)])  # doctest: +SKIP
        >>> policy.evaluate(batch.select(torch.arange(3))).log_prob.shape  # doctest: +SKIP
        torch.Size([3])
    """

    inputs: ModelInputs
    chains: torch.Tensor
    denoise_inds: torch.Tensor
    log_prob: torch.Tensor
    values: torch.Tensor
    header: RolloutConfig
    prefix: StoredPrefix | None = None

    @property
    def batch_size(self) -> int:
        """B."""
        return self.chains.shape[0]

    @classmethod
    def from_output(cls, out: PolicyOutput) -> RolloutBatch:
        """The samples of one `act()` call."""
        lacking = [name for name in ("chains", "denoise_inds", "inputs") if getattr(out, name) is None]
        if lacking:
            raise ValueError(
                f"RolloutBatch.from_output(out): expected an act() output with chains, denoise_inds and inputs, "
                f"got None for {lacking}; pass what Pi05Policy.act() returned."
            )
        return cls(out.inputs, out.chains, out.denoise_inds, out.log_prob, out.values, out.header, out.prefix)

    def select(self, index: torch.Tensor | slice) -> RolloutBatch:
        """Rows `index` (a minibatch)."""
        prefix = None if self.prefix is None else self.prefix.select(index)
        return replace(
            self,
            inputs=self.inputs.select(index),
            chains=self.chains[index],
            denoise_inds=self.denoise_inds[index],
            log_prob=self.log_prob[index],
            values=self.values[index],
            prefix=prefix,
        )

    @staticmethod
    def cat(parts: Sequence[RolloutBatch]) -> RolloutBatch:
        """Concatenate batches drawn with the same settings and weight version (e.g. the T steps of a rollout)."""
        first = parts[0]
        for other in parts[1:]:
            if other.header != first.header:
                raise ValueError(
                    f"RolloutBatch.cat: expected batches with one header, got {first.header} and {other.header}; "
                    "concatenate the calls of one rollout (same settings and weight version)."
                )
        length = max(p.inputs.tokens.shape[1] for p in parts)
        inputs = replace(
            first.inputs,
            images=torch.cat([p.inputs.images for p in parts]),
            image_mask=torch.cat([p.inputs.image_mask for p in parts]),
            tokens=torch.cat([F.pad(p.inputs.tokens, (0, length - p.inputs.tokens.shape[1])) for p in parts]),
            lengths=torch.cat([p.inputs.lengths for p in parts]),
            state=None if first.inputs.state is None else torch.cat([p.inputs.state for p in parts]),
        )
        prefix = None if any(p.prefix is None for p in parts) else StoredPrefix.cat([p.prefix for p in parts])
        cat = lambda name: torch.cat([getattr(p, name) for p in parts])
        return RolloutBatch(
            inputs, cat("chains"), cat("denoise_inds"), cat("log_prob"), cat("values"), first.header, prefix
        )
