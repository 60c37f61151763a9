"""FLOPs of one PI0.5 policy call (DESIGN C8): valid tokens only, dead work left out.

Counts 2 FLOPs per multiply-accumulate of every matrix product and of attention (QK^T and PV). Left out:
work that cannot reach the outputs (in the last LM layer everything but its K/V projections, unless the
value source is the prefix), camera slots the camera map never fills, and the time MLP / adaRMS Dense
layers (precomputed into tables at setup). Elementwise work (norms, RoPE, softmax) is not counted.

    python -m benchmarks.flops            # prints the two C8 reference cases
"""

from __future__ import annotations

from policies.pi05.config import GemmaConfig, Pi05Config, SiglipConfig


def _vision_flops(v: SiglipConfig) -> float:
    p, w = v.num_patches, v.width
    stem = 2 * p * (3 * v.patch_size**2 * w)
    per_layer = 2 * p * (4 * w * w + 2 * w * v.mlp_dim) + 4 * p * p * w
    return stem + v.depth * per_layer


def _gemma_token_flops(g: GemmaConfig) -> float:
    """Per-token matrix FLOPs of one layer (projections and MLP)."""
    qo = 2 * g.width * g.num_heads * g.head_dim
    kv = 2 * g.width * g.num_kv_heads * g.head_dim
    mlp = 3 * g.width * g.mlp_dim
    return 2 * (qo + kv + mlp)


def pi05_flops(
    config: Pi05Config,
    num_cameras: int = 3,
    prompt_len: int = 200,
    num_steps: int | None = None,
    horizon: int | None = None,
    value_source: str | None = None,
) -> dict[str, float]:
    """FLOPs per sample of one `act()` by stage: vision, prefix (LM), denoise (K expert passes), total."""
    k = num_steps or config.num_steps
    h = horizon or config.action_horizon
    source = value_source or config.value_source
    llm, ex = config.llm, config.expert
    projector = 2 * config.vision.num_patches * config.vision.width * llm.width
    vision = num_cameras * (_vision_flops(config.vision) + projector)
    t = num_cameras * config.vision.num_patches + prompt_len
    attn_width = llm.num_heads * llm.head_dim
    full_layer = t * _gemma_token_flops(llm) + 4 * t * t * attn_width
    kv_only = t * 2 * 2 * llm.width * llm.num_kv_heads * llm.head_dim
    prefix = (llm.depth - 1) * full_layer + (full_layer if source == "prefix" else kv_only)
    expert_layer = h * _gemma_token_flops(ex) + 4 * h * (t + h) * attn_width
    io = 2 * h * 2 * config.action_dim * ex.width
    denoise = k * (ex.depth * expert_layer + io)
    heads = 0.0
    if source == "prefix":
        heads = 2 * _mlp_macs(llm.width, config.value_hidden)
    elif source == "suffix":
        heads = k * 2 * _mlp_macs(ex.width, config.value_hidden)
    total = vision + prefix + denoise + heads
    return {"vision": vision, "prefix": prefix, "denoise": denoise, "heads": heads, "total": total}


def _mlp_macs(width: int, hidden: tuple[int, ...]) -> float:
    dims = (width, *hidden, 1)
    return float(sum(a * b for a, b in zip(dims[:-1], dims[1:])))


REFERENCE_CASES = {
    "3cam_200tok_K10_H50": dict(num_cameras=3, prompt_len=200, num_steps=10, horizon=50, value_source="none"),
    "libero_rl_2cam_48tok_K5_H10": dict(num_cameras=2, prompt_len=48, num_steps=5, horizon=10, value_source="none"),
}
"""The two C8 cases (4.80 and 2.62 TFLOP per sample)."""


if __name__ == "__main__":
    cfg = Pi05Config.pi05_base()
    for name, case in REFERENCE_CASES.items():
        f = pi05_flops(cfg, **case)
        print(name, {k: round(v / 1e12, 4) for k, v in f.items()}, "TFLOP")
    with_value = pi05_flops(cfg, **{**REFERENCE_CASES["3cam_200tok_K10_H50"], "value_source": "prefix"})
    base = pi05_flops(cfg, **REFERENCE_CASES["3cam_200tok_K10_H50"])
    print("prefix value overhead", round(with_value["total"] / base["total"] - 1, 4))
