"""The PI0.5 network: SigLIP + projector + Gemma prefix stack, and the adaRMS action expert.

What the network *is* lives here; how it runs (buckets, graphs, rollout methods) lives in `sampler.py` and
`scheduler.py`. Shapes: B batch, n used cameras, P patches per camera, L prompt tokens, T = n*P + L prefix
tokens, H action horizon, D = 32 padded action dims, W LM width, We expert width.

Inference computes the prefix once (`run_prefix`, LM stream only) and keeps its post-RoPE K/V per layer;
every denoise step runs only the expert stream over the H action tokens, attending to [valid prefix K/V |
all action tokens] (`expert_step`). Masked cameras are never keys and do not advance positions, so a masked
camera is exactly a removed camera.

Each part is one stack of blocks. `use_kernels` asks for the fused kernels of `kernels.py`; each stack decides once
per call whether they serve (`kernels.fused_path`: CUDA half tensors outside autograd) and its blocks (`gemma.py`,
`siglip.py`) run them, or the PyTorch reference ops where they do not.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import geglu_gemm, kernels
from .attention import (
    AttentionConfig,
    AttentionPlan,
    additive_mask,
    attend,
    gemm_serves,
    mask_dtype,
    valid_first_rows,
)
from .config import Pi05Config
from .gemma import AdaRMSNorm, GemmaStack, Modulation, RMSNorm, rope_cos_sin, upcast, upcast_dtype
from .heads import NoiseHead, ValueHead
from .siglip import SiglipVisionTower

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16, etc."""
    if name not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {name!r}.")
    return _DTYPES[name]


