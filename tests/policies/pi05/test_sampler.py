"""Rollout math (DESIGN C4) against the closed forms and the sigma table of reference/rl_rollout.md section 2.2.

References are written here in float64: t_i = linspace(1, 1/K, K) ++ [0] (RLinf's float32 schedule, section 2.1),
sigma_i = a sqrt(t_i / (1 - t'_i)) with t'_0 = t_1, s_i = sqrt(Delta_i) sigma_i, shrink = sigma_i^2 Delta_i / (2 t_i).
"""

from __future__ import annotations

import math

import pytest
import torch

from policies.base import RolloutConfig
from policies.pi05.sampler import (
    ControlInputs,
    Controls,
    StepTables,
    controls,
    denoise,
    draw_noise,
    gaussian_log_prob,
    transition,
)

# reference/rl_rollout.md section 2.2, as printed (3 significant decimals)
SIGMA_TABLE = {
    (3, 0.5): ([0.866, 0.707, 0.354], [0.500, 0.408, 0.204], [0.125, 0.125, 0.0625]),
    (4, 0.5): ([1.0, 0.866, 0.5, 0.289], [0.500, 0.433, 0.250, 0.144], [0.125, 0.125, 0.0625, 0.0417]),
    (5, 0.5): (
        [1.118, 1.0, 0.612, 0.408, 0.25],
        [0.500, 0.447, 0.274, 0.183, 0.112],
        [0.125, 0.125, 0.0625, 0.0417, 0.0312],
    ),
    (5, 0.3): (
        [0.671, 0.6, 0.367, 0.245, 0.15],
        [0.300, 0.268, 0.164, 0.110, 0.067],
        [0.045, 0.045, 0.0225, 0.015, 0.0113],
    ),
}


def ref_schedule(k: int, a: float):
    """float64 (times (K+1,), deltas, sigma, s, shrink) from the closed forms."""
    times = torch.cat([torch.linspace(1.0, 1.0 / k, k), torch.zeros(1)]).double()
    deltas = times[:-1] - times[1:]
    t = times[:-1]
    t_den = t.clone()
    t_den[0] = times[1]
    sigma = torch.tensor([a * math.sqrt(t[i] / (1.0 - t_den[i])) for i in range(k)], dtype=torch.float64)
    s = deltas.sqrt() * sigma
    shrink = sigma**2 * deltas / (2.0 * t)
    return times, deltas, sigma, s, shrink


def ref_log_normal(x, mean, std):
    x, mean, std = x.double(), mean.double(), std.double()
    return torch.distributions.Normal(mean, std).log_prob(x)


def sde_coefficients(k: int, a: float):
    """(sigma, s, shrink) per step as the code computes them (shrink read off `transition` with x=1, v=0)."""
    tables = StepTables.build(k)
    sigma = tables.sigmas(a)
    s, shrink = [], []
    one = torch.ones(())
    for i in range(k):
        mean, std = transition(
            torch.ones(1, 1, 1), torch.zeros(1, 1, 1), tables.times[i], tables.deltas[i], sigma[i], one, one,
            torch.zeros(()), None,
        )
        s.append(std.item())
        shrink.append(1.0 - mean.double().item())
    return sigma.double(), torch.tensor(s, dtype=torch.float64), torch.tensor(shrink, dtype=torch.float64)


