"""The compiled fused kernels against float32 formulas, and the policy with them on (run on the GPU by gpu_suite).

Stated bounds: every bfloat16 output of `add_norm` and `qkv_rope` is within one bfloat16 ulp (relative 2^-7) of
the float32 formula evaluated on the same inputs (one rounding; the float32 summation order may move a value
across a rounding boundary, hence one ulp rather than half). `denoise_update` is held to its PyTorch reference
(`sampler.step_update`): x_{i+1} bitwise, the log-prob within two float32 ulps (its log is libdevice's logf).
`add_layer_norm`: its residual bitwise the unfused add's, its output within one bfloat16 ulp of the float32 formula
on the same inputs (the affine parameters as the unfused path casts them) and of the unfused F.layer_norm (which
it differs from in under 0.1% of the elements), and within 2^-7 of the largest output of a float32 LayerNorm
with float32 parameters; the fused vision tower within 2^-6 of the largest output of the unfused one.
"""

from __future__ import annotations

import pytest
import torch

from policies.pi05.gemma import rope_cos_sin

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_suite.py)"),
]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / (|want| + 1e-6), elementwise (relative error in the worst element)."""
    return ((got.float() - want.float()).abs() / (want.float().abs() + 1e-6)).max().item()


def _within_ulp(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-5).all())


@pytest.mark.parametrize(("rows", "width", "adaptive"), [(50, 1024, True), (64 * 50, 1024, True), (2000, 2048, False)])
def test_add_norm_matches_float32_formula(rows, width, adaptive):
    pytest.importorskip("triton")
    from policies.pi05 import kernels

    g = torch.Generator(device="cuda").manual_seed(rows)
    b = 2 if rows > 50 else 1
    x = (torch.randn(b, rows // b, width, device="cuda", generator=g) * 4).bfloat16()
    delta = torch.randn(b, rows // b, width, device="cuda", generator=g).bfloat16()
    if adaptive:
        table = torch.randn(1, 1, 3 * width, device="cuda", generator=g).bfloat16()
        scale, shift, gate = table.chunk(3, dim=-1)
        kwargs = dict(gate=gate, shift=shift)
    else:
        scale, kwargs = torch.randn(width, device="cuda", generator=g) * 0.1, dict(add_one=True)
    with torch.no_grad():
        res, y = kernels.add_norm(x, delta, scale, 1e-6, **kwargs)
        _, out32 = kernels.add_norm(x, delta, scale, 1e-6, out_dtype=torch.float32, store_residual=False, **kwargs)
    # float32 formulas: the residual of the inputs, the norm of the kernel's (rounded) residual
    d = delta.float() * (kwargs["gate"].float() if adaptive else 1.0)
    res32 = x.float() + d
    r = res.float()
    s = scale.float() + (0.0 if adaptive else 1.0)
    y32 = r * torch.rsqrt(r.square().mean(-1, keepdim=True) + 1e-6) * s + (kwargs["shift"].float() if adaptive else 0)
    assert _within_ulp(res, res32), _rel_err(res, res32)
    assert _within_ulp(y, y32), _rel_err(y, y32)
    assert torch.equal(out32, y.float())  # the final norm's float32 output holds the bfloat16 values
    ref_res, ref_y = kernels.add_norm_reference(x, delta, scale, 1e-6, **kwargs)
    assert (res != ref_res).float().mean() < 1e-3 and (y != ref_y).float().mean() < 1e-2  # the reference


@pytest.mark.parametrize(("batch", "width", "with_delta"), [(1, 1152, True), (64 * 3, 1152, True), (3, 1152, False),
                                                          (4, 72, True)])  # fmt: skip
def test_add_layer_norm_matches_float32_formula(batch, width, with_delta):
    """SigLIP's geometry (256 patches of width 1152; batch 64 x 3 cameras) and a width that is not a power of two."""
    pytest.importorskip("triton")
    import torch.nn.functional as F

    from policies.pi05 import kernels

    g = torch.Generator(device="cuda").manual_seed(batch + width)
    x = (torch.randn(batch, 256, width, device="cuda", generator=g) * 4 + 1).bfloat16()
    delta = torch.randn(batch, 256, width, device="cuda", generator=g).bfloat16() if with_delta else None
    weight = 1.0 + 0.2 * torch.randn(width, device="cuda", generator=g)  # float32, as the checkpoint's
    bias = 0.1 * torch.randn(width, device="cuda", generator=g)
    with torch.no_grad():
        res, y = kernels.add_layer_norm(x, delta, weight, bias, 1e-6)
        ref_res, ref_y = kernels.add_layer_norm_reference(x, delta, weight, bias, 1e-6)
    # the float32 formula on the kernel's residual, with the parameters as the unfused path casts them
    r = res.float()
    centred = r - r.mean(-1, keepdim=True)
    y32 = centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + 1e-6)
    y32 = y32 * weight.bfloat16().float() + bias.bfloat16().float()
    assert torch.equal(res, ref_res)  # one float32 add rounded to nearest, as PyTorch's
    assert _within_ulp(y, y32), _rel_err(y, y32)
    assert _within_ulp(y, ref_y), _rel_err(y, ref_y)  # the unfused F.layer_norm: the statistics summed otherwise
    assert (y != ref_y).float().mean() < 1e-3
    full = F.layer_norm(r, (width,), weight, bias, 1e-6)  # float32 parameters: what the roundings cost in all
    err = ((y.float() - full).abs().max() / full.abs().max()).item()
    assert err < 2**-7, err


