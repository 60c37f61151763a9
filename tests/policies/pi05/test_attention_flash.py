"""The "flash" backend's selection and fallback where FlashAttention-4 cannot run (here: CPU), and its key reordering.

Nothing here claims the FlashAttention kernel ran: that is `test_attention_flash_cuda.py`, on a GPU.
"""

import functools

import pytest
import torch

from policies.pi05 import attention, kernels, tuning
from policies.pi05.attention import AttentionConfig, attend, served_by


def _qkv(b=3, n=4, nkv=1, t=5, s=23, hd=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, x, y, hd, generator=g) for x, y in ((n, t), (nkv, s), (nkv, s)))
    mask = torch.rand(b, s, generator=g) > 0.4
    mask[:, 0] = True
    return q, k, v, mask


def test_flash_on_cpu_hands_over_to_sdpa_and_says_why(count_sdpa):
    q, k, v, mask = _qkv()
    out = attend(q, k, v, mask, 0.25, "flash")
    torch.testing.assert_close(out, attend(q, k, v, mask, 0.25, "eager"), atol=1e-5, rtol=1e-5)
    assert len(count_sdpa) == 1
    assert attention.flash_serves(q, k, mask) == "device is cpu, not CUDA"
    assert served_by("flash", q.device, q.dtype, 3, 4, 1, 5, 23, 16) == "sdpa (flash: device is cpu, not CUDA)"


def test_requested_flash_falls_back_in_the_plan_with_the_reason():
    plan = AttentionConfig("flash", "flash", "flash").resolve(torch.device("cpu"), torch.bfloat16)
    assert (plan.vision, plan.prefix, plan.expert) == ("sdpa", "sdpa", "sdpa")
    report = plan.report()
    assert report["flash"] == "not run: device is cpu, not CUDA"
    assert report["prefix_note"] == "flash requested but device is cpu, not CUDA; fell back to sdpa"


@pytest.mark.skipif(attention.flash_attn_available(), reason="flash_attn.cute is installed here")
def test_missing_package_is_named_with_its_install_line():
    status = attention.flash_attn_status()
    assert status is not None and "flash-attn-4" in status and "phyai-gym[flash]" in status
    if not torch.cuda.is_available():  # the CUDA plan of a machine without the package names it too
        plan = AttentionConfig().resolve(torch.device("cuda"), torch.bfloat16)
        assert (plan.vision, plan.prefix) == ("sdpa", "triton_flash" if kernels.HAS_TRITON else "sdpa")
        assert plan.expert == ("triton_flash" if kernels.HAS_TRITON else "gemm")
        note = "auto: large calls stay on triton, flash not run" if kernels.HAS_TRITON else "auto: flash not run"
        assert plan.flash == f"not run: {status}" and plan.reasons["prefix"].startswith(note)


def test_gemm_hand_over_is_reported():
    cpu = torch.device("cpu")
    assert served_by("gemm", cpu, torch.float32, 1, 8, 1, 50, 1018, 256) == "gemm"
    assert served_by("gemm", cpu, torch.float32, 64, 8, 1, 50, 1018, 256).startswith("sdpa (gemm:")
    assert served_by("sdpa", cpu, torch.float32, 1, 8, 1, 50, 1018, 256) == "sdpa"


def test_triton_hand_over_is_reported():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    expected = "triton" if kernels.HAS_TRITON else "gemm"
    assert served_by("triton", cuda, torch.bfloat16, 1, 8, 1, 50, 1018, 256) == expected
    assert served_by("triton", cpu, torch.bfloat16, 1, 8, 1, 50, 1018, 256) == "gemm"  # CPU: the gemm path
    assert served_by("triton", cuda, torch.bfloat16, 1, 8, 1, 50, 1018, 256, grad=True) == "gemm"  # autograd
    assert served_by("triton", cuda, torch.bfloat16, 64, 8, 2, 50, 1018, 256).startswith("sdpa (gemm:")
    large_call = "triton" if kernels.HAS_TRITON else "sdpa (gemm: above gemm_max_scores or several K/V heads)"
    assert served_by("triton", cuda, torch.bfloat16, 64, 8, 1, 50, 1018, 256) == large_call  # the kernel: any size
    large = tuning.thresholds(cuda).flash_min_scores
    assert served_by("triton_flash", cuda, torch.bfloat16, 1, 8, 1, 50, 1018, 256) == expected  # (a) batch 1 expert
    flash = attention.flash_device_status(cuda) is None
    below = served_by("triton", cuda, torch.bfloat16, large, 1, 1, 1, 1, 256)  # where it goes without flash
    assert served_by("triton_flash", cuda, torch.bfloat16, large, 1, 1, 1, 1, 256) == (
        f"{attention.flash_kernel_name()} (triton_flash: at or above flash_min_scores)" if flash else below
    )
    if kernels.HAS_TRITON:
        assert attention.triton_shape_status(cuda, torch.float32, 1, 256) == (
            "dtype torch.float32 (the kernel runs float16/bfloat16)"
        )