@pytest.mark.parametrize("k,a", list(SIGMA_TABLE))
def test_sigma_s_and_shrink_match_reference_table(k: int, a: float) -> None:
    sigma, s, shrink = sde_coefficients(k, a)
    table_sigma, table_s, table_shrink = (torch.tensor(v, dtype=torch.float64) for v in SIGMA_TABLE[(k, a)])
    # as printed: 3 decimals (the printed .0312 / .0113 are truncations of 0.03125 / 0.01125)
    for name, got, printed in (("sigma", sigma, table_sigma), ("s", s, table_s), ("shrink", shrink, table_shrink)):
        assert (got - printed).abs().max() < 6e-4, (name, got, printed)
    # closed forms to 1e-6
    _, deltas, ref_sigma, ref_s, ref_shrink = ref_schedule(k, a)
    torch.testing.assert_close(sigma, ref_sigma, atol=1e-6, rtol=0)
    torch.testing.assert_close(s, ref_s, atol=1e-6, rtol=0)
    torch.testing.assert_close(shrink, ref_shrink, atol=1e-6, rtol=0)
    # the special forms of section 2.2: s_0 = a sqrt(K Delta_0) ~ a, shrink_0 = a^2 / 2, sigma_0 = a sqrt(K)
    assert abs(s[0] - a) < 1e-6 and abs(shrink[0] - a * a / 2) < 1e-6 and abs(sigma[0] - a * math.sqrt(k)) < 1e-6
    times = ref_schedule(k, a)[0]
    for i in range(1, k):
        t = times[i].item()
        assert abs(s[i] - a * math.sqrt(deltas[i] * t / (1 - t))) < 1e-6
        assert abs(shrink[i] - a * a * deltas[i] / (2 * (1 - t))) < 1e-6


def test_schedule_is_float32_linspace() -> None:
    for k in (1, 3, 10):
        tables = StepTables.build(k)
        expected = torch.cat([torch.linspace(1.0, 1.0 / k, k), torch.zeros(1)])
        assert tables.times.dtype == torch.float32 and torch.equal(tables.times, expected)
        assert torch.equal(tables.deltas, expected[:-1] - expected[1:])
    # K = 1: t'_0 has no t_1 to borrow; the code uses 0 so sigma_0 = a
    assert torch.allclose(StepTables.build(1).sigmas(0.5), torch.tensor([0.5]))


@pytest.mark.parametrize("method", ["ode", "sde", "noise"])
def test_transition_mean_and_std_closed_form(method: str) -> None:
    gen = torch.Generator().manual_seed(0)
    k, a = 5, 0.4
    times, deltas, sigma, _, _ = ref_schedule(k, a)
    tables = StepTables.build(k)
    x = torch.randn(3, 4, 6, generator=gen)
    v = torch.randn(3, 4, 6, generator=gen)
    learned = 0.08 + 0.08 * torch.rand(3, 4, 6, generator=gen)
    sde_on = torch.tensor(float(method == "sde"))
    noise_on = torch.tensor(float(method == "noise"))
    stoch = torch.tensor([1.0, 0.0, 1.0])[:, None, None]
    if method == "ode":
        stoch = torch.zeros_like(stoch)
    for i in range(k):
        mean, std = transition(
            x, v, tables.times[i], tables.deltas[i], tables.sigmas(a)[i], stoch, sde_on, noise_on, learned
        )
        t, d = times[i], deltas[i]
        xd, vd = x.double(), v.double()
        ode = xd - d * vd
        if method == "sde":
            x1_hat = xd + (1 - t) * vd
            ref_mean = ode - stoch.double() * (sigma[i] ** 2 * d / (2 * t)) * x1_hat
            ref_std = stoch.double() * torch.sqrt(d) * sigma[i] * torch.ones_like(xd)
        elif method == "noise":
            ref_mean, ref_std = ode, stoch.double() * learned.double()
        else:
            ref_mean, ref_std = ode, torch.zeros_like(xd)
        torch.testing.assert_close(mean.double(), ref_mean, atol=2e-6, rtol=1e-6)
        torch.testing.assert_close(std.double(), ref_std, atol=1e-6, rtol=1e-6)
        # the non-stochastic env is exactly the ODE step with s = 0
        assert torch.equal(std[1], torch.zeros_like(std[1]))


