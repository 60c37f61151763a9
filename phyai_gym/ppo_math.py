"""PPO's two formulas as functions: GAE over a (T, N) rollout and the clipped loss of one minibatch (cleanrl's).

`examples/ppo_disaggregated.py` computes GAE on its rollout ranks and the loss on its trainer ranks, so the math
lives here rather than inline in one loop.
"""

from __future__ import annotations

import torch


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    next_value: torch.Tensor,
    *,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), each (T, N), by the explicit backward GAE loop.

    Args:
        rewards: (T, N) rewards (truncations already bootstrapped: r + gamma * V(final obs)).
        values: (T, N) critic values of the observations acted on.
        dones: (T, N) 1.0 where the episode ended at that step.
        next_value: (N,) V(s_T) of the observation after the last step.
        gamma: discount per step.
        gae_lambda: GAE lambda.

    Example:
        >>> adv, ret = gae(torch.ones(2, 1), torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(1), gamma=1.0,
        ...                gae_lambda=1.0)
        >>> adv.flatten().tolist(), torch.equal(ret, adv)
        ([2.0, 1.0], True)
    """
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros_like(next_value)
    for t in reversed(range(num_steps)):
        next_values = next_value if t == num_steps - 1 else values[t + 1]
        not_done = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_values * not_done - values[t]
        advantages[t] = last_gae = delta + gamma * gae_lambda * not_done * last_gae
    return advantages, advantages + values


def ppo_loss(
    new_log_prob: torch.Tensor,
    new_values: torch.Tensor,
    entropy: torch.Tensor,
    old_log_prob: torch.Tensor,
    old_values: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    *,
    clip_coef: float,
    clip_vloss: bool = True,
    norm_adv: bool = True,
    ent_coef: float = 0.0,
    vf_coef: float = 0.5,
) -> dict[str, torch.Tensor]:
    """Clipped surrogate + (clipped) value loss - entropy bonus of one minibatch; all inputs (B,).

    Returns:
        "loss" (differentiable), and detached "pg_loss", "v_loss", "approx_kl" (joschu's k3), "clipfrac".

    Example:
        >>> lp, v = torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
        >>> out = ppo_loss(lp, v, torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.arange(4.0), torch.ones(4),
        ...                clip_coef=0.2)
        >>> out["approx_kl"].item(), out["clipfrac"].item(), out["v_loss"].item()
        (0.0, 0.0, 0.5)
    """
    log_ratio = new_log_prob - old_log_prob
    ratio = log_ratio.exp()
    if norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
    if clip_vloss:
        v_clipped = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
        v_loss = 0.5 * torch.max((new_values - returns) ** 2, (v_clipped - returns) ** 2).mean()
    else:
        v_loss = 0.5 * ((new_values - returns) ** 2).mean()
    loss = pg_loss - ent_coef * entropy.mean() + vf_coef * v_loss
    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).mean()  # http://joschu.net/blog/kl-approx.html
        clipfrac = ((ratio - 1.0).abs() > clip_coef).float().mean()
    return {"loss": loss, "pg_loss": pg_loss.detach(), "v_loss": v_loss.detach(), "approx_kl": approx_kl,
            "clipfrac": clipfrac}  # fmt: skip