def test_flash_large_keeps_small_calls_on_sdpa():
    cpu = torch.device("cpu")
    big = tuning.thresholds(cpu).flash_min_scores
    assert served_by("flash_large", cpu, torch.bfloat16, 1, 8, 1, 50, 1018, 256) == (
        "sdpa (flash_large: below flash_min_scores)"
    )
    large = served_by("flash_large", cpu, torch.bfloat16, big, 1, 1, 1, 1, 256)
    assert large == "sdpa (flash: device is cpu, not CUDA)"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, t, 16, generator=g) for n, t in ((4, 5), (1, 23), (1, 23)))
    mask = torch.rand(2, 23, generator=g) > 0.3
    assert torch.equal(attend(q, k, v, mask, 0.25, "flash_large"), attend(q, k, v, mask, 0.25, "sdpa"))


@pytest.mark.parametrize("width", [4, 7, 300])
def test_flash_shape_rules_name_the_failing_field(width):
    if not torch.cuda.is_available():
        assert attention.flash_shape_status(torch.device("cpu"), torch.bfloat16, 8, 1, width) == (
            "device is cpu, not CUDA"
        )
    assert attention.flash_shape_status(torch.device("cpu"), torch.float32, 8, 1, width) is not None


def test_flash_shape_rules_on_hopper_take_grouped_and_multi_head_calls(monkeypatch):
    """The geometry rules alone, as on an sm90 device with the package: MQA (the LM), multi-head (the vision tower's
    16 K/V heads) and grouped heads run; heads that do not divide, or a width sm90 lacks, are named."""
    monkeypatch.setattr(attention, "flash_device_status", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    for heads, kv_heads, width in ((8, 1, 256), (16, 16, 72), (8, 2, 128)):
        assert attention.flash_shape_status(cuda, torch.bfloat16, heads, kv_heads, width) is None
    status = functools.partial(attention.flash_shape_status, cuda, torch.bfloat16)
    assert status(8, 3, 256) == "8 query heads are not a multiple of 3 K/V heads"
    assert status(8, 1, 300) == "head_dim 300 (sm9x runs multiples of 8 in 8..256)"


def test_valid_keys_first_keeps_attention_unchanged():
    """The flash path's key reordering: valid keys first, in order; attending the first num_valid keys is the
    masked attention (checked with the eager reference, no flash kernel involved)."""
    q, k, v, mask = _qkv(b=4, s=31)
    mask[2] = torch.arange(31) % 2 == 0  # holes
    kt, vt, num_valid = attention._valid_first(k.transpose(1, 2), v.transpose(1, 2), mask)
    kt, vt = kt.transpose(1, 2), vt.transpose(1, 2)
    assert num_valid.dtype == torch.int32 and torch.equal(num_valid, mask.sum(1, dtype=torch.int32))
    for row in range(4):
        torch.testing.assert_close(kt[row, :, : num_valid[row]], k[row, :, mask[row]])
        torch.testing.assert_close(kt[row, :, num_valid[row] :], k[row, :, ~mask[row]])  # a permutation
    lengths = torch.arange(31)[None, :] < num_valid[:, None]
    torch.testing.assert_close(attend(q, kt, vt, lengths, 0.25, "eager"), attend(q, k, v, mask, 0.25, "eager"))
