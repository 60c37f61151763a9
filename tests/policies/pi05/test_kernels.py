"""The fused Triton kernels against their PyTorch references, run by Triton's CPU interpreter.

They need triton installed and ``TRITON_INTERPRET=1`` set before `policies.pi05.kernels` is imported:

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python -m pytest -q tests/policies/pi05/test_kernels.py

A plain pytest run with triton installed runs this file once more in such a subprocess
(`test_interpreter_run`); without triton (CI) everything here skips. The interpreter truncates float32 ->
bfloat16 where the GPU rounds to nearest even, so kernel and reference agree to one bfloat16 ulp here; the CUDA
tests (`test_kernels_cuda.py`) hold the compiled kernels to the float32 formulas.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from policies.pi05 import kernels
from policies.pi05.gemma import apply_rope, rope_cos_sin

HAS_TRITON = importlib.util.find_spec("triton") is not None
interpreted = pytest.mark.skipif(
    not kernels.INTERPRETED,
    reason="runs once more under TRITON_INTERPRET=1 in test_interpreter_run's subprocess"
    if HAS_TRITON
    else "needs triton and TRITON_INTERPRET=1 at import (`pip install triton`: its CPU interpreter)",
)
ROOT = Path(__file__).resolve().parents[3]


def within_ulp(got: torch.Tensor, want: torch.Tensor, ulps: float = 1.0) -> bool:
    """|got - want| <= ulps bfloat16 ulps of want (2^-7 relative), elementwise, plus a tiny absolute slack."""
    got, want = got.float(), want.float()
    return bool(((got - want).abs() <= want.abs() * (ulps * 2**-7) + 1e-6).all())


def near(got: torch.Tensor, want: torch.Tensor, ulps: float) -> bool:
    """max |got - want| <= ulps bfloat16 ulps of max |want| (for results of differently rounded inputs)."""
    return bool((got.float() - want.float()).abs().max() <= want.float().abs().max() * (ulps * 2**-7))


@pytest.mark.skipif(not HAS_TRITON or kernels.INTERPRETED, reason="needs triton; runs this file under the interpreter")
@pytest.mark.interpreter
def test_interpreter_run():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not test_interpreter_run",
           str(Path(__file__))]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


@interpreted
def test_gelu_in_place_matches_float32_formula():
    x = (torch.randn(5, 1000, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    ref = torch.nn.functional.gelu(x.float(), approximate="tanh")
    with torch.no_grad():
        out = kernels.gelu_tanh_(x)
    assert out.data_ptr() == x.data_ptr() and within_ulp(out, ref)


@interpreted
@pytest.mark.parametrize("per_batch", [False, True])
def test_add_norm_adaptive_matches_reference(per_batch):
    g = torch.Generator().manual_seed(1)
    b, t, w = 3, 5, 40
    x = (torch.randn(b, t, w, generator=g) * 3).bfloat16()
    delta = torch.randn(b, t, w, generator=g).bfloat16()
    table = torch.randn(b if per_batch else 1, 1, 3 * w, generator=g).bfloat16()  # [1 + scale | shift | gate]
    scale1, shift, gate = table.chunk(3, dim=-1)  # strided views of one table row, as the rollout's step tables
    with torch.no_grad():
        res, y = kernels.add_norm(x, delta, scale1, 1e-6, gate=gate, shift=shift)
        ref_res, ref_y = kernels.add_norm_reference(x, delta, scale1, 1e-6, gate=gate, shift=shift)
    assert res.dtype == y.dtype == torch.bfloat16 and y.shape == x.shape
    assert within_ulp(res, ref_res)
    # y from the kernel's own residual (so a truncated residual ulp does not propagate into the comparison)
    assert within_ulp(y, kernels.add_norm_reference(res, None, scale1, 1e-6, shift=shift)[1])
    assert near(y, ref_y, ulps=2)


@interpreted
def test_add_norm_plain_first_and_final_norms():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 7, 64, generator=g) * 5).bfloat16()
    delta = torch.randn(2, 7, 64, generator=g).bfloat16()
    weight = torch.randn(64, generator=g) * 0.1  # float32 Gemma norm weight, used as 1 + w
    with torch.no_grad():
        res, y = kernels.add_norm(x, None, weight, 1e-6, add_one=True)  # first norm: no residual to add
        assert res is x
        assert within_ulp(y, kernels.add_norm_reference(x, None, weight, 1e-6, add_one=True)[1])
        _, out = kernels.add_norm(x, delta, weight, 1e-6, add_one=True, out_dtype=torch.float32, store_residual=False)
        ref_res, ref = kernels.add_norm_reference(x, delta, weight, 1e-6, add_one=True, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    # float32 output holding compute-dtype values (as upcast of a bfloat16 norm output)
    assert torch.equal(out, out.bfloat16().float())
    assert near(out, ref, ulps=2)
    # the unfused PyTorch norm on the same residual: within two ulps (it rounds twice)
    plain = torch.nn.functional.rms_norm(ref_res, (64,), weight=(1.0 + weight).bfloat16(), eps=1e-6)
    assert near(out, plain, ulps=2)


@interpreted
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_layer_norm_matches_reference(with_delta):
    """Width 72 (not a power of two: masked lanes stay out of the mean and variance), 15 rows, float32 params."""
    g = torch.Generator().manual_seed(6)
    b, t, w = 3, 5, 72
    x = (torch.randn(b, t, w, generator=g) * 3 + 1).bfloat16()  # a non-zero mean, as a residual stream has
    delta = torch.randn(b, t, w, generator=g).bfloat16() if with_delta else None
    weight, bias = 1.0 + 0.2 * torch.randn(w, generator=g), 0.1 * torch.randn(w, generator=g)  # float32
    with torch.no_grad():
        res, y = kernels.add_layer_norm(x, delta, weight, bias, 1e-6)
        ref_res, ref_y = kernels.add_layer_norm_reference(x, delta, weight, bias, 1e-6)
        # parameters that bfloat16 holds exactly: the in-register rounding then agrees with the cast's too (the
        # interpreter truncates it), and the kernel is within one ulp of the unfused norm of its own residual
        exact_w, exact_b = weight.bfloat16().float(), bias.bfloat16().float()
        _, y_exact = kernels.add_layer_norm(x, delta, exact_w, exact_b, 1e-6)
        own = kernels.add_layer_norm_reference(res, None, exact_w, exact_b, 1e-6)[1]
    assert res.dtype == y.dtype == torch.bfloat16 and y.shape == x.shape
    if with_delta:
        assert within_ulp(res, ref_res)
    else:
        assert res is x
    assert within_ulp(y_exact, own)
    assert near(y, ref_y, ulps=2)
    with torch.no_grad():  # the final norm: the residual is not written, y the same
        _, final = kernels.add_layer_norm(x, delta, weight, bias, 1e-6, store_residual=False)
    assert torch.equal(final, y)


def _vision_tower(dtype: torch.dtype):
    """The tiny config's SigLIP tower in `dtype` (stem and LayerNorms float32), LayerNorm weights near 1."""
    from policies.pi05.config import Pi05Config
    from policies.pi05.model import randomize_parameters_
    from policies.pi05.siglip import SiglipVisionTower

    tower = randomize_parameters_(SiglipVisionTower(Pi05Config.tiny().vision), 0).to(dtype)
    tower.embeddings.float()
    with torch.no_grad():
        for norm in (m for m in tower.modules() if isinstance(m, torch.nn.LayerNorm)):
            norm.float().weight.add_(1.0)
    return tower


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_vision_tower_matches_unfused(dtype, monkeypatch):
    """The tower with each residual add inside the next LayerNorm, against the unfused tower (interpreter).

    Stated bounds, in ulps of the largest output: bfloat16 within 4 (the kernel's arithmetic is the unfused
    path's, but the interpreter truncates every bfloat16 rounding, of the residual stream, the norm outputs and
    the parameters, where PyTorch rounds to nearest, and two blocks propagate that); float16, which the
    interpreter rounds to nearest, within 1, in under 5% of the elements (float32 summation order flipping a
    rounding). On the GPU bfloat16 rounds to nearest too (`test_kernels_cuda.py`).
    """
    tower = _vision_tower(dtype)
    pixels = torch.rand(3, 3, 224, 224, generator=torch.Generator().manual_seed(7)) * 2 - 1
    calls = []
    real = kernels.add_layer_norm

    def spy(*args, **kwargs):
        calls.append(args[1] is None)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "add_layer_norm", spy)
    with torch.no_grad():
        plain = tower(pixels, backend="eager")
        fused = tower(pixels, backend="eager", use_kernels=True)
    depth = len(tower.encoder.layers)
    assert calls == [True] + [False] * (2 * depth)  # only the first LN1 has no pending residual
    assert fused.dtype == plain.dtype == dtype and fused.shape == plain.shape
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    err = ((fused.float() - plain.float()).abs().max() / plain.float().abs().max()).item() / ulp
    assert err <= (4 if dtype == torch.bfloat16 else 1), err
    if dtype == torch.float16:
        assert (fused != plain).float().mean() < 0.05
    with torch.enable_grad():  # autograd keeps the unfused path, bitwise
        assert torch.equal(tower(pixels, backend="eager", use_kernels=True), plain)


