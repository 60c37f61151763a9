"""PI0.5's own training loss: conditional flow matching on action chunks (openpi `Pi0.compute_loss`, LeRobot PI05).

For a demonstrated chunk a (B, H, D) in model space, noise eps ~ N(0, I) and a time t ~ Beta(1.5, 1) * 0.999 + 0.001
per sample (t = 1 is noise, t = 0 is data)::

    x_t = t * eps + (1 - t) * a          the noisy chunk
    u_t = eps - a                        the target velocity
    loss = mean over valid (h, d) of (v_theta(x_t, t | observation) - u_t) ** 2

The expert attends to the prefix K/V of the observation (computed once per batch; differentiable only when the prefix
is trained) exactly as at inference, where `x <- x - dt * v` integrates from t = 1 to 0. Like LeRobot, the error is
averaged over the dataset's action dims only (the padded model dims carry no data) and over the chunk steps that
exist (`action_mask`: a chunk cut by the episode's end is padded and masked).
"""

from __future__ import annotations

import torch

from .inputs import ModelInputs
from .model import Pi05Model
from .rollout import run_prefix_stage

TIME_BETA_ALPHA = 1.5
"""openpi's time distribution Beta(1.5, 1): for beta = 1 its inverse CDF is u ** (1 / alpha), so t needs only a
uniform draw (and a `torch.Generator`)."""


def sample_time(
    batch: int, generator: torch.Generator | None = None, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """(B,) float32 flow times t = Beta(1.5, 1) * 0.999 + 0.001 (openpi `sample_beta`).

    Example:
        >>> t = sample_time(1000, torch.Generator().manual_seed(0))
        >>> bool(t.min() >= 0.001 and t.max() <= 1.0), round(float(t.mean()), 1)  # E[Beta(1.5, 1)] = 0.6
        (True, 0.6)
    """
    u = torch.rand(batch, generator=generator, dtype=torch.float32).to(device)
    return u ** (1.0 / TIME_BETA_ALPHA) * 0.999 + 0.001


def flow_matching_loss(
    model: Pi05Model,
    inputs: ModelInputs,
    actions: torch.Tensor,
    action_mask: torch.Tensor,
    noise: torch.Tensor,
    time: torch.Tensor,
    action_dim: int,
    train_prefix: bool = False,
) -> torch.Tensor:
    """(B,) per-sample flow-matching loss, differentiable w.r.t. the expert (and the prefix with `train_prefix`).

    Args:
        model: the PI0.5 model.
        inputs: the processed observations (`Pi05Processor.__call__`).
        actions: (B, H, D) float32 demonstrated chunks in model space (normalised, zero-padded to D).
        action_mask: (B, H) bool, False for chunk steps past the episode's end.
        noise: (B, H, D) float32 eps.
        time: (B,) float32 t in (0, 1] (`sample_time`).
        action_dim: A, the dataset's action dims (the error is averaged over [:A]).
        train_prefix: differentiate through the vision tower and the LM (``--trainable all``).
    """
    b, h, _ = actions.shape
    with torch.set_grad_enabled(train_prefix and torch.is_grad_enabled()):
        cache = run_prefix_stage(model, inputs.images, inputs.image_mask, inputs.tokens, inputs.lengths)
    t = time.to(actions.dtype)[:, None, None]
    x_t = t * noise + (1.0 - t) * actions  # (B, H, D)
    u_t = noise - actions
    cond = model.time_condition(time)  # (B, We)
    table = model.modulation_table(cond).to(model.compute_dtype)  # (n_norms, B, 3We)
    mods = [tuple(m[:, None].chunk(3, dim=-1)) for m in table]  # (B, 1, We) x 3 per norm
    out = model.expert_step(cache, x_t, mods)  # (B, H, We) float32
    v_t = model.velocity(out).to(actions.dtype)  # (B, H, D)
    err = (v_t - u_t)[:, :, :action_dim].pow(2).mean(dim=2)  # (B, H)
    mask = action_mask.to(err.dtype)
    return (err * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