def test_gaussian_log_prob_matches_float64_density_and_masks_zero_std() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, 6, generator=gen)
    mean = torch.randn(4, 5, 6, generator=gen)
    std = 0.05 + torch.rand(4, 5, 6, generator=gen)
    lp = gaussian_log_prob(x, mean, std)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_log_normal(x, mean, std), atol=1e-4, rtol=1e-6)
    # by hand, in float64 through the function itself (dtype-generic)
    xd, md, sd = x.double(), mean.double(), std.double()
    by_hand = -torch.log(sd) - 0.5 * math.log(2 * math.pi) - (xd - md) ** 2 / (2 * sd**2)
    torch.testing.assert_close(gaussian_log_prob(xd, md, sd), by_hand, atol=1e-12, rtol=1e-12)
    # s == 0 gives exactly 0 whatever x - mean is (and no NaN/inf anywhere, gradients included)
    std0 = std.clone()
    std0[:, 2] = 0.0
    x_req = x.clone().requires_grad_(True)
    lp0 = gaussian_log_prob(x_req, mean + 100.0, std0)
    assert torch.equal(lp0[:, 2], torch.zeros_like(lp0[:, 2]))
    lp0.sum().backward()
    assert torch.isfinite(x_req.grad).all() and torch.equal(x_req.grad[:, 2], torch.zeros_like(x_req.grad[:, 2]))


def fixed_controls(b: int, k: int, stochastic: torch.Tensor, method: str, a: float, crop, pool, joint: bool):
    w = 1.0 / (k + 1) if joint else 1.0
    return Controls(
        stochastic=stochastic,
        sde_on=torch.tensor(float(method == "sde")),
        learned_std_on=torch.tensor(float(method == "noise")),
        row_weights=torch.full((k,), w),
        x0_weight=torch.tensor(w if joint else 0.0),
        crop=crop,
        pool=pool,
        noise_level=torch.tensor(a),
    )


def linear_velocity(x: torch.Tensor, i: int):
    """A deterministic stand-in for the expert: v = 0.7 x - 0.2 (i + 1), expert output = x[..., :3]."""
    return 0.7 * x - 0.2 * (i + 1), x[..., :3] * (i + 1)


@pytest.mark.parametrize("j", [0, 2, 4])
def test_sde_step_empirical_mean_and_std(j: int) -> None:
    """20k streams through one stochastic step j: the sample mean/std of x_{j+1} match mu_j and s_j."""
    n, k, a, h, d = 20000, 5, 0.5, 2, 3
    times, deltas, sigma, s_ref, shrink_ref = ref_schedule(k, a)
    base = torch.tensor([[0.5, -1.0, 2.0], [0.0, 1.5, -0.3]])
    x0 = base.expand(n, h, d).contiguous()
    seeds = torch.arange(n, dtype=torch.int64) * 3 + 17
    _, xi = draw_noise(seeds, torch.zeros(n, dtype=torch.int64), k, h, d)
    stoch = torch.zeros(n, k)
    stoch[:, j] = 1.0
    ctrl = fixed_controls(n, k, stoch, "sde", a, torch.ones(h, d), torch.full((h,), 1 / h), joint=False)
    res = denoise(linear_velocity, x0, xi, StepTables.build(k), ctrl, None, None)
    # steps before j are deterministic: every row is the same x_j, and the ODE recursion in float64
    xj = base.double()
    for i in range(j):
        xj = xj - deltas[i] * (0.7 * xj - 0.2 * (i + 1))
    assert (res.chain[:, j] == res.chain[0, j]).all()
    torch.testing.assert_close(res.chain[0, j].double(), xj, atol=1e-5, rtol=0)
    v = 0.7 * xj - 0.2 * (j + 1)
    mu = xj - deltas[j] * v - shrink_ref[j] * (xj + (1 - times[j]) * v)
    sample = res.chain[:, j + 1].double()
    se_mean = s_ref[j] / math.sqrt(n)
    assert ((sample.mean(0) - mu).abs() < 3.5 * se_mean).all(), (sample.mean(0), mu)
    se_std = s_ref[j] / math.sqrt(2 * n)
    assert ((sample.std(0) - s_ref[j]).abs() < 3.5 * se_std).all(), (sample.std(0), s_ref[j])
    # the log-prob uses the row j only, and equals the float64 density of the sampled point
    lp_ref = ref_log_normal(sample[:64], mu.expand(64, h, d), torch.full((64, h, d), s_ref[j].item()))
    torch.testing.assert_close(res.log_prob_elements[:64].double(), lp_ref, atol=2e-5, rtol=1e-5)


