"""Shared builders for the PI0.5 rollout tests: tiny randomised models and policies, processed inputs.

Everything is CPU, float32 unless asked otherwise, and seeded. The processor is a minimal stand-in (slots,
action dim, prompt buckets, postprocess = crop), so the tests exercise `Pi05Policy.act_inputs` on
`ModelInputs` without the real tokenizer/image pipeline.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch

from policies.pi05.config import Pi05Config
from policies.pi05.inputs import ModelInputs
from policies.pi05.model import Pi05Model, randomize_parameters_
from policies.pi05.policy import Pi05Policy, RolloutConfig
from policies.pi05.scheduler import SchedulerConfig

ACTION_DIM = 7
SLOTS = (0, 1)
PROMPT = 16


class StandInProcessor:
    """What `Pi05Policy` needs from a processor, for inputs that are already `ModelInputs`."""

    def __init__(self, slots: tuple[int, ...] = SLOTS, action_dim: int = ACTION_DIM) -> None:
        self.slots = slots
        self.action_dim = action_dim
        self.prompt_buckets = (PROMPT,)

    def __call__(self, obs: Any) -> ModelInputs:
        assert isinstance(obs, ModelInputs), "the stand-in processor takes ModelInputs"
        return obs

    def postprocess(self, actions: torch.Tensor, chunk: int) -> torch.Tensor:
        return actions[:, :chunk, : self.action_dim]


def make_model(seed: int = 0, **overrides: Any) -> Pi05Model:
    model = Pi05Model(Pi05Config.tiny(**overrides))
    randomize_parameters_(model, seed)
    return model.set_precision(torch.float32).eval()


def make_policy(
    value_source: str = "suffix",
    seed: int = 0,
    max_batch_size: int = 4,
    num_steps: tuple[int, ...] = (5,),
    camera_sets: tuple[tuple[int, ...], ...] = (SLOTS,),
    model_overrides: dict[str, Any] | None = None,
    **rollout: Any,
) -> Pi05Policy:
    """A tiny fp32 policy; `rollout` kwargs go to `RolloutConfig` (num_steps defaults to num_steps[-1])."""
    model = make_model(seed, value_source=value_source, **(model_overrides or {}))
    rollout.setdefault("num_steps", num_steps[-1])
    rollout.setdefault("action_chunk", 4)
    sched = SchedulerConfig(
        max_batch_size=max_batch_size, num_steps=num_steps, camera_sets=camera_sets, prompt_buckets=(PROMPT,)
    )
    return Pi05Policy(model, StandInProcessor(camera_sets[0]), RolloutConfig(**rollout), sched)


def make_inputs(
    n: int, seed: int = 0, slots: tuple[int, ...] = SLOTS, prompt: int = PROMPT, holes: bool = True
) -> ModelInputs:
    """uint8 images, right-padded prompts of various lengths (pad id 0), and (optionally) a masked camera."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, len(slots), 3, 224, 224), generator=gen, dtype=torch.uint8)
    image_mask = torch.ones(n, len(slots), dtype=torch.bool)
    if holes and n > 1 and len(slots) > 1:
        image_mask[1, 0] = False
    lengths = torch.randint(3, prompt + 1, (n,), generator=gen).int()
    tokens = torch.randint(1, 1000, (n, prompt), generator=gen).int()
    tokens = tokens * (torch.arange(prompt)[None, :] < lengths[:, None]).int()
    return ModelInputs(images=images, image_mask=image_mask, slots=slots, tokens=tokens, lengths=lengths)


def cat_inputs(parts: list[ModelInputs]) -> ModelInputs:
    """Row-concatenate ModelInputs with the same slots and prompt length."""
    first = parts[0]
    return replace(
        first,
        images=torch.cat([p.images for p in parts]),
        image_mask=torch.cat([p.image_mask for p in parts]),
        tokens=torch.cat([p.tokens for p in parts]),
        lengths=torch.cat([p.lengths for p in parts]),
    )


def float64_copy(model: Pi05Model) -> Pi05Model:
    """A float64 copy of every parameter (float64 runs through the `upcast` islands)."""
    return copy.deepcopy(model).double()


def perturb_(modules: list[torch.nn.Module], seed: int, scale: float = 0.02) -> None:
    """Add seeded N(0, scale) noise to every parameter of `modules` (a stand-in for an optimizer step)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * scale)


def expert_side(model: Pi05Model) -> list[torch.nn.Module]:
    """The modules `trainable="expert"` trains."""
    mods = [model.expert, model.action_in_proj, model.action_out_proj, model.time_mlp_in, model.time_mlp_out]
    return mods + [h for h in (model.value_head, model.noise_head) if h is not None]


def packed_and_tail_expert_steps(device: str, expert_backend: str, seed: int = 5) -> dict[str, Any]:
    """One fused expert step of a tiny bf16 model on a valid-first prefix cache (prompts of several lengths, a masked
    camera), twice on copies of the same K/V: action K/V packed after each row's valid keys, and in the static tail.

    Returns the two caches and outputs (``packed``, ``tail``, ``outs``), the prefix cache and the horizon ``h``.
    """
    from policies.pi05.attention import AttentionConfig
    from policies.pi05.model import PrefixCache

    model = Pi05Model(Pi05Config.tiny(), AttentionConfig(expert=expert_backend))
    randomize_parameters_(model, 0)
    model.to(device).set_precision(torch.bfloat16).eval()
    model.build_fused_weights()
    x = make_inputs(3, seed=seed)
    token_mask = torch.arange(x.tokens.shape[1])[None, :] < x.lengths[:, None]
    h, cfg = model.config.action_horizon, model.config.expert
    with torch.no_grad():
        emb, valid = model.embed_prefix(x.images.to(device), x.image_mask.to(device), x.tokens.long().to(device),
                                        token_mask.to(device), use_kernels=True)  # fmt: skip
        b, t = valid.shape
        shape = (b, cfg.num_kv_heads, t + h, cfg.head_dim)
        bufs = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(2 * cfg.depth)]
        slots = [(k[:, :, :t], v[:, :, :t]) for k, v in zip(bufs[::2], bufs[1::2])]
        prefix = model.run_prefix(emb, valid, kv_out=slots, use_kernels=True)
        gen = torch.Generator().manual_seed(1)
        noise = torch.randn(b, h, model.config.action_dim, generator=gen).to(device)
        mods = model.modulations(model.time_condition(torch.full((b,), 0.6, device=device)))
        outs, caches = [], []
        for packed in (True, False):
            kv = [x.clone() for x in bufs]
            cache = PrefixCache(kv[::2], kv[1::2], prefix.key_mask, prefix.num_valid, suffix_offset=t,
                                valid_first=packed)  # fmt: skip
            outs.append(model.expert_step(cache, noise, mods, use_fused=True, use_kernels=True))
            caches.append(cache)
    return {"packed": caches[0], "tail": caches[1], "outs": outs, "prefix": prefix, "h": h, "valid": valid}