@interpreted
@pytest.mark.parametrize("need_q", [True, False])
def test_qkv_rope_writes_rotated_q_k_and_v_into_cache_slots(need_q):
    g = torch.Generator().manual_seed(3)
    b, t, n, nkv, hd, start = 2, 19, 4, 1, 24, 5
    y = torch.randn(b, t, (n + 2 * nkv) * hd, generator=g).bfloat16()  # the fused [q; k; v] GEMM output
    heads = y.view(b, t, n + 2 * nkv, hd)
    q, k, v = heads[:, :, :n], heads[:, :, n : n + nkv], heads[:, :, n + nkv :]
    positions = torch.randint(0, 300, (b, t), generator=g)
    cos, sin = rope_cos_sin(positions, hd, 10_000.0, torch.bfloat16)
    keys = torch.full((b, nkv, t + start + 3, hd), 7.0).bfloat16()
    values = keys.clone()
    q_out = torch.empty(b, t, n, hd, dtype=torch.bfloat16) if need_q else None
    with torch.no_grad():
        k_slot, v_slot = keys[:, :, start : start + t].transpose(1, 2), values[:, :, start : start + t].transpose(1, 2)
        kernels.qkv_rope(q if need_q else None, k, v, cos[:, 0], sin[:, 0], q_out, k_slot, v_slot)
    slot = slice(start, start + t)
    assert torch.equal(values[:, :, slot], v.transpose(1, 2))  # v copied exactly
    assert within_ulp(keys[:, :, slot].transpose(1, 2), kernels.rope_reference(k, cos[:, 0], sin[:, 0]))
    for cache in (keys, values):
        assert (cache[:, :, :start] == 7.0).all() and (cache[:, :, start + t :] == 7.0).all()  # only the slot
    if need_q:
        assert within_ulp(q_out, kernels.rope_reference(q, cos[:, 0], sin[:, 0]))
        # and the model's unfused RoPE (which rounds x * cos first): within two ulps
        assert near(q_out.transpose(1, 2), apply_rope(q.transpose(1, 2), cos, sin), ulps=2)


