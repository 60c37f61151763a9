"""FlashAttention-4 ("flash") at the PI0.5 call sites on a GPU: against the float32 reference, in a CUDA graph, and
its fallback when it cannot run (run by benchmarks/gpu_suite.py; skipped on CPU)."""

import pytest
import torch

from policies.pi05 import attention
from policies.pi05.attention import AttentionConfig, attend, served_by

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_suite.py)"),
]

TOLERANCE = 2e-2
"""max |out - ref| / max |ref| for bf16 operands against the float32 reference (bf16 rounding of the output)."""

SITES = {  # (batch, heads, kv_heads, queries, keys, head_dim, masked): SigLIP, LM prefix, expert over the prefix
    "vision": (4, 16, 16, 256, 256, 72, False),
    "prefix": (3, 8, 1, 560, 560, 256, True),
    "expert": (3, 8, 1, 50, 610, 256, True),
}


def _flash_reason():
    return attention.flash_device_status(torch.device("cuda"))


def _inputs(b, n, nkv, t, s, hd, masked, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, t, n, hd, generator=g, device="cuda").bfloat16().transpose(1, 2)  # token-major, as projected
    k = torch.randn(b, nkv, s, hd, generator=g, device="cuda").bfloat16()
    v = torch.randn(b, nkv, s, hd, generator=g, device="cuda").bfloat16()
    mask = None
    if masked:  # a short prompt per row and, on row 1, a missing camera (valid keys with holes)
        mask = torch.arange(s, device="cuda")[None, :] < torch.tensor([[s], [s - 37], [s - 5]], device="cuda")[:b]
        mask[1, 256:512] = False
    return q, k, v, mask


def _rel_err(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("site", list(SITES))
def test_flash_matches_the_float32_reference(site):
    reason = _flash_reason()
    if reason is not None:
        pytest.skip(f"flash not run: {reason}")
    b, n, nkv, t, s, hd, masked = SITES[site]
    q, k, v, mask = _inputs(b, n, nkv, t, s, hd, masked)
    probe = attention.flash_probe_result(q.device, q.dtype, n, nkv, hd, masked)
    assert probe is None, f"flash probe failed: {probe}"
    assert served_by("flash", q.device, q.dtype, b, n, nkv, t, s, hd) == attention.flash_kernel_name()
    with torch.no_grad():
        ref = attend(q.float(), k.float(), v.float(), mask, hd**-0.5, "eager")
        for kind in ("bool", "additive"):  # the model passes a prebuilt additive mask
            m = mask if kind == "bool" or mask is None else attention.additive_mask(mask, torch.bfloat16)
            out = attend(q, k, v, m, hd**-0.5, "flash")
            assert out.shape == ref.shape and out.dtype == torch.bfloat16
            assert _rel_err(out, ref) < TOLERANCE


def test_flash_reads_valid_first_keys_in_place():
    """With the valid keys already first (the fused prefix's K/V layout) and their counts given, flash reads K/V in
    place and computes what it computes from the same keys with holes (the valid-first copy it makes itself)."""
    reason = _flash_reason()
    if reason is not None:
        pytest.skip(f"flash not run: {reason}")
    b, n, nkv, t, s, hd, _ = SITES["prefix"]
    q, k, v, mask = _inputs(b, n, nkv, t, s, hd, True, seed=1)
    rows = attention.valid_first_rows(mask)[:, None, :, None].expand(k.shape)
    kf, vf = torch.empty_like(k).scatter_(2, rows, k), torch.empty_like(v).scatter_(2, rows, v)
    lengths = mask.sum(dim=1)
    first = torch.arange(s, device="cuda")[None, :] < lengths[:, None]
    with torch.no_grad():
        holes = attend(q, k, v, attention.additive_mask(mask, torch.bfloat16), hd**-0.5, "flash")
        in_place = attend(q, kf, vf, attention.additive_mask(first, torch.bfloat16), hd**-0.5, "flash",
                          lengths.to(torch.int32))  # fmt: skip
    assert torch.equal(in_place, holes)


def test_flash_replays_in_a_cuda_graph():
    reason = _flash_reason()
    if reason is not None:
        pytest.skip(f"flash not run: {reason}")
    b, n, nkv, t, s, hd, masked = SITES["expert"]
    q, k, v, mask = _inputs(b, n, nkv, t, s, hd, masked)
    additive = attention.additive_mask(mask, torch.bfloat16)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (compiles, runs the probe) before capture, as the scheduler does
            eager = attend(q, k, v, additive, hd**-0.5, "flash")
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = attend(q, k, v, additive, hd**-0.5, "flash")
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        fresh = attend(q, k, v, additive, hd**-0.5, "flash")
    assert not torch.equal(static, eager)  # the replay read the new queries
    torch.testing.assert_close(static, fresh, atol=0, rtol=0)


def test_flash_hands_over_where_it_does_not_serve():
    """float32, autograd and (without the package) every call go to SDPA, with the reason reported."""
    q, k, v, mask = _inputs(2, 8, 1, 10, 64, 256, True)
    ref = attend(q.float(), k.float(), v.float(), mask, 256**-0.5, "eager")
    torch.testing.assert_close(attend(q.float(), k.float(), v.float(), mask, 256**-0.5, "flash"), ref)
    assert served_by("flash", q.device, torch.float32, 2, 8, 1, 10, 64, 256).startswith("sdpa (flash: ")
    qg = q.detach().clone().requires_grad_(True)
    out = attend(qg, k, v, mask, 256**-0.5, "flash")
    out.float().sum().backward()
    assert qg.grad is not None and _rel_err(out.detach(), ref) < TOLERANCE
    reason = _flash_reason()
    plan = AttentionConfig("flash", "flash", "flash").resolve(torch.device("cuda"), torch.bfloat16)
    if reason is None:
        assert (plan.vision, plan.prefix, plan.expert) == ("flash",) * 3
        assert plan.flash == attention.flash_kernel_name()
    else:
        assert (plan.vision, plan.prefix, plan.expert) == ("sdpa",) * 3 and plan.flash == f"not run: {reason}"
        assert _rel_err(attend(q, k, v, mask, 256**-0.5, "flash"), ref) < TOLERANCE
