"""CUDA-graph scheduler checks (run on the GPU by benchmarks/gpu_suite.py; skipped on CPU)."""

import numpy as np
import pytest
import torch

from policies.pi05.config import Pi05Config
from policies.pi05.inputs import ModelInputs
from policies.pi05.model import Pi05Model, randomize_parameters_
from policies.pi05.policy import Pi05Policy, RolloutConfig
from policies.pi05.scheduler import Pi05Scheduler, SchedulerConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_suite.py)"),
]


class _Proc:
    def __init__(self, slots):
        self.slots = tuple(slots)
        self.action_dim = 7
        self.prompt_buckets = (16, 48, 200)

    def postprocess(self, a, c):
        return a[:, :c, :7]


def _model(dtype=torch.bfloat16, **overrides):
    cfg = Pi05Config.tiny(max_token_len=200, value_source="prefix", **overrides)
    with torch.device("cuda"):
        model = Pi05Model(cfg)
    randomize_parameters_(model, 0)
    return model.set_precision(dtype)


def _inputs(n, length, real, slots=(0, 1, 2), seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 2000, (n, length), generator=g, dtype=torch.int32)
    lengths = torch.randint(max(1, real // 2), real + 1, (n,), generator=g).int()
    return ModelInputs(
        images=torch.randint(0, 256, (n, len(slots), 3, 224, 224), generator=g, dtype=torch.uint8),
        image_mask=torch.rand(n, len(slots), generator=g) > 0.2,
        slots=tuple(slots),
        tokens=tokens,
        lengths=lengths,
    ).to("cuda")


def _policy(model, graphs, k=(5, 10), max_batch=8):
    sched = SchedulerConfig(
        max_batch_size=max_batch,
        num_steps=k,
        prompt_buckets=(16, 48, 200),
        camera_sets=((0, 1, 2),),
        cuda_graphs=graphs,
    )
    return Pi05Policy(model, _Proc((0, 1, 2)), RolloutConfig(num_steps=k[0], action_chunk=4), sched)


def test_the_first_noise_call_captures_the_noise_head_graphs_once():
    """An SDE policy switched to method "noise": its first call captures the head's denoise graph, then replays."""
    from dataclasses import replace

    model = _model()
    graph, eager = _policy(model, True), _policy(model, False)
    x = _inputs(3, 48, 40)
    graph.act_inputs(x, seeds=range(3))  # the SDE shape: prefix and denoise graphs
    before = graph.scheduler.stats.captures
    for policy in (graph, eager):
        policy.rollout = replace(policy.rollout, method="noise")
    a = graph.act_inputs(x, seeds=range(3))
    added = graph.scheduler.stats.captures - before
    assert added == 1  # the denoise graph with the head; the prefix graph is shared
    b = eager.act_inputs(x, seeds=range(3))
    assert torch.equal(a.chains, b.chains) and torch.equal(a.log_prob_elements, b.log_prob_elements)
    graph.act_inputs(x, seeds=range(3))
    assert graph.scheduler.stats.captures - before == added


def test_graph_replay_equals_eager_bitwise():
    model = _model()
    graph, eager = _policy(model, True), _policy(model, False)
    x = _inputs(5, 48, 40)
    a = graph.act_inputs(x, seeds=range(5))
    b = eager.act_inputs(x, seeds=range(5))
    assert graph.scheduler.stats.captures > 0 and eager.scheduler.stats.captures == 0
    for name in ("chains", "log_prob_elements", "values", "denoise_inds"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def _garbage(sched: Pi05Scheduler):
    buf = sched.buffers
    for t in [*buf.keys, *buf.values, buf.chain, buf.log_prob, buf.out_values, buf.prefix_value]:
        t.copy_(torch.randn_like(t, dtype=torch.float32).mul(1e4).to(t.dtype))


def test_adversarial_sequence_real_rows_unchanged():
    model = _model()
    policy = _policy(model, True, max_batch=8)
    reference = _policy(model, False, max_batch=8)
    policy.scheduler.warmup([(8, 200), (1, 16), (3, 48), (2, 16)])  # the shapes below, captured up front
    captures = policy.scheduler.stats.captures
    calls = [
        (_inputs(8, 200, 200, seed=1), 5),
        (_inputs(1, 16, 16, seed=2), 5),
        (_inputs(3, 48, 40, seed=3), 10),
        (_inputs(2, 16, 10, seed=4), 5),
    ]
    for x, k in calls:
        policy.rollout = RolloutConfig(num_steps=k, action_chunk=4)
        reference.rollout = policy.rollout
        _garbage(policy.scheduler)
        got = policy.act_inputs(x, seeds=range(x.batch_size))
        want = torch.cat(
            [reference.act_inputs(x.select(slice(i, i + 1)), seeds=[i]).chains for i in range(x.batch_size)]
        )
        assert torch.allclose(got.chains, want, atol=2e-2, rtol=0), (k, (got.chains - want).abs().max())
        assert torch.equal(got.chains[:, 0], want[:, 0])  # x_0 draws are exact
    assert policy.scheduler.stats.captures == captures  # nothing captured on the hot path


def test_batch_equals_single_calls_in_sde_mode():
    model = _model(torch.float32)
    policy = _policy(model, True)
    x = _inputs(6, 48, 30, seed=5)
    batch = policy.act_inputs(x, seeds=range(6))
    for i in range(6):
        single = policy.act_inputs(x.select(slice(i, i + 1)), seeds=[i])
        assert torch.equal(single.denoise_inds, batch.denoise_inds[i : i + 1])
        assert torch.allclose(single.chains, batch.chains[i : i + 1], atol=1e-4)
        assert torch.allclose(single.log_prob, batch.log_prob[i : i + 1], atol=1e-2)


def test_outputs_do_not_alias_static_memory():
    model = _model()
    policy = _policy(model, True)
    x = _inputs(2, 16, 12, seed=6)
    first = policy.act_inputs(x, seeds=[0, 1])
    kept = first.chains.clone()
    policy.act_inputs(_inputs(2, 16, 12, seed=7), seeds=[5, 6])
    assert torch.equal(first.chains, kept)
    first.chains.zero_()
    again = policy.act_inputs(x, seeds=[0, 1])
    assert torch.equal(again.chains, kept)


def test_no_host_sync_on_the_step_path():
    model = _model()
    policy = _policy(model, True)
    x = _inputs(4, 48, 40, seed=8)
    policy.act_inputs(x, seeds=range(4))  # streams sized; warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = policy.act_inputs(x, env_ids=torch.arange(4, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.actions.shape == (4, 4, 7)


def test_state_in_prompt_step_with_gpu_state_has_no_host_sync(standin_tokenizer):
    """The real processor (state-in-prompt, device-built state tokens) + graphs, observations on the GPU."""
    from policies.pi05.normalize import NormStats

    stats = NormStats(q01=np.full(8, -1.0), q99=np.full(8, 1.0), mean=np.zeros(8), std=np.ones(8))
    policy = Pi05Policy.from_config(
        Pi05Config.tiny(max_token_len=200), action_dim=7, device="cuda", seed=0, tokenizer=standin_tokenizer,
        camera_map={"image": "base_0_rgb", "wrist": "left_wrist_0_rgb"}, prompt_format="state", state_stats=stats,
        scheduler=SchedulerConfig(max_batch_size=8, num_steps=(5,), camera_sets=((0, 1),), prompt_buckets=(48, 200)),
        rollout=RolloutConfig(num_steps=5, action_chunk=4),
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    obs = {
        "images": {
            "image": torch.randint(0, 256, (4, 224, 224, 3), device="cuda", dtype=torch.uint8, generator=g),
            "wrist": torch.randint(0, 256, (4, 224, 224, 3), device="cuda", dtype=torch.uint8, generator=g),
        },
        "state": torch.rand(4, 8, device="cuda", generator=g) * 2 - 1,
        "task": ["pick up the cube"] * 4,
    }
    env_ids = torch.arange(4, device="cuda")
    policy.act(obs, env_ids=env_ids)  # warm: task tokens cached, streams sized
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = policy.act(obs, env_ids=env_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.actions.shape == (4, 4, 7)
    host = policy.processor({k: ({c: v.cpu() for c, v in obs["images"].items()} if k == "images" else
                                 (v.cpu() if torch.is_tensor(v) else v)) for k, v in obs.items()})
    assert torch.equal(out.inputs.tokens.cpu(), host.tokens.cpu())  # device-built prompt == host tokenisation


def test_gemm_attention_on_cuda_uses_float32_scores_and_matches_sdpa():
    from policies.pi05 import attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(4, 50, 8, 256, device="cuda", generator=g).transpose(1, 2).bfloat16()  # token-major
    k = torch.randn(4, 1, 1018, 256, device="cuda", generator=g).bfloat16()
    v = torch.randn(4, 1, 1018, 256, device="cuda", generator=g).bfloat16()
    mask = torch.rand(4, 1018, device="cuda", generator=g) > 0.3
    with torch.no_grad():
        out = attention.attend(q, k, v, mask, 256**-0.5, "gemm")
        ref = attention.attend(q.float(), k.float(), v.float(), mask, 256**-0.5, "eager")
        sdpa = attention.attend(q, k, v, mask, 256**-0.5, "sdpa")
    assert attention._half_scores_supported(q.device), "baddbmm(out_dtype=float32) was refused on CUDA"
    err_gemm = (out.float() - ref).abs().max().item()
    err_sdpa = (sdpa.float() - ref).abs().max().item()
    assert err_gemm <= max(2 * err_sdpa, 1e-2), (err_gemm, err_sdpa)


@pytest.mark.parametrize("cols", [128, 4096, 4304, 16384])
def test_fused_geglu_matches_pytorch(cols, monkeypatch):
    pytest.importorskip("triton")
    from policies.pi05 import kernels

    g = torch.Generator(device="cuda").manual_seed(cols)
    y = (torch.randn(3, 37, 2 * cols, device="cuda", generator=g) * 4).bfloat16()
    y[0, 0, :8] = torch.tensor([-1e4, -50.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 1e4])  # saturation, no NaN
    gate, up = y.chunk(2, dim=-1)  # strided views of the fused GEMM output, as in the expert
    with torch.no_grad():
        fused = kernels.geglu(gate, up)
        ref = torch.nn.functional.gelu(gate.float(), approximate="tanh") * up.float()
    assert fused.dtype == torch.bfloat16 and fused.shape == gate.shape and torch.isfinite(fused).all()
    # rounded once from float32: within one bf16 ulp of the float32 formula (PyTorch's two kernels round twice)
    assert ((fused.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()
    monkeypatch.setattr(kernels, "HAS_TRITON", False)
    plain = kernels.geglu(gate, up)
    assert ((plain.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all()


def test_fused_gelu_in_place_matches_pytorch():
    """SigLIP's GELU in place (fc1's output at full width 4304): within one bf16 ulp of the float32 formula and of
    PyTorch's bf16 GELU, finite where tanh saturates; non-contiguous input falls back to F.gelu unchanged."""
    pytest.importorskip("triton")
    from policies.pi05 import kernels

    g = torch.Generator(device="cuda").manual_seed(4304)
    x = (torch.randn(3, 37, 4304, device="cuda", generator=g) * 4).bfloat16()
    x[0, 0, :8] = torch.tensor([-1e4, -50.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 1e4])
    ref = torch.nn.functional.gelu(x.float(), approximate="tanh")
    plain = torch.nn.functional.gelu(x, approximate="tanh")
    with torch.no_grad():
        out = kernels.gelu_tanh_(x)
    assert out.data_ptr() == x.data_ptr() and torch.isfinite(out).all()
    assert ((out.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()
    assert ((out.float() - plain.float()).abs() <= plain.float().abs() * 2**-7 + 1e-6).all()
    strided = x.transpose(0, 1)
    assert torch.equal(kernels.gelu_tanh_(strided), torch.nn.functional.gelu(strided, approximate="tanh"))