@interpreted
def test_qkv_rope_writes_k_and_v_at_their_rows():
    """`kv_rows` (each row's valid tokens first) moves K and V, not q: the kernel equals its reference."""
    from policies.pi05.attention import valid_first_rows

    g = torch.Generator().manual_seed(4)
    b, t, n, hd = 2, 21, 4, 16
    heads = torch.randn(b, t, n + 2, hd, generator=g).bfloat16()
    q, k, v = heads[:, :, :n], heads[:, :, n : n + 1], heads[:, :, n + 1 :]
    cos, sin = (c[:, 0] for c in rope_cos_sin(torch.randint(0, 99, (b, t), generator=g), hd, 1e4, torch.bfloat16))
    rows = valid_first_rows(torch.rand(b, t, generator=g) > 0.4)
    outs = [[torch.empty(b, t, n, hd).bfloat16(), *(torch.empty(b, t, 1, hd).bfloat16() for _ in range(2))]
            for _ in range(2)]  # fmt: skip
    with torch.no_grad():
        kernels.qkv_rope(q, k, v, cos, sin, *outs[0], kv_rows=rows)
        kernels.qkv_rope_reference(q, k, v, cos, sin, *outs[1], kv_rows=rows)
    assert within_ulp(outs[0][0], outs[1][0]) and within_ulp(outs[0][1], outs[1][1])
    assert torch.equal(outs[0][2], outs[1][2])
    assert torch.equal(outs[0][2][0, rows[0, 3]], v[0, 3])  # token 3's value sits at its row