def test_ode_steps_are_deterministic_and_have_zero_log_prob() -> None:
    b, k, h, d = 3, 4, 5, 6
    x0, xi = draw_noise(torch.arange(b), torch.zeros(b, dtype=torch.int64), k, h, d)
    inp = ControlInputs.from_options(RolloutConfig(method="ode", num_steps=k, action_chunk=5, action_dim=6), h, d,
                                     False, torch.device("cpu"))
    ctrl, inds = controls(inp, torch.arange(b), torch.zeros(b, dtype=torch.int64), k)
    assert torch.equal(inds, torch.full((b, k), -1))
    res = denoise(linear_velocity, x0, xi, StepTables.build(k), ctrl, None, None)
    assert torch.equal(res.log_prob_elements, torch.zeros(b, h, d))
    # no noise enters: same chain with xi = 0 and with huge xi
    res_big = denoise(linear_velocity, x0, xi * 1e6, StepTables.build(k), ctrl, None, None)
    assert torch.equal(res.chain, res_big.chain)


@pytest.mark.parametrize("method,joint", [("sde", False), ("sde", True), ("noise", True)])
@pytest.mark.parametrize("chunk,adim", [(2, 3), (5, 6), (1, 1)])
def test_crop_and_step_reductions_are_exact(method: str, joint: bool, chunk: int, adim: int) -> None:
    """Elements: row j (non-joint) or the mean over K+1 rows incl. log N(x0; 0, I) (joint), on [:C, :A] only."""
    b, k, h, d, a = 4, 3, 5, 6, 0.5
    seeds, counters = torch.arange(b) + 40, torch.full((b,), 2)
    opts = RolloutConfig(method=method, num_steps=k, noise_level=a, joint=joint, action_chunk=chunk,
                           action_dim=adim)
    inp = ControlInputs.from_options(opts, h, d, False, torch.device("cpu"))
    ctrl, inds = controls(inp, seeds, counters, k)
    x0, xi = draw_noise(seeds, counters, k, h, d)
    learned = lambda out: 0.1 + 0.01 * out.abs().mean(-1, keepdim=True).expand(*out.shape[:2], d)
    res = denoise(linear_velocity, x0, xi, StepTables.build(k), ctrl, learned if method == "noise" else None, None)

    times, deltas, sigma, _, _ = ref_schedule(k, a)
    chain = res.chain.double()
    rows = [ref_log_normal(chain[:, 0], torch.zeros_like(chain[:, 0]), torch.ones_like(chain[:, 0]))]
    for i in range(k):
        x = chain[:, i]
        v = 0.7 * x - 0.2 * (i + 1)
        ode = x - deltas[i] * v
        if method == "sde":
            mu = ode - sigma[i] ** 2 * deltas[i] / (2 * times[i]) * (x + (1 - times[i]) * v)
            s = torch.full_like(x, (deltas[i].sqrt() * sigma[i]).item())
        else:
            mu, s = ode, 0.1 + 0.01 * (x[..., :3] * (i + 1)).abs().mean(-1, keepdim=True).expand_as(x)
        rows.append(ref_log_normal(chain[:, i + 1], mu, s))
    rows = torch.stack(rows, dim=1)  # (B, K+1, H, D)
    if joint:
        assert torch.equal(inds, torch.arange(k).expand(b, k))
        expected = rows.mean(dim=1)
    else:
        j = inds[:, 0]
        assert (inds == j[:, None]).all() and (j >= 0).all() and (j < k).all()
        expected = rows[torch.arange(b), j + 1]
    mask = torch.zeros(h, d, dtype=torch.bool)
    mask[:chunk, :adim] = True
    expected = expected * mask
    got = res.log_prob_elements.double()
    # exactly zero outside the crop, nonzero inside
    assert torch.equal(res.log_prob_elements[:, ~mask], torch.zeros_like(res.log_prob_elements[:, ~mask]))
    assert (res.log_prob_elements[:, mask] != 0).all()
    torch.testing.assert_close(got, expected, atol=5e-5, rtol=1e-5)


