"""Attention backends: the folded-MQA "gemm" path against the eager reference, its fallbacks, and the plan."""

import pytest
import torch

from policies.pi05 import attention, kernels, tuning
from policies.pi05.attention import AttentionConfig, additive_mask, attend
from policies.pi05.config import Pi05Config
from policies.pi05.model import Pi05Model, randomize_parameters_

GEMM_MAX_SCORES = tuning.thresholds("cpu").gemm_max_scores


def _qkv(b=3, n=4, t=5, s=11, hd=8, nkv=1, token_major=False, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if token_major:  # the projection's memory layout: (B, T, N, hd) seen as (B, N, T, hd)
        q = torch.randn(b, t, n, hd, generator=g).transpose(1, 2)
    else:
        q = torch.randn(b, n, t, hd, generator=g)
    k = torch.randn(b, nkv, s, hd, generator=g)
    v = torch.randn(b, nkv, s, hd, generator=g)
    mask = torch.rand(b, s, generator=g) > 0.4
    mask[:, 0] = True
    return q.to(dtype), k.to(dtype), v.to(dtype), mask


@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_gemm_equals_eager(token_major, mask_kind, count_sdpa):
    q, k, v, mask = _qkv(token_major=token_major)
    key_mask = {"bool": mask, "additive": additive_mask(mask, torch.float32), "none": None}[mask_kind]
    ref = attend(q, k, v, key_mask, 8**-0.5, "eager")
    out = attend(q, k, v, key_mask, 8**-0.5, "gemm")
    assert out.shape == ref.shape == (3, 4, 5, 8)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    assert count_sdpa == []  # the gemm path itself ran
    # the output keeps the query's layout, so the o-projection's reshape is free for token-major queries
    assert out.transpose(1, 2).is_contiguous() == token_major


def test_gemm_masked_keys_get_no_weight():
    q, k, v, mask = _qkv()
    v_poisoned = v.clone()
    v_poisoned[~mask[:, None, :, None].expand_as(v)] = 1e6  # garbage in masked value rows must not leak
    out = attend(q, k, v_poisoned, mask, 8**-0.5, "gemm")
    torch.testing.assert_close(out, attend(q, k, v, mask, 8**-0.5, "gemm"), atol=1e-5, rtol=1e-5)


def test_gemm_bfloat16_close_to_float32():
    q, k, v, mask = _qkv(n=8, t=10, s=60, hd=32, dtype=torch.bfloat16)
    out = attend(q, k, v, mask, 32**-0.5, "gemm")
    ref = attend(q.float(), k.float(), v.float(), mask, 32**-0.5, "eager")
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max().item() < 2e-2


def test_gemm_falls_back_to_sdpa(count_sdpa):
    q, k, v, mask = _qkv(n=4, nkv=2)  # two K/V heads: not a single shared head
    torch.testing.assert_close(attend(q, k, v, mask, 8**-0.5, "gemm"), attend(q, k, v, mask, 8**-0.5, "eager"))
    assert len(count_sdpa) == 1
    q, k, v, mask = _qkv(b=1, n=1, t=1, s=GEMM_MAX_SCORES + 1, hd=2)  # too many score elements
    attend(q, k, v, mask, 1.0, "gemm")
    assert len(count_sdpa) == 2


def test_gemm_serves_autograd_with_the_forward_math(count_sdpa):
    """The PPO trainer's evaluate() runs the rollout's attention math, with gradients, at any size."""
    q, k, v, mask = _qkv(b=1, n=1, t=1, s=GEMM_MAX_SCORES + 1, hd=2)
    q.requires_grad_(True)
    out = attend(q, k, v, mask, 1.0, "gemm")
    out.sum().backward()
    assert count_sdpa == [] and q.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(out, attend(q, k, v, mask, 1.0, "eager"), atol=1e-6, rtol=1e-5)


def test_auto_plan_uses_the_triton_kernel_on_cuda_only():
    cuda = AttentionConfig().resolve(torch.device("cuda"), torch.bfloat16)
    flash = attention.flash_device_status(torch.device("cuda")) is None  # FlashAttention-4 installed and runnable
    assert cuda.expert == ("triton_flash" if kernels.HAS_TRITON else "gemm")
    assert cuda.vision == "sdpa"
    assert cuda.prefix == ("triton_flash" if kernels.HAS_TRITON else "flash_large" if flash else "sdpa")
    cpu = AttentionConfig().resolve(torch.device("cpu"), torch.float32)
    assert (cpu.vision, cpu.prefix, cpu.expert) == ("sdpa", "sdpa", "sdpa")
    with pytest.raises(ValueError, match=r"AttentionConfig.expert: expected one of .*'gemm'.*got 'fast'"):
        AttentionConfig(expert="fast")


def test_model_with_gemm_expert_matches_eager():
    cfg = Pi05Config.tiny()
    eager = randomize_parameters_(Pi05Model(cfg, AttentionConfig("eager", "eager", "eager")), 0).eval()
    gemm = Pi05Model(cfg, AttentionConfig("eager", "eager", "gemm")).eval()
    gemm.load_state_dict(eager.state_dict())
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (2, 3, 3, 224, 224), generator=g, dtype=torch.uint8)
    image_mask = torch.tensor([[True, True, False], [True, False, True]])
    tokens = torch.randint(3, 200, (2, 9), generator=g)
    token_mask = torch.arange(9)[None] < torch.tensor([[9], [4]])
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim, generator=g)
    with torch.no_grad():
        a = eager.sample_actions(images, image_mask, tokens, token_mask, noise)
        b = gemm.sample_actions(images, image_mask, tokens, token_mask, noise)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_gemm_serves_matches_the_dispatch(count_sdpa):
    from policies.pi05.attention import gemm_serves

    assert gemm_serves(1, 8, 1, 50, 1018) and gemm_serves(8, 8, 1, 50, 1018)  # (a) up to batch 8: 3.3M scores
    assert not gemm_serves(16, 8, 1, 50, 1018)  # (a) batch 16: 6.5M, SDPA is faster there
    assert not gemm_serves(1, 8, 2, 50, 100) and gemm_serves(16, 8, 1, 50, 1018, grad=True)  # the trainer
    # a mask built once for the whole batch, (1, 1, 1, S), broadcasts over the rows
    q, k, v, mask = _qkv()
    shared = additive_mask(mask[:1], torch.float32)
    out = attend(q, k, v, shared, 8**-0.5, "gemm")
    torch.testing.assert_close(out, attend(q, k, v, mask[:1].expand(3, -1), 8**-0.5, "eager"), atol=1e-6, rtol=1e-6)
    assert count_sdpa == []