@interpreted
def test_fused_rollout_matches_unfused_tiny_bf16_policy():
    """The scheduler's eager stages with and without the fused kernels (tiny model, bf16, CPU interpreter)."""
    from policies.pi05.policy import Pi05Policy, RolloutConfig
    from policies.pi05.scheduler import SchedulerConfig
    from tests.policies.pi05.helpers import PROMPT, SLOTS, StandInProcessor, make_inputs, make_model

    model = make_model(0, value_source="prefix").set_precision(torch.bfloat16)
    outs = {}
    for fused in (False, True):
        sched = SchedulerConfig(max_batch_size=2, num_steps=(2,), camera_sets=(SLOTS,), prompt_buckets=(PROMPT,),
                                fused_kernels=fused)  # fmt: skip
        policy = Pi05Policy(model, StandInProcessor(SLOTS), RolloutConfig(num_steps=2, action_chunk=4), sched)
        outs[fused] = policy.act_inputs(make_inputs(2, seed=4), seeds=[0, 1])
    a, b = outs[False], outs[True]
    assert torch.equal(a.chains[:, 0], b.chains[:, 0])  # x_0 draws are exact
    assert torch.allclose(a.chains, b.chains, atol=5e-2, rtol=0), (a.chains - b.chains).abs().max()
    assert torch.allclose(a.values, b.values, atol=5e-2, rtol=5e-2), (a.values, b.values)


@interpreted
def test_fused_expert_packs_action_keys_after_each_rows_valid_prefix():
    """On a valid-first prefix cache (the fused LM's layout; prompts of several lengths and a masked camera), the
    fused expert layers write each row's action K/V at rows num_valid + j instead of the static tail: the same K/V
    bitwise in the first layer, the same expert output up to the attention's summation order."""
    from tests.policies.pi05.helpers import packed_and_tail_expert_steps

    run = packed_and_tail_expert_steps("cpu", "triton_flash")
    packed, tail, prefix, h = run["packed"], run["tail"], run["prefix"], run["h"]
    t = packed.suffix_offset
    assert prefix.valid_first and not bool(run["valid"].all())
    assert packed.suffix_rows is not None and tail.suffix_rows is None
    assert torch.equal(packed.suffix_lengths, (prefix.num_valid + h).int())
    for row, n in enumerate(prefix.num_valid.tolist()):
        assert torch.equal(packed.keys[0][row, :, n : n + h], tail.keys[0][row, :, t:])
        assert torch.equal(packed.values[0][row, :, n : n + h], tail.values[0][row, :, t:])
    assert near(run["outs"][0], run["outs"][1], ulps=4)