def test_controls_indices_and_switches() -> None:
    b, k, h, d = 4000, 5, 10, 32
    seeds, counters = torch.arange(b), torch.zeros(b, dtype=torch.int64)
    dev = torch.device("cpu")

    def run(**kw):
        opts = RolloutConfig(num_steps=k, **kw)
        return controls(ControlInputs.from_options(opts, h, d, False, dev), seeds, counters, k)

    ctrl, inds = run(method="sde")
    j = inds[:, 0]
    assert torch.equal(ctrl.stochastic, torch.nn.functional.one_hot(j, k).float())
    assert set(j.tolist()) == set(range(k))
    assert ctrl.x0_weight.item() == 0 and torch.equal(ctrl.row_weights, torch.ones(k))
    _, inds_last = run(method="sde", ignore_last=True)
    assert set(inds_last[:, 0].tolist()) == set(range(k - 1))
    _, inds_shared = run(method="sde", shared_j=True)
    assert (inds_shared == inds[0, 0]).all()
    ctrl, inds = run(method="sde", joint=True)
    assert torch.equal(ctrl.stochastic, torch.ones(b, k)) and torch.equal(inds, torch.arange(k).expand(b, k))
    assert abs(ctrl.x0_weight.item() - 1 / (k + 1)) < 1e-7 and torch.allclose(ctrl.row_weights, torch.full((k,), 1 / 6))
    ctrl, inds = run(method="noise")
    assert torch.equal(ctrl.stochastic, torch.ones(b, k)) and ctrl.learned_std_on.item() == 1
    assert ctrl.sde_on.item() == 0
    ctrl, inds = run(method="ode")
    assert torch.equal(ctrl.stochastic, torch.zeros(b, k)) and (inds == -1).all()
    # value pooling windows
    opts = RolloutConfig(num_steps=k, action_chunk=3)
    assert torch.allclose(ControlInputs.from_options(opts, h, d, False, dev).pool, torch.full((h,), 1 / h))
    pool = ControlInputs.from_options(opts, h, d, True, dev).pool
    assert torch.allclose(pool, torch.tensor([1 / 3] * 3 + [0.0] * 7))


def test_suffix_values_are_the_mean_over_steps_of_the_pooled_critic() -> None:
    b, k, h, d = 2, 3, 4, 5
    x0, xi = draw_noise(torch.arange(b), torch.zeros(b, dtype=torch.int64), k, h, d)
    pool = torch.tensor([0.5, 0.5, 0.0, 0.0])
    ctrl = fixed_controls(b, k, torch.zeros(b, k), "ode", 0.5, torch.ones(h, d), pool, joint=False)
    critic = lambda feats: feats.sum(-1) * 2.0
    res = denoise(linear_velocity, x0, xi, StepTables.build(k), ctrl, None, critic)
    expected = torch.zeros(b, dtype=torch.float64)
    for i in range(k):
        out = res.chain[:, i, :, :3].double() * (i + 1)
        expected += out[:, :2].mean(1).sum(-1) * 2.0 / k
    torch.testing.assert_close(res.suffix_values.double(), expected, atol=1e-5, rtol=1e-6)


def test_sampling_options_validation() -> None:
    with pytest.raises(ValueError, match="method"):
        RolloutConfig(method="cps")
    with pytest.raises(ValueError, match="num_steps"):
        RolloutConfig(num_steps=0)
    with pytest.raises(ValueError, match="ignore_last"):
        RolloutConfig(num_steps=1, ignore_last=True)
    with pytest.raises(ValueError, match="noise_level"):
        RolloutConfig(noise_level=-0.1)
    assert RolloutConfig(method="noise").is_joint and not RolloutConfig(method="sde").is_joint
