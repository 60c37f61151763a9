"""PPO's formulas as functions: GAE over a (T, N) rollout, the log-ratio at a chosen granularity, the clipped loss.

Both PPO examples use them (`examples/ppo_disaggregated.py` computes GAE on its rollout ranks and the loss on its
trainer ranks), so the math is written once.

Log-prob granularity (RLinf's ``logprob_type``; docs/rl.md works through the numbers). A PI0.5 sample's log-prob
is a sum over C x A Gaussian elements (C executed actions of A dims; each element itself the mean over the K+1
denoise rows of the joint chain). PPO's ratio can be taken over the whole sum, or per part, each part clipped on
its own and the surrogate averaged over the parts (the sample's advantage shared by all of them):

  ``sum``     one ratio per sample, exp(sum of the C x A element log-ratios): the chunk's likelihood ratio
              (RLinf ``chunk_level``, every PI0.5 config there). Its approx-KL is the KL of the whole chunk, about
              C x A times the per-element one, and the +-clip trust region is shared by all C x A elements.
  ``action``  one ratio per executed action c (sum over A): C ratios per sample (RLinf ``action_level``).
  ``element`` one ratio per element: C x A ratios per sample (RLinf ``token_level``, its PI0 ManiSkill config; what
              LLM PPO does per token).
  ``mean``    one ratio per sample from the MEAN element log-ratio (a geometric-mean ratio, GSPO's sequence
              ratio): element changes of opposite sign cancel, so it is the loosest constraint of the four.
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


LOGPROB_REDUCTIONS: tuple[str, ...] = ("sum", "action", "element", "mean")
"""The log-ratio granularities `log_ratio` knows (module docstring)."""


def group_advantages(outcomes: torch.Tensor, first_episode: torch.Tensor, group_size: int) -> torch.Tensor:
    """(T, N) group-relative advantages (GRPO's, in place of GAE's): no critic, a per-state baseline instead.

    The N envs form N / `group_size` groups of consecutive envs that started the rollout from one reset state. Each
    env's first-episode outcome is centred on its group's mean and divided by the group's standard deviation; that
    episode's chunks share the result equally (each takes it over the episode's length in chunks) and chunks after
    it take 0. So every group's advantages sum to 0 over its chunks, however long its episodes: without the sharing,
    failed episodes (all T chunks) outweigh successful ones (ended early) and the mean advantage is negative, an
    update that also pushes down the likelihood of whatever was sampled (docs/rl.md). A group whose envs all ended
    alike gives 0: no gradient, where a critic that cannot tell states apart would give each of its samples the
    critic's error.

    Args:
        outcomes: (N,) each env's first-episode return (with a sparse success reward: 1 or 0).
        first_episode: (T, N) 1.0 where the chunk acted in its env's first episode of the rollout (at least its
            first chunk).
        group_size: G, envs per group (N a multiple of it).

    Example:
        >>> first = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]])  # env 0's episode: one chunk
        >>> adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), first, 2)
        >>> [[round(a, 3) for a in row] for row in adv.tolist()]
        [[0.707, -0.354, 0.0, 0.0], [0.0, -0.354, 0.0, 0.0]]
    """
    groups = outcomes.reshape(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    scaled = centred / (groups.std(dim=1, keepdim=True) + 1e-6)  # all alike: 0 / eps = 0
    return first_episode * (scaled.reshape(-1) / first_episode.sum(dim=0))


def log_ratio(new_elements: torch.Tensor, old_elements: torch.Tensor, reduction: str) -> torch.Tensor:
    """(B, G) log-ratios of B samples at the granularity `reduction`, from (B, C, A) element log-probs.

    G is 1 (``sum``, ``mean``), C (``action``) or C x A (``element``).

    Example:
        >>> new, old = torch.tensor([[[0.1, 0.3], [0.2, -0.2]]]), torch.zeros(1, 2, 2)
        >>> [log_ratio(new, old, r).shape[1] for r in LOGPROB_REDUCTIONS]
        [1, 2, 4, 1]
        >>> round(log_ratio(new, old, "sum").item(), 4), round(log_ratio(new, old, "mean").item(), 4)
        (0.4, 0.1)
    """
    if new_elements.dim() != 3 or new_elements.shape != old_elements.shape:
        raise ValueError(
            f"log_ratio: expected new and old element log-probs of one (B, C, A) shape, got "
            f"{tuple(new_elements.shape)} and {tuple(old_elements.shape)}. Fix: pass EvalOutput.log_prob_elements "
            "and the rollout's PolicyOutput.log_prob_elements."
        )
    d = new_elements - old_elements  # (B, C, A)
    if reduction == "sum":
        return d.sum(dim=(1, 2))[:, None]
    if reduction == "mean":
        return d.mean(dim=(1, 2))[:, None]
    if reduction == "action":
        return d.sum(dim=2)
    if reduction == "element":
        return d.flatten(1)
    raise ValueError(
        f"log_ratio: reduction must be one of {LOGPROB_REDUCTIONS}, got {reduction!r}. Fix: pass e.g. 'element'."
    )


def ratio_stats(log_ratio: torch.Tensor, clip_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(approx-KL, clip fraction) of a minibatch's log-ratios, (B,) or (B, G), as detached means (no host sync).

    The approx-KL is joschu's k3 estimator, mean of (r - 1) - log r; the clip fraction is the share of ratios r
    outside [1 - clip_coef, 1 + clip_coef].

    Example:
        >>> kl, frac = ratio_stats(torch.tensor([0.0, 0.5]), clip_coef=0.2)
        >>> round(kl.item(), 4), frac.item()
        (0.0744, 0.5)
    """
    with torch.no_grad():
        ratio = log_ratio.exp()
        approx_kl = ((ratio - 1) - log_ratio).mean()  # http://joschu.net/blog/kl-approx.html
        clipfrac = ((ratio - 1.0).abs() > clip_coef).float().mean()
    return approx_kl, clipfrac