# ------------------------------------------------------------------------------------------- denoise_update
def _linear_velocity(x: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic stand-in for the expert: v = 0.7 x - 0.2 (i + 1), expert output = x."""
    return 0.7 * x - 0.2 * (i + 1), x * (i + 1)


def _learned_std(out: torch.Tensor) -> torch.Tensor:
    """A stand-in noise head: std in [0.05, 0.15], elementwise."""
    return 0.05 + 0.1 * torch.sigmoid(out)


def _lp_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Float32 log-probs within a few ulps (the interpreter's log is numpy's, PyTorch's CPU log may differ by 1)."""
    return bool(((got - want).abs() <= want.abs() * 2**-21 + 2**-21).all())


@interpreted
@pytest.mark.parametrize(
    ("method", "joint", "noise_level"),
    [("ode", False, 0.5), ("sde", True, 0.5), ("sde", False, 0.5), ("noise", True, 0.5), ("sde", True, 0.0)],
)
@pytest.mark.parametrize("k", [1, 4])
def test_denoise_update_matches_step_update_through_denoise(method, joint, noise_level, k):
    """`denoise` with the kernel vs its PyTorch steps: chains bitwise, log-probs to float32 ulps, no NaN.

    Covers t_0 = 1 (x1_hat's 1 - t = 0), K = 1 (t'_0 = 0), sigma = 0 (noise level 0: std 0, log-prob 0),
    rows without a stochastic step (non-joint SDE with ignore_last), a strided xi[:, i] and stochastic[:, i].
    """
    from policies.base import RolloutConfig
    from policies.pi05.sampler import ControlInputs, StepTables, controls, denoise, draw_noise

    b, h, d = 5, 6, 7
    seeds, counters = torch.arange(b) + 3, torch.full((b,), 1)
    opts = RolloutConfig(method=method, num_steps=k, noise_level=noise_level, joint=joint, action_chunk=4,
                         action_dim=5, ignore_last=method == "sde" and not joint and k > 1)  # fmt: skip
    ctrl, _ = controls(ControlInputs.from_options(opts, h, d, False, torch.device("cpu")), seeds, counters, k)
    x0, xi = draw_noise(seeds, counters, k, h, d)
    head = _learned_std if method == "noise" else None
    with torch.no_grad():
        ref = denoise(_linear_velocity, x0, xi, StepTables.build(k), ctrl, head, None)
        got = denoise(_linear_velocity, x0, xi, StepTables.build(k), ctrl, head, None, fused_kernels=True)
    assert torch.equal(got.chain, ref.chain)
    assert torch.isfinite(got.log_prob_elements).all() and torch.isfinite(got.chain).all()
    assert _lp_close(got.log_prob_elements, ref.log_prob_elements)
    if method == "ode" or noise_level == 0.0:
        assert torch.equal(got.log_prob_elements, ref.log_prob_elements)


@interpreted
def test_denoise_update_edge_rows_and_learned_std():
    """One step, directly: zero-stochastic rows keep lp and move by the ODE mean; learned std only when on."""
    from policies.pi05.sampler import StepInputs, StepTables, step_update

    g = torch.Generator().manual_seed(5)
    b, h, d, k = 3, 4, 9, 3
    steps = StepTables.build(k)
    sigmas = steps.sigmas(torch.tensor(0.8))
    x, v, lp = (torch.randn(b, h, d, generator=g) for _ in range(3))
    xi = torch.randn(b, k, h, d, generator=g)
    learned = torch.rand(b, h, d, generator=g) * 0.1 + 0.05
    stochastic = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])  # (B, K): row 1 off at 0 and 1
    for i in range(k):
        for sde_on, learned_on, learned_std in ((1.0, 0.0, None), (0.0, 1.0, learned), (1.0, 0.0, learned),
                                                (0.0, 0.0, None)):
            step = StepInputs(steps.times[i], steps.deltas[i], sigmas[i], stochastic[:, i], torch.tensor(sde_on),
                              torch.tensor(learned_on), torch.tensor(0.25))  # fmt: skip
            args = (x, v, xi[:, i], step, learned_std, lp)
            with torch.no_grad():
                got, want = kernels.denoise_update(*args), step_update(*args)
            assert torch.equal(got[0], want[0]), (i, sde_on, learned_on)
            assert _lp_close(got[1], want[1]), (i, sde_on, learned_on)
            if stochastic[1, i] == 0 or sde_on + learned_on == 0:  # no noise: the ODE mean, lp unchanged
                rows = slice(None) if sde_on + learned_on == 0 else slice(1, 2)
                assert torch.equal(got[1][rows], lp[rows])
                assert torch.equal(got[0][rows], (x - steps.deltas[i] * v)[rows])


@interpreted
def test_fused_denoise_update_in_float32_policy(monkeypatch):
    """A float32 tiny policy with `fused_kernels`: only the denoise kernel serves (once per step); same chains."""
    from policies.pi05.policy import Pi05Policy, RolloutConfig
    from policies.pi05.scheduler import SchedulerConfig
    from tests.policies.pi05.helpers import PROMPT, SLOTS, StandInProcessor, make_inputs, make_model

    model = make_model(0, value_source="suffix")
    calls = []
    real = kernels.denoise_update

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(kernels, "denoise_update", spy)
    outs = {}
    for fused in (False, True):
        sched = SchedulerConfig(max_batch_size=2, num_steps=(3,), camera_sets=(SLOTS,), prompt_buckets=(PROMPT,),
                                fused_kernels=fused)  # fmt: skip
        rollout = RolloutConfig(method="sde", joint=True, num_steps=3, action_chunk=4)
        policy = Pi05Policy(model, StandInProcessor(SLOTS), rollout, sched)
        outs[fused] = policy.act_inputs(make_inputs(2, seed=4), seeds=[0, 1])
    assert len(calls) == 3  # the fused run's three steps; the unfused run never calls it
    a, b = outs[False], outs[True]
    assert torch.equal(a.chains, b.chains) and torch.equal(a.values, b.values)
    assert _lp_close(b.log_prob_elements, a.log_prob_elements)


