"""The critic's math: value targets, the clipped value loss, whitening and explained variance.

    adv = gae(zeros, gids, mask, params=AdvantageParams(gamma=g, lam=l), token_rewards=r, values=v)
    ret = gae_returns(adv, v, mask)                                  # the value targets
    per_token, clipped = clipped_value_loss(v_new, v_old, ret, mask, clip=0.2)
    adv = whiten(adv, mask, moments(adv, mask))                      # moments summed over ranks first

Sources: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
Advantage Estimation" (arXiv:1506.02438), eq. 16 for GAE and the return R_t = A_t + V_t it
regresses the value function on; Schulman et al. 2017, "Proximal Policy Optimization
Algorithms" (arXiv:1707.06347), eq. 9 for the combined objective with c1 * L^VF; the value
clipping of OpenAI baselines' ppo2 (``vpredclipped = OLDVPRED + clip(vpred - OLDVPRED, -eps,
eps)``, ``0.5 * mean(max(vf_losses1, vf_losses2))``). Formulas: docs/design/critic.md.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _live(mask: Tensor) -> Tensor:
    return mask > 0


def gae_returns(advantages: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """R_t = A_t + V_t on the mask (the lambda-return the critic regresses on), 0 elsewhere."""
    live = _live(mask)
    ret = advantages.to(torch.float64) + values.to(torch.float64)
    return torch.where(live, ret, torch.zeros_like(ret))


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, -eps, eps)
    (PPO2's value clipping; ``clip=None``: 0.5 * (V - R)^2). Returns (loss [N, T], clipped [N, T]
    bool: the clipped term is the larger one, i.e. clipping held the gradient back); both 0 / False
    off the mask. Differentiable in ``values`` only."""
    live = _live(mask)
    old, ret = old_values.detach().to(values.dtype), returns.detach().to(values.dtype)
    unclipped = (values - ret) ** 2
    if clip is None:
        loss, clipped = unclipped, torch.zeros_like(live)
    else:
        v_clip = old + torch.clamp(values - old, -clip, clip)
        clipped_sq = (v_clip - ret) ** 2
        loss = torch.maximum(unclipped, clipped_sq)
        clipped = live & (clipped_sq > unclipped)
    return torch.where(live, 0.5 * loss, torch.zeros_like(loss)), clipped


def moments(x: Tensor, mask: Tensor) -> Tensor:
    """[3] float64 (sum, sum of squares, count) of x over the mask: summable across ranks
    (an all-reduce), from which whiten and explained_variance take mean and variance."""
    live = _live(mask)
    v = torch.where(live, x.to(torch.float64), torch.zeros_like(x, dtype=torch.float64))
    return torch.stack([v.sum(), (v * v).sum(), live.sum().to(torch.float64)])


def _mean_var(m: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and the sample (n - 1) variance from moments; 0 variance for fewer than 2 values."""
    total, sq, n = m[0], m[1], m[2]
    mean = total / n.clamp(min=1.0)
    var = (sq - n * mean * mean).clamp(min=0.0) / (n - 1).clamp(min=1.0)
    return mean, var


def whiten(x: Tensor, mask: Tensor, stats: Tensor, *, eps: float = 1e-8) -> Tensor:
    """(x - mean) / (std + eps) on the mask, 0 elsewhere, with mean and std from ``stats``
    (``moments`` of x over the whole batch: every rank's, summed)."""
    mean, var = _mean_var(stats)
    out = (x.to(torch.float64) - mean) / (var.sqrt() + eps)
    return torch.where(_live(mask), out, torch.zeros_like(out)).to(x.dtype)


def explained_variance(returns_stats: Tensor, residual_stats: Tensor) -> float:
    """1 - Var(R - V) / Var(R) from their moments: 1 a perfect critic, 0 one no better than the
    mean return, negative a worse one. 0 when the returns do not vary (nothing to explain)."""
    _, var_r = _mean_var(returns_stats)
    _, var_res = _mean_var(residual_stats)
    if float(var_r) <= 0.0:
        return 0.0
    return float(1.0 - var_res / var_r)