def clipped_losses(
    log_ratio: torch.Tensor,
    new_values: torch.Tensor,
    old_values: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    *,
    clip_coef: float,
    clip_vloss: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(clipped surrogate loss, value loss) of one minibatch, both differentiable.

    Args:
        log_ratio: (B,) or (B, G) log pi_new - log pi_old; each of a sample's G ratios is clipped with its advantage.
        new_values: (B,) the critic now.
        old_values: (B,) the critic at rollout time (the value clip is centred on it).
        advantages: (B,) advantages, already normalised if they are to be.
        returns: (B,) value targets.
        clip_coef: the ratio clip (1 +- clip_coef) and the value clip (+- clip_coef).
        clip_vloss: clip the value loss around `old_values`.

    Example:
        >>> pg, v = clipped_losses(torch.zeros(2), torch.ones(2), torch.zeros(2), torch.ones(2), torch.zeros(2),
        ...                        clip_coef=0.2)
        >>> pg.item(), v.item()
        (-1.0, 0.5)
    """
    ratio = log_ratio.exp()
    if ratio.dim() == 2:  # G ratios per sample share its advantage
        advantages = advantages[:, None]
    pg_loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
    if clip_vloss:
        v_clipped = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
        v_loss = 0.5 * torch.max((new_values - returns) ** 2, (v_clipped - returns) ** 2).mean()
    else:
        v_loss = 0.5 * ((new_values - returns) ** 2).mean()
    return pg_loss, v_loss


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

    The log-probs may also be (B, G), G ratios per sample (`log_ratio`'s granularities): each is clipped on its
    own with the sample's advantage, and the surrogate, approx-KL and clip fraction are means over all B x G.

    Returns:
        "loss" (differentiable), and detached "pg_loss", "v_loss", "approx_kl" (joschu's k3), "clipfrac".

    Example:
        >>> lp, v = torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
        >>> out = ppo_loss(lp, v, torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.arange(4.0), torch.ones(4),
        ...                clip_coef=0.2)
        >>> out["approx_kl"].item(), out["clipfrac"].item(), out["v_loss"].item()
        (0.0, 0.0, 0.5)
    """
    log_r = new_log_prob - old_log_prob
    if norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss, v_loss = clipped_losses(log_r, new_values, old_values, advantages, returns, clip_coef=clip_coef,
                                     clip_vloss=clip_vloss)  # fmt: skip
    loss = pg_loss - ent_coef * entropy.mean() + vf_coef * v_loss
    approx_kl, clipfrac = ratio_stats(log_r.detach(), clip_coef)
    return {"loss": loss, "pg_loss": pg_loss.detach(), "v_loss": v_loss.detach(), "approx_kl": approx_kl,
            "clipfrac": clipfrac}  # fmt: skip


class RewardNormalizer:
    """Rewards divided by the running std of the discounted return: Gymnasium's `NormalizeReward` on (N,) tensors.

    PPO's value clipping moves a value at most ``clip_coef`` from the rollout's per iteration, so returns of tens
    (a dense MuJoCo reward summed over a chunk) take hundreds of iterations to fit and the explained variance stays
    near 0; cleanrl's continuous PPO normalises rewards for this reason. The state (the per-env discounted returns
    and the running moments) is plain floats, `state_dict()`, for a checkpoint.

    Example:
        >>> norm = RewardNormalizer(2, gamma=0.99)
        >>> r = norm(torch.tensor([10.0, -10.0]), torch.zeros(2))
        >>> bool(r.abs().max() < 10.0), norm.count > 1
        (True, True)
    """

    def __init__(self, num_envs: int, gamma: float, epsilon: float = 1e-8, device: str | torch.device = "cpu") -> None:
        self.gamma, self.epsilon = gamma, epsilon
        self.returns = torch.zeros(num_envs, dtype=torch.float64, device=device)
        # running moments of the discounted returns, on the device (no host sync per step)
        self.mean, self.var = torch.zeros((), dtype=torch.float64, device=device), torch.ones_like(self.returns[0])
        self.count = 1e-4

    def __call__(self, reward: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """The scaled (N,) rewards of one step; `done` (N,) 1.0 where the episode ended in it (its return restarts)."""
        self.returns = self.returns * self.gamma + reward.double()
        n = self.returns.numel()
        batch_mean, batch_var = self.returns.mean(), self.returns.var(unbiased=False)
        delta, total = batch_mean - self.mean, self.count + n  # Chan's parallel update (Gymnasium's RunningMeanStd)
        m2 = self.var * self.count + batch_var * n + delta * delta * self.count * n / total
        self.mean, self.var, self.count = self.mean + delta * n / total, m2 / total, total
        self.returns = self.returns * (1.0 - done.double())  # the next step starts a new episode's return
        return (reward.double() / (self.var + self.epsilon).sqrt()).to(reward.dtype)

    def state_dict(self) -> dict:
        """Plain-float state (JSON-able)."""
        return {"returns": self.returns.tolist(), "mean": float(self.mean), "var": float(self.var), "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""
        like = dict(dtype=torch.float64, device=self.returns.device)
        self.returns = torch.tensor(state["returns"], **like)
        self.mean, self.var = torch.tensor(state["mean"], **like), torch.tensor(state["var"], **like)
        self.count = state["count"]