# ------------------------------------------------------------------------------------------- expert attention
def _attention_inputs(b, n, t, s, hd, token_major, seed=0):
    """bf16 q (B, Nh, T, hd) (token-major in memory or not), one K/V head, an additive mask with invalid keys."""
    from policies.pi05.attention import additive_mask

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, n, hd, generator=g).bfloat16().transpose(1, 2)
    q = q if token_major else q.contiguous()
    k, v = (torch.randn(b, 1, s, hd, generator=g).bfloat16() for _ in range(2))
    valid = torch.rand(b, s, generator=g) > 0.3
    valid[:, -t:] = True  # the action tokens' own keys
    return q, k, v, additive_mask(valid, torch.float32)


@interpreted
@pytest.mark.parametrize(("hd", "token_major", "splits"), [(32, True, None), (24, True, 3), (16, False, 1)])
def test_expert_attention_kernel_matches_float32_softmax(hd, token_major, splits):
    """Rows not a multiple of the row block, 77 keys (a ragged last key block and range), masked keys, padded
    head widths: within two bfloat16 ulps of the largest output (the probabilities round once to bfloat16)."""
    from policies.pi05 import attention_kernel

    q, k, v, mask = _attention_inputs(2, 4, 6, 77, hd, token_major)
    with torch.no_grad():
        out = attention_kernel.attend(q, k, v, mask, hd**-0.5, splits)
        none = attention_kernel.attend(q, k, v, None, hd**-0.5, splits)
    assert out.shape == q.shape and out.stride() == q.stride()  # the layout of q (token-major stays so)
    assert near(out, attention_kernel.reference(q, k, v, mask, hd**-0.5), ulps=2)
    assert near(none, attention_kernel.reference(q, k, v, None, hd**-0.5), ulps=2)
    # a mask broadcast over the batch reads one row for all
    with torch.no_grad():
        shared = attention_kernel.attend(q, k, v, mask[:1], hd**-0.5, splits)
    assert near(shared, attention_kernel.reference(q, k, v, mask[:1], hd**-0.5), ulps=2)


@interpreted
def test_expert_attention_kernel_key_splits_and_tiles_agree():
    """One key range per row block and several (the combine kernel), and every launch geometry the size rule picks,
    compute the same softmax."""
    from policies.pi05 import attention_kernel

    q, k, v, mask = _attention_inputs(1, 8, 10, 300, 32, True, seed=2)
    large = attention_kernel.LARGE_TILES
    with torch.no_grad():
        outs = [attention_kernel.attend(q, k, v, mask, 32**-0.5, splits) for splits in (1, 2, 10)]
        outs.append(attention_kernel.attend(q, k, v, mask, 32**-0.5, None, large))
    assert attention_kernel.num_splits(1, 80, 300) == 5  # 2 row blocks, 5 key blocks of 64
    assert attention_kernel.tiles_for(132, 128) == large and attention_kernel.tiles_for(131, 128) != large
    for out in outs[1:]:
        assert near(out, outs[0], ulps=1)


@interpreted
def test_triton_backend_hands_autograd_calls_to_gemm():
    from policies.pi05.attention import attend

    q, k, v, mask = _attention_inputs(2, 4, 6, 77, 32, True)
    q = q.float().requires_grad_()
    k, v = k.float(), v.float()
    out = attend(q, k, v, mask, 32**-0.5, "triton")
    assert torch.equal(out, attend(q, k, v, mask, 32**-0.5, "gemm")) and out.requires_grad


@interpreted
def test_tiny_bf16_policy_with_the_expert_kernel_matches_gemm():
    """The scheduler's eager rollout with the expert attention as the Triton kernel and as "gemm" (interpreter)."""
    from policies.pi05.attention import AttentionConfig
    from policies.pi05.config import Pi05Config
    from policies.pi05.model import Pi05Model, randomize_parameters_
    from policies.pi05.policy import Pi05Policy, RolloutConfig
    from policies.pi05.scheduler import SchedulerConfig
    from tests.policies.pi05.helpers import PROMPT, SLOTS, StandInProcessor, make_inputs

    outs = {}
    for backend in ("gemm", "triton"):
        model = Pi05Model(Pi05Config.tiny(value_source="prefix"), AttentionConfig(expert=backend))
        randomize_parameters_(model, 0)
        model.set_precision(torch.bfloat16).eval()
        assert model.plan.expert == backend
        sched = SchedulerConfig(max_batch_size=2, num_steps=(2,), camera_sets=(SLOTS,), prompt_buckets=(PROMPT,))
        policy = Pi05Policy(model, StandInProcessor(SLOTS), RolloutConfig(num_steps=2, action_chunk=4), sched)
        outs[backend] = policy.act_inputs(make_inputs(2, seed=4), seeds=[0, 1])
    a, b = outs["gemm"], outs["triton"]
    assert torch.equal(a.chains[:, 0], b.chains[:, 0])
    assert torch.allclose(a.chains, b.chains, atol=5e-2, rtol=0), (a.chains - b.chains).abs().max()