def _vision_tower(depth: int, width: int = 1152, mlp_dim: int = 4304, num_heads: int = 16):
    """A bfloat16 SigLIP tower (float32 stem and LayerNorms, LayerNorm weights near 1) of `depth` blocks on CUDA."""
    from policies.pi05.config import SiglipConfig
    from policies.pi05.model import randomize_parameters_
    from policies.pi05.siglip import SiglipVisionTower

    with torch.device("cuda"):
        tower = SiglipVisionTower(SiglipConfig(width=width, depth=depth, mlp_dim=mlp_dim, num_heads=num_heads))
    randomize_parameters_(tower, 0, std=0.02).to(torch.bfloat16)
    tower.embeddings.float()
    with torch.no_grad():
        for norm in (m for m in tower.modules() if isinstance(m, torch.nn.LayerNorm)):
            norm.float().weight.add_(1.0)
    return tower


def test_fused_vision_tower_agrees_with_unfused():
    """Four So400m-width blocks, 3 images: fused and unfused towers within 2^-6 of the largest output."""
    pytest.importorskip("triton")
    tower = _vision_tower(4)
    pixels = torch.rand(3, 3, 224, 224, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    with torch.no_grad():
        plain = tower(pixels * 2 - 1)
        fused = tower(pixels * 2 - 1, use_kernels=True)
    err = ((fused.float() - plain.float()).abs().max() / plain.float().abs().max()).item()
    assert err < 2**-6, err  # one-ulp differences of each norm compound over the blocks: most elements differ


def _vision_kernels(depth: int, fused: bool) -> int:
    """CUDA kernels of one no-grad tower call (batch 1) of a `depth`-block bfloat16 SigLIP tower."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    tower = _vision_tower(depth, width=64, mlp_dim=128, num_heads=4)
    pixels = torch.zeros(1, 3, 224, 224, device="cuda")
    with torch.no_grad():
        for _ in range(2):
            tower(pixels, use_kernels=fused)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            tower(pixels, use_kernels=fused)
            torch.cuda.synchronize()
    return sum(Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA).values())


def test_fused_vision_tower_cuts_kernels_per_layer():
    """Per block (a 2-block minus a 1-block tower): the two adds, two LayerNorms and their four parameter casts
    (and any layout copies the norms make) become two kernels; outside the blocks the post-layernorm's three
    become one."""
    counts = {(d, f): _vision_kernels(d, f) for d in (1, 2) for f in (False, True)}
    per_layer = {f: counts[2, f] - counts[1, f] for f in (False, True)}
    assert per_layer[True] <= per_layer[False] - 6, per_layer
    outside = {f: counts[1, f] - per_layer[f] for f in (False, True)}
    assert outside[True] <= outside[False] - 2, outside


@pytest.mark.parametrize(("batch", "tokens", "need_q"), [(1, 50, True), (8, 1018, True), (2, 300, False)])
def test_qkv_rope_matches_float32_formula(batch, tokens, need_q):
    pytest.importorskip("triton")
    from policies.pi05 import kernels

    g = torch.Generator(device="cuda").manual_seed(tokens)
    n, nkv, hd, start = 8, 1, 256, 17
    y = torch.randn(batch, tokens, (n + 2 * nkv) * hd, device="cuda", generator=g).bfloat16()
    heads = y.view(batch, tokens, n + 2 * nkv, hd)
    q, k, v = heads[:, :, :n], heads[:, :, n : n + nkv], heads[:, :, n + nkv :]
    positions = torch.randint(0, 1100, (batch, tokens), device="cuda", generator=g)
    cos, sin = (c[:, 0] for c in rope_cos_sin(positions, hd, 10_000.0, torch.bfloat16))
    keys = torch.zeros(batch, nkv, tokens + start + 5, hd, device="cuda", dtype=torch.bfloat16)
    values = torch.zeros_like(keys)
    q_out = torch.empty(batch, tokens, n, hd, device="cuda", dtype=torch.bfloat16) if need_q else None
    slot = slice(start, start + tokens)
    with torch.no_grad():
        kernels.qkv_rope(q if need_q else None, k, v, cos, sin, q_out,
                         keys[:, :, slot].transpose(1, 2), values[:, :, slot].transpose(1, 2))  # fmt: skip

    def rope32(x):
        xf = x.float()
        swapped = torch.cat([xf[..., hd // 2 :], xf[..., : hd // 2]], dim=-1)
        return xf * cos.float()[:, :, None] + swapped * sin.float()[:, :, None]

    assert _within_ulp(keys[:, :, slot].transpose(1, 2), rope32(k))
    assert torch.equal(values[:, :, slot], v.transpose(1, 2))
    assert not keys[:, :, :start].any() and not keys[:, :, start + tokens :].any()
    if need_q:
        assert _within_ulp(q_out, rope32(q)), _rel_err(q_out, rope32(q))


def _policy(model, graphs: bool, fused: bool, **rollout):
    from policies.pi05.policy import Pi05Policy, RolloutConfig
    from policies.pi05.scheduler import SchedulerConfig
    from tests.policies.pi05.test_scheduler_cuda import _Proc

    sched = SchedulerConfig(max_batch_size=8, num_steps=(5,), prompt_buckets=(16, 48, 200), camera_sets=((0, 1, 2),),
                            cuda_graphs=graphs, fused_kernels=fused)  # fmt: skip
    return Pi05Policy(model, _Proc((0, 1, 2)), RolloutConfig(num_steps=5, action_chunk=4, **rollout), sched)


@pytest.mark.parametrize("fused", [True, False])
def test_graph_replay_equals_eager_bitwise_with_and_without_fused_kernels(fused):
    from tests.policies.pi05.test_scheduler_cuda import _inputs, _model

    model = _model()
    graph, eager = _policy(model, True, fused), _policy(model, False, fused)
    x = _inputs(5, 48, 40)
    a, b = graph.act_inputs(x, seeds=range(5)), eager.act_inputs(x, seeds=range(5))
    for name in ("chains", "log_prob_elements", "values", "denoise_inds"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_fused_kernels_agree_with_unfused_policy():
    from tests.policies.pi05.test_scheduler_cuda import _inputs, _model

    model = _model()
    x = _inputs(5, 200, 150, seed=3)
    fused = _policy(model, True, True).act_inputs(x, seeds=range(5))
    plain = _policy(model, True, False).act_inputs(x, seeds=range(5))
    assert torch.equal(fused.chains[:, 0], plain.chains[:, 0])
    assert torch.allclose(fused.chains, plain.chains, atol=2e-2, rtol=0), (fused.chains - plain.chains).abs().max()
    assert torch.allclose(fused.values, plain.values, atol=2e-2, rtol=2e-2)


def _denoise_stage_kernels(depth: int, fused: bool) -> int:
    """CUDA kernels of one eager denoise stage (K = 5, batch 1; the graph's kernels) of a `depth`-layer tiny model."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from policies.pi05.config import GemmaConfig, Pi05Config
    from policies.pi05.model import Pi05Model, randomize_parameters_
    from tests.policies.pi05.test_scheduler_cuda import _inputs

    llm = GemmaConfig(width=64, depth=depth, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=24)
    expert = GemmaConfig(width=40, depth=depth, mlp_dim=72, num_heads=4, num_kv_heads=1, head_dim=24)
    with torch.device("cuda"):
        model = Pi05Model(Pi05Config.tiny(max_token_len=200, llm=llm, expert=expert))
    randomize_parameters_(model, 0)
    policy = _policy(model.set_precision(torch.bfloat16), False, fused)
    sched = policy.scheduler
    sched._load(_inputs(1, 48, 40), torch.zeros(1, dtype=torch.int64, device="cuda"),
                torch.zeros(1, dtype=torch.int64, device="cuda"), policy.sampling_options(True), 1, 48)  # fmt: skip
    with torch.no_grad():
        for _ in range(2):
            sched._denoise_stage(1, 48, (0, 1, 2), 5)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            sched._denoise_stage(1, 48, (0, 1, 2), 5)
            torch.cuda.synchronize()
    return sum(Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA).values())


def test_fused_kernels_cut_kernels_per_expert_layer_step():
    """Kernel counts of the eager denoise stage (the graph's kernels): a 2-layer minus a 1-layer tiny model."""
    counts = {(d, f): _denoise_stage_kernels(d, f) for d in (1, 2) for f in (False, True)}
    per_step = {f: (counts[2, f] - counts[1, f]) / 5 for f in (False, True)}
    assert per_step[True] <= per_step[False] - 8, per_step
    assert per_step[True] <= 12, per_step  # the expert attention is the Triton kernel (1-2 kernels, "gemm" 5)
    # outside the layers: `denoise_update` replaces the 38 kernels of each step's sampler math by one
    outside = {f: (counts[1, f] - 5 * per_step[f]) / 5 for f in (False, True)}
    assert outside[True] <= outside[False] - 30, outside


@pytest.mark.parametrize(
    ("batch", "t", "keys", "splits"),
    [(1, 50, 1018, None), (64, 50, 1018, None), (3, 50, 866, 1), (3, 50, 866, 7), (1, 968, 968, None),
     (4, 968, 968, None)],  # fmt: skip
)
def test_expert_attention_kernel_matches_float32_softmax(batch, t, keys, splits):
    """Full-size expert geometry (8 query heads over one K/V head of width 256, 50 action tokens) and the prefix LM's
    (968 queries over their own keys), at both launch geometries (`tiles_for`): the kernel within 2^-7 of the largest
    float32 output (bf16 operands and probabilities), the "gemm" path alike."""
    pytest.importorskip("triton")
    from policies.pi05 import attention_kernel
    from policies.pi05.attention import additive_mask, attend

    g = torch.Generator(device="cuda").manual_seed(keys + batch)
    n, hd = 8, 256
    q = torch.randn(batch, t, n, hd, device="cuda", generator=g).bfloat16().transpose(1, 2)  # token-major
    k, v = (torch.randn(batch, 1, keys, hd, device="cuda", generator=g).bfloat16() for _ in range(2))
    valid = torch.rand(batch, keys, device="cuda", generator=g) > 0.2
    valid[:, -50:] = True
    mask = additive_mask(valid, torch.float32)
    with torch.no_grad():
        out = attention_kernel.attend(q, k, v, mask, hd**-0.5, splits)
        gemm = attend(q, k, v, mask, hd**-0.5, "gemm")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = attention_kernel.attend(q, k, v, mask, hd**-0.5, splits)
        graph.replay()
    ref = attention_kernel.reference(q, k, v, mask, hd**-0.5)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2**-7, err
    assert ((gemm.float() - ref).abs().max() / ref.abs().max()).item() < 2**-7
    assert out.stride() == q.stride() and torch.equal(replayed, out)


@pytest.mark.parametrize("backend", ["triton_flash", "flash"])
def test_fused_expert_packed_action_keys_match_the_tail_layout(backend):
    """The packed action K/V (rows num_valid + j) on CUDA, read by the Triton kernel ("triton_flash" below the
    threshold) or FlashAttention-4 in place ("flash", `seqused_k`): the same expert output as the static-tail layout
    within four bf16 ulps of its largest value, the same first-layer K/V bitwise."""
    pytest.importorskip("triton")
    from policies.pi05 import attention
    from tests.policies.pi05.helpers import packed_and_tail_expert_steps

    if backend == "flash" and attention.flash_device_status(torch.device("cuda")) is not None:
        pytest.skip(f"flash not run: {attention.flash_device_status(torch.device('cuda'))}")
    run = packed_and_tail_expert_steps("cuda", backend)
    packed, tail, h = run["packed"], run["tail"], run["h"]
    t = packed.suffix_offset
    for row, n in enumerate(run["prefix"].num_valid.tolist()):
        assert torch.equal(packed.keys[0][row, :, n : n + h], tail.keys[0][row, :, t:])
    got, want = (o.float() for o in run["outs"])
    assert (got - want).abs().max() <= want.abs().max() * 4 * 2**-7


def _step_inputs(b: int, k: int, seed: int):
    """Random (B, H=50, D=32) step inputs at case (a) geometry, K-step tables, a (B, K) stochastic pattern."""
    from policies.pi05.sampler import StepTables

    g = torch.Generator(device="cuda").manual_seed(seed)
    h, d = 50, 32
    x, v, lp = (torch.randn(b, h, d, device="cuda", generator=g) for _ in range(3))
    xi = torch.randn(b, k, h, d, device="cuda", generator=g)
    learned = torch.rand(b, h, d, device="cuda", generator=g) * 0.08 + 0.08
    stochastic = (torch.rand(b, k, device="cuda", generator=g) > 0.3).float()
    return StepTables.build(k, "cuda"), x, v, xi, learned, stochastic, lp


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| in float32 ulps of want."""
    ulp = torch.nextafter(want.abs(), torch.full_like(want, float("inf"))) - want.abs()
    return ((got - want).abs() / ulp).max().item()


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize(("sde_on", "learned_on", "noise_level"), [(1.0, 0.0, 0.5), (0.0, 1.0, 0.5), (0.0, 0.0, 0.5),
                                                                    (1.0, 0.0, 0.0)])  # fmt: skip
def test_denoise_update_equals_step_update(batch, sde_on, learned_on, noise_level):
    pytest.importorskip("triton")
    from policies.pi05 import kernels
    from policies.pi05.sampler import StepInputs, step_update

    k = 10
    steps, x, v, xi, learned, stochastic, lp = _step_inputs(batch, k, seed=batch)
    sigmas = steps.sigmas(torch.tensor(noise_level, device="cuda"))
    on, learned_on_t, w = (torch.tensor(u, device="cuda") for u in (sde_on, learned_on, 1 / 11))
    with torch.no_grad():
        for i in range(k):
            step = StepInputs(steps.times[i], steps.deltas[i], sigmas[i], stochastic[:, i], on, learned_on_t, w)
            args = (x, v, xi[:, i], step, learned, lp)
            (gx, glp), (rx, rlp) = kernels.denoise_update(*args), step_update(*args)
            assert torch.equal(gx, rx), (i, (gx - rx).abs().max().item())
            assert _ulps(glp, rlp) <= 2.0, (i, _ulps(glp, rlp), (glp != rlp).sum().item())
            x, lp = rx, rlp


def test_denoise_update_in_a_graph_reads_the_tables():
    """Captured once, replayed after the step tables change in place: the replay follows them, equal to eager."""
    pytest.importorskip("triton")
    from policies.pi05 import kernels
    from policies.pi05.sampler import StepInputs

    steps, x, v, xi, learned, stochastic, lp = _step_inputs(4, 5, seed=7)
    sigmas = steps.sigmas(torch.tensor(0.5, device="cuda"))
    on, off, w = (torch.tensor(u, device="cuda") for u in (1.0, 0.0, 0.2))
    inputs = StepInputs(steps.times[2], steps.deltas[2], sigmas[2], stochastic[:, 2], on, off, w)

    def step():
        return kernels.denoise_update(x, v, xi[:, 2], inputs, learned, lp)

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_x, out_lp = step()
        for scale in (1.0, 1.7):
            sigmas.mul_(scale)  # an in-place table refresh
            graph.replay()
            want_x, want_lp = step()
            assert torch.equal(out_x, want_x) and torch.equal(out_lp, want_lp), scale


@pytest.mark.parametrize(("method", "joint"), [("sde", True), ("sde", False), ("noise", True), ("ode", False)])
def test_graph_replay_equals_eager_with_fused_denoise_update(method, joint):
    from tests.policies.pi05.test_scheduler_cuda import _inputs, _model

    model = _model()
    graph = _policy(model, True, True, method=method, joint=joint)
    eager = _policy(model, False, True, method=method, joint=joint)
    x = _inputs(3, 48, 40, seed=5)
    a, b = graph.act_inputs(x, seeds=range(3)), eager.act_inputs(x, seeds=range(3))
    for name in ("chains", "log_prob_elements", "values", "denoise_inds"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("rows", [50, 3000])
def test_geglu_gemm_matches_float32_formula_and_replays_in_a_graph(rows):
    """The LM's gate/up + GeGLU GEMM at its real width (2048 -> 16384 columns cut to 2048), rows not a multiple of
    the row block: within one bf16 ulp of the float32 formula (+ float32 summation order), and a CUDA graph replay
    equals the eager call bitwise."""
    pytest.importorskip("triton")
    from policies.pi05 import geglu_gemm

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the GeGLU GEMM needs sm90+ (TMA)")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 2048, device="cuda", generator=g).bfloat16()
    gate_w, up_w = ((torch.randn(2048, 2048, device="cuda", generator=g) * 0.02).bfloat16() for _ in range(2))
    stack = geglu_gemm.stack_gate_up(gate_w, up_w)
    every_call = geglu_gemm.GemmTiles(min_waves=0)  # these calls have fewer tiles than the default takes
    with torch.no_grad():
        assert geglu_gemm.serves(x, stack, every_call) and not geglu_gemm.serves(x, stack)
        eager = geglu_gemm.geglu_linear(x, stack, every_call)
        ref = geglu_gemm.reference(x, gate_w, up_w)
        assert (eager.float() - ref).abs().max() <= ref.abs().max() * 2**-7
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = geglu_gemm.geglu_linear(x, stack, every_call)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(static, eager)