@dataclass
class PrefixCache:
    """Per-layer prefix K/V (post-RoPE) and what the suffix needs to attend to it.

    Attributes:
        keys, values: per layer (B, Nkv, T, hd) in the compute dtype.
        key_mask: (B, T) bool, True for the K/V rows of valid prefix tokens. `run_prefix` with the fused
            kernels stores each row's valid tokens' K/V first, in order: its key_mask is then the first
            `num_valid` rows, and FlashAttention reads the keys without a valid-first copy per layer.
        num_valid: (B,) int64, the number of valid prefix tokens (suffix positions start there).
        output: (B, T, W) LM final-norm output in token order, only when requested (prefix value source).
        output_mask: (B, T) bool validity of `output`'s rows where it differs from `key_mask` (the fused path).
        suffix_offset: when set, `keys`/`values` are static buffers (B, Nkv, T + H, hd) holding the prefix in
            [:T]; each expert step writes its action-token K/V into [T:] instead of concatenating.
        valid_first: `key_mask` is each row's first `num_valid` rows (the fused path's layout). With a static
            tail, the fused expert layers then write the action-token K/V right after them (rows num_valid + j,
            `suffix_rows`), so that the suffix attention's valid keys are each row's first num_valid + H
            (`suffix_lengths`): FlashAttention reads them in place. The prefix rows they overwrite are invalid.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_mask: torch.Tensor
    num_valid: torch.Tensor
    output: torch.Tensor | None = None
    suffix_offset: int | None = None
    suffix_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    suffix_mask: torch.Tensor | None = None
    output_mask: torch.Tensor | None = None
    valid_first: bool = False
    suffix_rows: torch.Tensor | None = None
    suffix_lengths: torch.Tensor | None = None


def sinusoidal_time_embedding(
    t: torch.Tensor, dim: int, min_period: float, max_period: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(B,) times -> (B, dim) [sin | cos] embedding in `dtype`, computed in float64 as openpi-PyTorch/LeRobot."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (2.0 * math.pi) * t.to(torch.float64)[:, None] / period[None, :]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1).to(dtype)


class Pi05Model(nn.Module):
    """PI0.5 vision-language-action flow model.

    Example:
        >>> from policies.pi05.config import Pi05Config
        >>> model = Pi05Model(Pi05Config.tiny())
        >>> images = torch.zeros(1, 2, 3, 224, 224, dtype=torch.uint8)
        >>> x0 = model.sample_actions(images, torch.ones(1, 2, dtype=torch.bool),
        ...                           torch.ones(1, 5, dtype=torch.long), torch.ones(1, 5, dtype=torch.bool),
        ...                           noise=torch.randn(1, 10, 32), num_steps=2)
        >>> x0.shape
        torch.Size([1, 10, 32])
    """

    def __init__(self, config: Pi05Config, attention: AttentionConfig | None = None) -> None:
        super().__init__()
        self.config = config
        cfg = config
        self.vision = SiglipVisionTower(cfg.vision)
        self.projector = nn.Linear(cfg.vision.width, cfg.llm.width)
        self.llm = GemmaStack(cfg.llm, adaptive=False, vocab_size=cfg.vocab_size)
        self.expert = GemmaStack(cfg.expert, adaptive=True)
        self.action_in_proj = nn.Linear(cfg.action_dim, cfg.expert.width)
        self.action_out_proj = nn.Linear(cfg.expert.width, cfg.action_dim)
        self.time_mlp_in = nn.Linear(cfg.expert.width, cfg.expert.width)
        self.time_mlp_out = nn.Linear(cfg.expert.width, cfg.expert.width)
        self.value_head: ValueHead | None = None
        if cfg.value_source != "none":
            in_dim = cfg.llm.width if cfg.value_source == "prefix" else cfg.expert.width
            self.value_head = ValueHead(in_dim, cfg.value_hidden)
        self.noise_head: NoiseHead | None = None
        if cfg.noise_head:
            self.noise_head = NoiseHead(cfg.expert.width, cfg.noise_hidden, cfg.action_dim, cfg.noise_std_range)
        self.fused_expert: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.fused_prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # as fused_expert, for the LM
        self.fused_vision: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # SigLIP's [q;k;v] weight, bias
        self.attention_config = attention or AttentionConfig()
        self.plan: AttentionPlan = self.attention_config.resolve(torch.device("cpu"), torch.float32)

    # ------------------------------------------------------------------------------------- precision
    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of the transformer blocks."""
        return self.llm.layers[0].mlp.gate_proj.weight.dtype

    def fp32_modules(self) -> list[nn.Module]:
        """Modules kept in float32 whatever the compute dtype (stem, norms, time MLP, action projections, heads)."""
        keep: list[nn.Module] = [self.vision.embeddings, self.action_in_proj, self.action_out_proj]
        keep += [self.time_mlp_in, self.time_mlp_out]
        keep += [m for m in self.modules() if isinstance(m, (nn.LayerNorm, RMSNorm, AdaRMSNorm))]
        keep += [m for m in (self.value_head, self.noise_head) if m is not None]
        return keep

    def set_precision(self, dtype: torch.dtype) -> Pi05Model:
        """Cast the blocks to `dtype`, keeping the float32 islands; re-resolve attention backends."""
        self.to(dtype)
        for module in self.fp32_modules():
            module.float()
        self.resolve_attention()
        return self

    def share_prefix(self, other: Pi05Model) -> None:
        """Use `other`'s vision tower, projector and LM (the prefix stack) instead of this model's own copies.

        A trainer whose prefix is frozen (trainable = "expert") and that reuses the rollout's prefix K/V reads
        the prefix weights only to recompute a batch that kept none; sharing the rollout policy's modules saves a
        second copy (2.9 B parameters at full size). Both must have the same geometry, dtype and device.
        """
        mine, theirs = next(self.llm.parameters()), next(other.llm.parameters())
        if other.config.llm != self.config.llm or other.config.vision != self.config.vision or (
            (mine.dtype, mine.device) != (theirs.dtype, theirs.device)
        ):
            raise ValueError(
                f"share_prefix(other): expected a model of the same prefix geometry, dtype and device, got "
                f"{theirs.dtype} on {theirs.device} (this model: {mine.dtype} on {mine.device}); build the trainer "
                "in the rollout's dtype on its device."
            )
        self.vision, self.projector, self.llm = other.vision, other.projector, other.llm

    def resolve_attention(self) -> AttentionPlan:
        """Choose attention backends for the current device and dtype."""
        device = next(self.parameters()).device
        self.plan = self.attention_config.resolve(device, self.compute_dtype)
        return self.plan

    def build_fused_weights(self) -> None:
        """Fused weight buffers: [q;k;v] of every layer, [gate;up] of every expert layer and LM gate/up stacks.

        The LM's stacks are `geglu_gemm.stack_gate_up`'s blocks, for `geglu_gemm.geglu_linear` (134 MB a layer, 2.4 GB
        at full size). The expert keeps the plain [gate;up]: at its 50 rows a sample one cuBLAS GEMM and the GeGLU
        kernel ran its denoise loop faster at batch 32 and (b) batch 64 (`policy.jsonl` at 5084cec, 38b3eae, c92d794).

        They serve the no-grad rollout path: three GEMMs become one (and in the expert RoPE runs once for q and k), and
        in the LM gate, up and GeGLU one kernel, per layer. The buffers are a copy derived from the weights, like the
        modulation tables: a weight commit (and `load_weights`) refreshes them with `refresh_fused_weights()`; after
        any other in-place change of the weights (an optimizer step on a model that also rolls out) call
        `Pi05Scheduler.refresh_tables()`. Building again (a second scheduler on the same model) refreshes instead of
        replacing, since graphs captured by the first read this storage. Call it before capturing graphs.
        """
        if self.fused_expert is not None:  # shared by every scheduler of this model: captured graphs hold them
            self.refresh_fused_weights()
            return
        with torch.no_grad():
            self.fused_expert = [
                (layer.self_attn.fused_weight(), layer.mlp.fused_weight()) for layer in self.expert.layers
            ]
            self.fused_prefix = [
                (layer.self_attn.fused_weight(), geglu_gemm.stack_gate_up(layer.mlp.gate_proj.weight,
                                                                          layer.mlp.up_proj.weight))
                for layer in self.llm.layers
            ]  # fmt: skip
            self.fused_vision = [layer.self_attn.fused_weight() for layer in self.vision.encoder.layers]

    def _fused_usable(self, dtype: torch.dtype) -> bool:
        """The fused buffers serve a no-grad call in `dtype` while they match the live weights' dtype and device.

        After `model.to(...)`/`.double()` they no longer do (they are plain tensors, not converted), and the
        unfused weights are used until `build_fused_weights()` runs again.
        """
        if self.fused_expert is None or torch.is_grad_enabled():
            return False
        qkv = self.fused_expert[0][0]
        weight = self.expert.layers[0].self_attn.q_proj.weight
        return qkv.dtype == weight.dtype == dtype and qkv.device == weight.device

    def refresh_fused_weights(self, names: Collection[str] | None = None) -> None:
        """Copy every fused weight's parts into its rows of the buffers (one multi-tensor copy).

        `names` (parameter names, e.g. a commit's): only the copies of the stacks ("expert.", "llm.", "vision.")
        they touch; None: all. Storage is kept, so captured graphs stay valid; nothing to do without fused buffers.
        """
        if self.fused_expert is None or self.fused_prefix is None or self.fused_vision is None:
            return
        stacks = {"expert", "llm", "vision"} if names is None else {n.split(".", 1)[0] for n in names}
        pairs: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (buffer, the parameters it stacks)
        rows: list[torch.Tensor] = []  # buffer views; rows[i] is copied from weights[i]
        weights: list[torch.Tensor] = []
        if "expert" in stacks:
            for (qkv, mlp), layer in zip(self.fused_expert, self.expert.layers):
                pairs += [(qkv, layer.self_attn.fused_parts()), (mlp, layer.mlp.fused_parts())]
        if "llm" in stacks:
            for (qkv, mlp), layer in zip(self.fused_prefix, self.llm.layers):
                pairs.append((qkv, layer.self_attn.fused_parts()))
                gate, up = geglu_gemm.stack_parts(mlp)  # gate and up blocks alternate in the stack
                rows += [gate, up]
                weights += [layer.mlp.gate_proj.weight.view(gate.shape), layer.mlp.up_proj.weight.view(up.shape)]
        if "vision" in stacks:
            for buffers, layer in zip(self.fused_vision, self.vision.encoder.layers):
                pairs += zip(buffers, layer.self_attn.fused_parts())
        for buf, parts in pairs:
            rows += buf.split([w.shape[0] for w in parts])
            weights += parts
        if rows:
            with torch.no_grad():
                torch._foreach_copy_(rows, weights)

    # ---------------------------------------------------------------------------------------- prefix
    def embed_images(self, images: torch.Tensor, use_kernels: bool = False) -> torch.Tensor:
        """(B, n, 3, S, S) uint8 or float in [-1, 1] -> (B, n*P, W): all envs x cameras in one vision pass.

        `use_kernels`: the vision tower's fused kernels where they serve (`SiglipVisionTower.forward`).
        """
        b, n = images.shape[:2]
        pixels = images.flatten(0, 1)
        if pixels.dtype == torch.uint8:
            pixels = pixels.float() * (2.0 / 255.0) - 1.0
        qkv = self.fused_vision if use_kernels and self._fused_usable(self.compute_dtype) else None
        feats = self.vision(pixels, self.plan.vision, self.compute_dtype, use_kernels, qkv)
        feats = self.projector(feats.to(self.projector.weight.dtype))  # not rescaled (openpi)
        return feats.reshape(b, n * feats.shape[1], feats.shape[2])

    def embed_prefix(
        self,
        images: torch.Tensor,
        image_mask: torch.Tensor,
        tokens: torch.Tensor,
        token_mask: torch.Tensor,
        use_kernels: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix embeddings (B, T, W) in the compute dtype and validity (B, T): [camera tokens | prompt].

        `use_kernels`: see `embed_images`.
        """
        img = self.embed_images(images, use_kernels).to(self.compute_dtype)
        patches = img.shape[1] // max(images.shape[1], 1)
        text = self.llm.embed(tokens).to(self.compute_dtype)
        valid = torch.cat([image_mask.bool().repeat_interleave(patches, dim=1), token_mask.bool()], dim=1)
        return torch.cat([img, text], dim=1), valid

    def run_prefix(
        self,
        emb: torch.Tensor,
        valid: torch.Tensor,
        need_output: bool = False,
        kv_out: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        use_kernels: bool = False,
    ) -> PrefixCache:
        """Run the LM stream over the prefix; keep per-layer K/V.

        The last layer only computes its K/V unless `need_output` (prefix value source): nothing else of it
        reaches the actions. `kv_out` gives per layer (B, Nkv, T, hd) destinations (the scheduler's static cache
        slots): the K/V are written there and the returned cache holds those views.

        Per layer: the pending residual added inside the norm, q/k/v with RoPE (K/V into their slots), attention,
        the o GEMM, the residual added inside the next norm, the MLP. `use_kernels` (where `kernels.fused_path`
        holds) runs the blocks' fused kernels: each add + norm as one, RoPE with the K/V writes as one, and from
        `fused_prefix` (where built) the q/k/v GEMMs as one and gate, up and GeGLU as one (`geglu_gemm`); the K/V
        rows are then stored valid-first (`PrefixCache.valid_first`). Otherwise the reference ops run, in token
        order.
        """
        cfg = self.config.llm
        use_kernels = kernels.fused_path(use_kernels, emb)
        positions = torch.cumsum(valid.long(), dim=1) - 1
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, emb.dtype)  # (B, 1, T, hd)
        if use_kernels:  # K/V rows valid-first: token t's K/V at row kv_rows[b, t], the valid keys the first num_valid
            cos, sin = cos[:, 0], sin[:, 0]  # (B, T, hd), as the RoPE kernel reads them
            kv_rows = valid_first_rows(valid)
            num_valid = valid.sum(dim=1)
            key_valid = torch.arange(valid.shape[1], device=emb.device)[None, :] < num_valid[:, None]
            key_lengths = num_valid.to(torch.int32)
        else:
            kv_rows, key_lengths, key_valid, num_valid = None, None, valid, valid.long().sum(dim=1)
        mask = additive_mask(key_valid, mask_dtype(self.plan.prefix, emb.dtype))  # built once, shared by every layer
        scale = cfg.head_dim**-0.5
        fused = self.fused_prefix if use_kernels and self._fused_usable(emb.dtype) else None
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        x, delta = emb, None  # delta: the MLP output not yet added to the residual stream x
        for i, layer in enumerate(self.llm.layers):
            need_q = i < len(self.llm.layers) - 1 or need_output
            qkv_w, mlp_w = fused[i] if fused is not None else (None, None)
            k_dst, v_dst = kv_out[i] if kv_out is not None else (None, None)
            x, h = layer.input_layernorm.add_norm(x, delta, use_kernels)
            q, k, v = layer.self_attn.project(h, cos, sin, use_kernels, qkv_w, need_q, k_dst, v_dst, kv_rows)
            keys.append(k)
            values.append(v)
            if q is None:
                break
            o = layer.self_attn.out(attend(q, k, v, mask, scale, self.plan.prefix, key_lengths))
            x, h = layer.post_attention_layernorm.add_norm(x, o, use_kernels)
            delta = layer.mlp(h, stack=mlp_w)
        output = None
        if need_output:
            output = self.llm.norm.add_norm(x, delta, use_kernels, store_residual=False)[1]
        if kv_out is not None:
            keys, values = [k for k, _ in kv_out], [v for _, v in kv_out]
        output_mask = valid if use_kernels else None
        return PrefixCache(keys, values, key_valid, num_valid, output, output_mask=output_mask, valid_first=use_kernels)

    # ---------------------------------------------------------------------------------------- expert
    def time_condition(
        self, t: torch.Tensor, embeddings: dict[torch.dtype, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """(B,) times -> (B, We) float32 adaRMS condition: swish(out(swish(in(sincos(t))))).

        `embeddings` memoises sincos(t) per dtype for a fixed `t` (the rollout tables' step times): it depends on
        no weight.
        """
        cfg = self.config
        dtype = upcast_dtype(self.time_mlp_in.weight.dtype)
        emb = None if embeddings is None else embeddings.get(dtype)
        if emb is None:
            emb = sinusoidal_time_embedding(t, cfg.expert.width, cfg.min_period, cfg.max_period, dtype)
            if embeddings is not None:
                embeddings[dtype] = emb
        return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(emb))))

    def modulations(self, cond: torch.Tensor) -> list[Modulation]:
        """(B, We) condition -> one (scale, shift, gate) per adaRMS norm (2 per layer, then the final norm)."""
        return [norm.modulation(cond) for norm in self.expert.adaptive_norms()]

    def modulation_table(self, cond: torch.Tensor) -> torch.Tensor:
        """(K, We) conditions -> (n_norms, K, 3We) float32 [1 + scale | shift | gate] of every adaRMS norm.

        Every norm's Dense runs in one GEMM (the rollout tables and the trainer compute it the same way);
        differentiable.
        """
        norms = self.expert.adaptive_norms()
        weights, biases = [n.dense.weight for n in norms], [n.dense.bias for n in norms]
        if len({t.dtype for t in weights + biases}) != 1 or cond.dtype != upcast(weights[0]).dtype:
            mods = [n.modulation(cond) for n in norms]  # 3 x (K, 1, We) each
            return torch.stack([torch.cat(m, dim=-1)[:, 0] for m in mods])
        width = weights[0].shape[1]
        m = F.linear(cond, upcast(torch.cat(weights)), upcast(torch.cat(biases)))
        m = m.view(cond.shape[0], len(norms), 3 * width).transpose(0, 1)
        one = torch.zeros(3 * width, dtype=m.dtype, device=m.device)
        one[:width] = 1.0
        return (m + one).contiguous()  # [1 + scale | shift | gate], as `AdaRMSNorm.modulation`

    def fused_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[q;k;v] and [gate;up] of every expert layer, concatenated from the parameters (differentiable).

        The trainer's `evaluate()` passes these to `expert_step` so that it runs the rollout's fused GEMMs.
        """
        return [(layer.self_attn.fused_weight(), layer.mlp.fused_weight()) for layer in self.expert.layers]

    def expert_step(
        self,
        cache: PrefixCache,
        x_t: torch.Tensor,
        mods: list[Modulation],
        use_fused: bool = False,
        fused: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        use_kernels: bool = False,
    ) -> torch.Tensor:
        """One expert pass at the noisy actions x_t (B, H, D) -> final-norm output (B, H, We) float32.

        `use_fused` reads the fused [q;k;v] / [gate;up] copies (the scheduler's rollout path, which refreshes them
        with its tables after every weight commit); `fused` passes such weights explicitly (`fused_weights()`,
        the trainer); every other caller reads the parameters themselves.

        Per layer-step: the pending gated residual added inside the adaRMS norm, q/k/v with RoPE (the action K/V
        into the cache tail, or concatenated to the prefix K/V without one), attention, the o GEMM, the gated
        attention residual added inside the next norm, the MLP; the final norm adds the last residual and returns
        float32 (rounded to the compute dtype first). `use_kernels` runs the blocks' fused kernels where they serve
        (fused weights, a static cache tail, `kernels.fused_path`): each add + norm as one, RoPE with the K/V
        writes as one (on a valid-first cache at rows `suffix_rows`, right after each row's valid prefix keys).
        """
        cfg = self.config.expert
        b, h, _ = x_t.shape
        x = self.action_in_proj(x_t.to(upcast_dtype(self.action_in_proj.weight.dtype))).to(self.compute_dtype)
        if fused is None and use_fused and self._fused_usable(x.dtype):
            fused = self.fused_expert
        offset = cache.suffix_offset
        use_kernels = fused is not None and offset is not None and kernels.fused_path(use_kernels, x)
        if cache.suffix_rope is None:  # positions and mask are the same at every denoise step: build once
            positions = cache.num_valid[:, None] + torch.arange(h, device=x_t.device)[None, :]
            cache.suffix_rope = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
            if use_kernels and cache.valid_first:  # action K/V at rows num_valid + j (`PrefixCache.valid_first`)
                cache.suffix_rows, lengths = positions, cache.num_valid + h
                cache.suffix_lengths = lengths.to(torch.int32)
                valid = torch.arange(offset + h, device=x_t.device)[None, :] < lengths[:, None]
            else:
                valid = torch.cat([cache.key_mask, torch.ones(b, h, dtype=torch.bool, device=x_t.device)], dim=1)
            # "gemm" and "triton" add the mask to float32 scores; SDPA and flash take it in the compute dtype
            gemm = gemm_serves(b, cfg.num_heads, cfg.num_kv_heads, h, valid.shape[1], torch.is_grad_enabled(),
                               valid.device)  # fmt: skip
            cache.suffix_mask = additive_mask(valid, mask_dtype(self.plan.expert, x.dtype, gemm))
        cos, sin = cache.suffix_rope
        rows, lengths = None, None
        if use_kernels:
            cos, sin = cos[:, 0], sin[:, 0]  # (B, H, hd), as the RoPE kernel reads them
            rows, lengths = cache.suffix_rows, cache.suffix_lengths
            offset = 0 if rows is not None else offset  # with rows, the kernel writes into the whole cache
        scale = cfg.head_dim**-0.5
        delta, gate = None, None  # the branch output not yet added to x, and its gate
        for i, layer in enumerate(self.expert.layers):
            qkv_w, mlp_w = fused[i] if fused is not None else (None, None)
            x, hidden, attn_gate = layer.input_layernorm.add_norm(x, delta, gate, mods[2 * i], use_kernels)
            keys, values = cache.keys[i], cache.values[i]
            if offset is None:  # no static tail: the action K/V appended to the prefix K/V
                q, k, v = layer.self_attn.project(hidden, cos, sin, use_kernels, qkv_w)
                keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
            else:  # written into the static cache tail (or rows), attention over the whole view
                q, _, _ = layer.self_attn.project(hidden, cos, sin, use_kernels, qkv_w, True, keys[:, :, offset:],
                                                  values[:, :, offset:], rows)  # fmt: skip
            o = attend(q, keys, values, cache.suffix_mask, scale, self.plan.expert, lengths)
            x, hidden, gate = layer.post_attention_layernorm.add_norm(x, layer.self_attn.out(o), attn_gate,
                                                                      mods[2 * i + 1], use_kernels)  # fmt: skip
            delta = layer.mlp(hidden, mlp_w)
        out_dtype = upcast_dtype(x.dtype)
        return self.expert.norm.add_norm(x, delta, gate, mods[-1], use_kernels, out_dtype, store_residual=False)[1]

    def velocity(self, suffix_out: torch.Tensor) -> torch.Tensor:
        """Expert output (B, H, We) -> velocity v (B, H, D) float32."""
        return self.action_out_proj(upcast(suffix_out))

    # ------------------------------------------------------------------------------------------ heads
    def prefix_pooled(self, cache: PrefixCache) -> torch.Tensor:
        """Mean LM output over valid prefix tokens -> (B, W) float32, the prefix value source's input."""
        assert cache.output is not None
        output = upcast(cache.output)
        w = (cache.key_mask if cache.output_mask is None else cache.output_mask).to(output.dtype)[..., None]
        return (output * w).sum(dim=1) / w.sum(dim=1).clamp_min(1.0)

    def prefix_value(self, cache: PrefixCache) -> torch.Tensor:
        """Critic on the mean LM output over valid prefix tokens -> (B,)."""
        assert self.value_head is not None
        return self.value_head(self.prefix_pooled(cache))

    def suffix_value(self, suffix_out: torch.Tensor, positions: int | None = None) -> torch.Tensor:
        """Critic on the expert output pooled over the first `positions` (default all H) tokens -> (B,)."""
        assert self.value_head is not None
        pooled = upcast(suffix_out[:, : positions or suffix_out.shape[1]]).mean(dim=1)
        return self.value_head(pooled)

    # ---------------------------------------------------------------------------------------- sampling
    @torch.no_grad()
    def sample_actions(
        self,
        images: torch.Tensor,
        image_mask: torch.Tensor,
        tokens: torch.Tensor,
        token_mask: torch.Tensor,
        noise: torch.Tensor,
        num_steps: int | None = None,
    ) -> torch.Tensor:
        """Deterministic Euler flow sampling from x_1 = noise to x_0 (openpi convention), (B, H, D) float32.

        t_i = 1 - i/K (i = 0..K-1), dt = -1/K; the prefix is computed once and its K/V reused every step.
        """
        k_steps = num_steps or self.config.num_steps
        emb, valid = self.embed_prefix(images, image_mask, tokens, token_mask)
        cache = self.run_prefix(emb, valid)
        x = noise.float()
        times = torch.linspace(1.0, 1.0 / k_steps, k_steps, dtype=torch.float32, device=x.device)
        for i in range(k_steps):
            t = times[i].expand(x.shape[0])
            v = self.velocity(self.expert_step(cache, x, self.modulations(self.time_condition(t))))
            x = x - (1.0 / k_steps) * v
        return x


def randomize_parameters_(module: nn.Module, seed: int, std: float = 0.05) -> nn.Module:
    """Fill every parameter with seeded N(0, std) values (norm weights/biases too).

    Zero-initialised adaRMS denses and RMSNorm weights would hide wiring errors in tests and make a random
    demo policy degenerate, so tests and the demo randomise everything. The values come from a generator on each
    parameter's device, so a full-size model on a GPU is filled there (a CPU generator would draw its 3 B values
    on one core first); a seed gives the same weights on every run on one device type, and other ones on the CPU
    than on CUDA.
    """
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for _, param in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            values = torch.randn(
                param.shape, generator=generators[param.device], dtype=torch.float32, device=param.device
            )
            param.copy_((values * std).to(param.dtype))
    return module