@interpreted
@pytest.mark.parametrize("tiles", [(32, 32, 16, 2, 4, 2), (16, 16, 32, 1, 4, 3)])
def test_geglu_gemm_matches_float32_formula(tiles):
    """Rows not a multiple of the row block (the descriptors' zero padding and clipped stores), a leading batch
    dimension, several programs per M group and more tiles than programs (each program walks several): within one
    bfloat16 ulp of the float32 formula (one rounding)."""
    from policies.pi05 import geglu_gemm

    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 37, 64, generator=g).bfloat16()
    gate_w, up_w = ((torch.randn(96, 64, generator=g) * 0.2).bfloat16() for _ in range(2))
    spec = geglu_gemm.GemmTiles(*tiles, min_waves=1)
    stack = geglu_gemm.stack_gate_up(gate_w, up_w, spec.block_n)
    with torch.no_grad():
        assert geglu_gemm.serves(x, stack, spec)
        out = geglu_gemm.geglu_linear(x, stack, spec)
    assert out.shape == (3, 37, 96) and out.dtype == torch.bfloat16
    assert near(out, geglu_gemm.reference(x, gate_w, up_w), ulps=1)


@interpreted
def test_geglu_gemm_hands_other_calls_to_one_gemm_over_the_stack():
    """Autograd, float32 and a stack whose rows are no multiple of the tile are not served: one GEMM over the stack
    and `kernels.geglu` compute the same formula, with gradients."""
    from policies.pi05 import geglu_gemm

    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 32, generator=g, requires_grad=True)
    gate_w, up_w = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    want = torch.nn.functional.gelu(x @ gate_w.T, approximate="tanh") * (x @ up_w.T)
    stack = geglu_gemm.stack_gate_up(gate_w, up_w, 8)
    small = geglu_gemm.GemmTiles(16, 8, 16, 1, 4, 2)
    with torch.no_grad():
        assert not geglu_gemm.serves(x, stack, small)  # float32
        assert not geglu_gemm.serves(x.bfloat16(), stack.bfloat16(), geglu_gemm.GemmTiles(16, 32, 16, 1, 4, 2))
    out = geglu_gemm.geglu_linear(x, stack, small)
    assert torch.allclose(out, want, atol=1e-5)
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_stack_gate_up_blocks_rows_and_names_mismatched_weights():
    """Blocks of `block_n` rows where it divides F, else the plain [gate; up] stack (which `stack_parts` splits
    back); two weights of different shapes are refused with both shapes named."""
    from policies.pi05 import geglu_gemm

    gate, up = torch.arange(24.0).view(12, 2), -torch.arange(24.0).view(12, 2)
    stack = geglu_gemm.stack_gate_up(gate, up, block_n=4)
    assert torch.equal(stack[4:8], up[:4]) and torch.equal(stack[8:12], gate[4:8])
    assert torch.equal(geglu_gemm.stack_gate_up(gate, up, block_n=8), torch.cat([gate, up]))
    for block_n in (4, 8):
        parts = geglu_gemm.stack_parts(geglu_gemm.stack_gate_up(gate, up, block_n), block_n)
        assert torch.equal(parts[0].reshape(12, 2), gate) and torch.equal(parts[1].reshape(12, 2), up)
    with pytest.raises(ValueError, match=r"stack_gate_up\(gate_w, up_w\): expected two \(F, K\) weights of one "
                       r"shape, got \(12, 2\) and \(8, 2\); pass a layer's gate_proj.weight and up_proj.weight"):
        geglu_gemm.stack_gate_up(gate, up[:8])
