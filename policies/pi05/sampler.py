"""Flow sampling for RL rollouts: ODE, flow-SDE and flow-noise steps, log-probs and values (DESIGN C4).

Conventions (openpi): x_t = t * noise + (1 - t) * action; t_i = linspace(1, 1/K, K) then 0; Delta_i = t_i - t_{i+1};
x0_hat = x - t v, x1_hat = x + (1 - t) v.

  ode   : mu = x - Delta v,                                   s = 0
  sde   : mu = (x - Delta v) - sigma^2 Delta / (2 t) * x1_hat, s = sqrt(Delta) sigma,
          sigma_i = a sqrt(t_i / (1 - t'_i)), t'_0 = t_1 in the denominator only
  noise : mu = x - Delta v,                                   s = noise_head(expert output) in [s_min, s_max]

Every per-call choice is a *tensor* (`Controls`): which steps are stochastic per env, whether the SDE mean
correction and the learned std are on, the log-prob row weights (row j, or the mean over K+1 rows in joint
mode), the crop to C x A and the value pooling window. So one captured graph per (batch, prompt, K) serves
every method, noise level and chunk size, and the eager CPU path runs the very same code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from .. import rng
from ..base import RolloutConfig
from . import kernels

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
NO_NOISE_HEAD = (
    "method='noise' needs the learned noise head, but this model has none (Pi05Config.noise_head=False); "
    "use method='sde', or a config with noise_head=True."
)
"""Error text for a `noise` rollout/evaluation on a model without a noise head (it would silently be an ODE)."""


@dataclass
class StepTables:
    """Schedule tables for one K: times (K+1,), deltas (K,), sigma_base (K,) = sqrt(t_i / (1 - t'_i))."""

    times: torch.Tensor
    deltas: torch.Tensor
    sigma_base: torch.Tensor

    @classmethod
    def build(cls, num_steps: int, device: torch.device | str = "cpu") -> StepTables:
        """T = linspace(1, 1/K, K) ++ [0] in float32 (RLinf's exact schedule)."""
        times = torch.cat([torch.linspace(1.0, 1.0 / num_steps, num_steps), torch.zeros(1)]).to(device)
        deltas = times[:-1] - times[1:]
        t_den = times.clone()
        t_den[0] = times[1] if num_steps > 1 else 0.0
        sigma_base = torch.sqrt(times / (1.0 - t_den))[:-1]
        return cls(times=times, deltas=deltas, sigma_base=sigma_base)

    def sigmas(self, noise_level: float | torch.Tensor) -> torch.Tensor:
        """(K,) sigma_i = a * sigma_base_i."""
        return noise_level * self.sigma_base


@dataclass
class Controls:
    """Tensor inputs that select the method inside one code path (and one captured graph).

    Attributes:
        stochastic: (B, K) float, 1 where env b's step i draws noise.
        sde_on: () float, 1 to apply the SDE mean correction and SDE std.
        learned_std_on: () float, 1 to take the std from the noise head.
        row_weights: (K,) float log-prob weights of the transition rows (1 for non-joint, 1/(K+1) joint).
        x0_weight: () float weight of log N(x_0; 0, I) (0 non-joint, 1/(K+1) joint).
        crop: (H, D) float, 1 on the executed chunk C and env dims A.
        pool: (H,) float suffix-value pooling weights (sum 1).
        noise_level: () float, a.
    """

    stochastic: torch.Tensor
    sde_on: torch.Tensor
    learned_std_on: torch.Tensor
    row_weights: torch.Tensor
    x0_weight: torch.Tensor
    crop: torch.Tensor
    pool: torch.Tensor
    noise_level: torch.Tensor


@dataclass
class ControlInputs:
    """Scalar per-call switches as tensors (static graph inputs); `controls()` turns them into `Controls`.

    Attributes:
        j_high: () float, the stochastic step is drawn from [0, j_high) (K, or K-1 with ignore_last).
        single_on: () float, 1 for non-joint SDE (one stochastic step j per env).
        all_on: () float, 1 when every step is stochastic (joint SDE, noise).
        shared_on: () float, 1 to use the first env's j for the whole batch.
        sde_on, learned_std_on, x0_weight, noise_level: as in `Controls`.
        row_weight: () float weight of every transition row.
        crop: (H, D) float; pool: (H,) float.
    """

    j_high: torch.Tensor
    single_on: torch.Tensor
    all_on: torch.Tensor
    shared_on: torch.Tensor
    sde_on: torch.Tensor
    learned_std_on: torch.Tensor
    row_weight: torch.Tensor
    x0_weight: torch.Tensor
    noise_level: torch.Tensor
    crop: torch.Tensor
    pool: torch.Tensor

    @classmethod
    def from_options(
        cls, opts: RolloutConfig, horizon: int, action_dim: int, chunk_only_value: bool, device: torch.device
    ) -> ControlInputs:
        """Host-side construction (used once a call to fill static buffers, or directly when eager)."""
        scalar = lambda value: torch.tensor(float(value), device=device)
        joint_w = 1.0 / (opts.num_steps + 1)
        crop = torch.zeros(horizon, action_dim, device=device)
        crop[: opts.action_chunk, : opts.action_dim] = 1.0
        pool_len = min(opts.action_chunk, horizon) if chunk_only_value else horizon
        pool = torch.zeros(horizon, device=device)
        pool[:pool_len] = 1.0 / pool_len
        single = opts.method == "sde" and not opts.is_joint
        return cls(
            j_high=scalar(opts.num_steps - 1 if opts.ignore_last else opts.num_steps),
            single_on=scalar(single),
            all_on=scalar(opts.is_joint),
            shared_on=scalar(opts.shared_j),
            sde_on=scalar(opts.method == "sde"),
            learned_std_on=scalar(opts.method == "noise"),
            row_weight=scalar(joint_w if opts.is_joint else 1.0),
            x0_weight=scalar(joint_w if opts.is_joint else 0.0),
            noise_level=scalar(opts.noise_level),
            crop=crop,
            pool=pool,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Name -> tensor (for copying into static buffers)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def controls(
    inp: ControlInputs, seeds: torch.Tensor, counters: torch.Tensor, num_steps: int
) -> tuple[Controls, torch.Tensor]:
    """Per-env controls and denoise indices (B, K) from the switches, drawn on the device (no host sync).

    Denoise indices: j everywhere for non-joint SDE, 0..K-1 when every step is stochastic, -1 for ODE.
    """
    b = seeds.shape[0]
    steps = torch.arange(num_steps, device=seeds.device)
    j = rng.randint(seeds, counters, rng.STREAM_J, inp.j_high)
    j = torch.where(inp.shared_on > 0, j[:1].expand(b), j)
    one_hot = (steps[None, :] == j[:, None]).float()
    stochastic = inp.single_on * one_hot + inp.all_on * torch.ones_like(one_hot)
    inds = torch.where(inp.single_on > 0, j[:, None].expand(b, num_steps), steps[None, :].expand(b, num_steps))
    inds = torch.where((inp.single_on + inp.all_on) > 0, inds, torch.full_like(inds, -1))
    ctrl = Controls(
        stochastic=stochastic,
        sde_on=inp.sde_on,
        learned_std_on=inp.learned_std_on,
        row_weights=inp.row_weight.expand(num_steps),
        x0_weight=inp.x0_weight,
        crop=inp.crop,
        pool=inp.pool,
        noise_level=inp.noise_level,
    )
    return ctrl, inds


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(x; mean, std^2) in float32; exactly 0 where std == 0."""
    positive = std > 0
    safe = torch.where(positive, std, torch.ones_like(std))
    lp = -torch.log(safe) - _LOG_SQRT_2PI - 0.5 * ((x - mean) / safe) ** 2
    return torch.where(positive, lp, torch.zeros_like(lp))


def transition(
    x: torch.Tensor,
    v: torch.Tensor,
    t: torch.Tensor,
    delta: torch.Tensor,
    sigma: torch.Tensor,
    stochastic: torch.Tensor,
    sde_on: torch.Tensor,
    learned_std_on: torch.Tensor,
    learned_std: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std (B, H, D) of one denoise step; t, delta, sigma, stochastic broadcast as (B, 1, 1) or ()."""
    ode_mean = x - delta * v
    x1_hat = x + (1.0 - t) * v
    shrink = stochastic * sde_on * sigma**2 * delta / (2.0 * t)
    mean = ode_mean - shrink * x1_hat
    sde_std = torch.sqrt(delta) * sigma
    std = sde_on * sde_std
    if learned_std is not None:
        std = std + learned_std_on * learned_std
    return mean, stochastic * std * torch.ones_like(x)


@dataclass
class StepInputs:
    """One denoise step's table entries and switches, as the step math reads them (views; no copies).

    Attributes:
        t, delta, sigma: () t_i, Delta_i and sigma_i of the step tables.
        stochastic: (B,) the step's column of `Controls.stochastic`.
        sde_on, learned_std_on: () as in `Controls`.
        row_weight: () the step's log-prob row weight.
    """

    t: torch.Tensor
    delta: torch.Tensor
    sigma: torch.Tensor
    stochastic: torch.Tensor
    sde_on: torch.Tensor
    learned_std_on: torch.Tensor
    row_weight: torch.Tensor


def step_update(
    x: torch.Tensor, v: torch.Tensor, xi: torch.Tensor, step: StepInputs, learned_std: torch.Tensor | None,
    lp: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One Euler step (B, H, D): x_{i+1} = mean + std * xi and lp + w * log N(x_{i+1}; mean, std).

    The reference of `kernels.denoise_update`, which computes the same float32 operations in one kernel.
    """
    stochastic = step.stochastic[:, None, None]
    mean, std = transition(x, v, step.t, step.delta, step.sigma, stochastic, step.sde_on, step.learned_std_on,
                           learned_std)  # fmt: skip
    x_next = mean + std * xi
    return x_next, lp + step.row_weight * gaussian_log_prob(x_next, mean, std)


VelocityFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
"""(x (B, H, D) float32, step index i) -> (v (B, H, D) float32, expert output (B, H, We) float32)."""


@dataclass
class RolloutResult:
    """Outputs of `denoise` (full H x D; cropping to C x A is a slice of `log_prob_elements`)."""

    chain: torch.Tensor  # (B, K+1, H, D) float32
    log_prob_elements: torch.Tensor  # (B, H, D) float32, zero outside the crop
    suffix_values: torch.Tensor | None  # (B,) mean over steps of the critic on the pooled expert output


def denoise(
    velocity_fn: VelocityFn,
    x0: torch.Tensor,
    xi: torch.Tensor,
    tables: StepTables,
    ctrl: Controls,
    noise_head: Callable[[torch.Tensor], torch.Tensor] | None,
    suffix_value: Callable[[torch.Tensor], torch.Tensor] | None,
    fused_kernels: bool = False,
) -> RolloutResult:
    """Run K denoise steps from x_0 with per-step noise xi (B, K, H, D); unrolled (graph-friendly).

    `suffix_value` maps pooled expert features (B, We) to values (B,); the rollout value is their mean over
    the K steps (RLinf's definition). `fused_kernels`: each step's math (`step_update`) as the one Triton kernel
    `kernels.denoise_update` where it serves (CUDA float32, no autograd); it computes the same float32 operations.
    """
    k = tables.deltas.shape[0]
    sigmas = tables.sigmas(ctrl.noise_level)
    x = x0
    chain = [x0]
    lp = ctrl.x0_weight * gaussian_log_prob(x0, torch.zeros_like(x0), torch.ones_like(x0))
    values = None
    for i in range(k):
        v, suffix_out = velocity_fn(x, i)
        learned = noise_head(suffix_out) if noise_head is not None else None
        step = StepInputs(tables.times[i], tables.deltas[i], sigmas[i], ctrl.stochastic[:, i], ctrl.sde_on,
                          ctrl.learned_std_on, ctrl.row_weights[i])  # fmt: skip
        update = kernels.denoise_update if kernels.denoise_serves(fused_kernels, x, v, learned) else step_update
        x, lp = update(x, v, xi[:, i], step, learned, lp)
        chain.append(x)
        if suffix_value is not None:
            value = suffix_value((suffix_out * ctrl.pool[None, :, None]).sum(dim=1))
            values = value if values is None else values + value
    if values is not None:
        values = values / k
    return RolloutResult(torch.stack(chain, dim=1), lp * ctrl.crop, values)


def draw_noise(
    seeds: torch.Tensor, counters: torch.Tensor, num_steps: int, horizon: int, action_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x_0 (B, H, D) and per-step noise xi (B, K, H, D) from each env's counter-based stream (C3)."""
    x0 = rng.normal(seeds, counters, rng.STREAM_X0, (horizon, action_dim))
    xi = rng.normal(seeds, counters, rng.STREAM_XI, (num_steps, horizon, action_dim))
    return x0, xi
