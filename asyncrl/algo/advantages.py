"""Advantage estimators: rewards (+ group ids) in, per-token advantages [N, T] out.

    est = get_advantage_estimator("grpo")                 # or "my_pkg.adv:my_estimator"
    adv = est(rewards, group_ids, response_mask, params=AdvantageParams(norm_std=True))

An estimator is ``fn(rewards [N], group_ids [N] (long), mask [N, T], *, params,
token_rewards=None, values=None) -> [N, T]``; the result is 0 wherever ``mask`` is 0.
Samples of one prompt share a group id. Outcome estimators compute one scalar per sample
and broadcast it over the sample's mask; with mean m_g and std s_g of the rewards of
sample i's group g (n_g samples):

    grpo          (r_i - m_g) / (s_g + eps)      or r_i - m_g with norm_std=False   Shao et al. 2024 (DeepSeekMath)
    dr_grpo       r_i - m_g                                                         Liu et al. 2025 (Dr. GRPO)
    rloo          r_i - mean_{j != i} r_j = n_g/(n_g - 1) (r_i - m_g)               Ahmadian et al. 2024
    maxrl         (r_i - m_g) / (m_g + eps) = r_i/m_g - 1 (0 if m_g <= 0)           arXiv:2602.02710 (MaxRL)
    reinforce_pp  per-token discounted returns, normalised over the whole batch     arXiv:2501.03262 (REINFORCE++)
    gae           generalised advantage estimation from a value estimate            arXiv:1506.02438 (GAE)

A group of one sample has no baseline: its outcome advantage is 0. s_g is the sample
(n - 1) standard deviation. Token-level estimators use ``token_rewards`` when given, else
the outcome reward placed on the sample's last mask token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.algo.losses import lookup

AdvantageFn = Callable[..., Tensor]


@dataclass(frozen=True)
class AdvantageParams:
    """The scalars estimators need (mirrors ``asyncrl.config.AlgoConfig``)."""

    norm_std: bool = True
    """grpo: divide by the group std."""
    gamma: float = 1.0
    lam: float = 1.0
    eps: float = 1e-6


def _group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group mean, sample std (0 for groups of one) and group size."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN/inf: exclude failed samples before computing advantages")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.to(torch.float64)
    count = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros_like(count).index_add_(0, inverse, r)
    mean = (total / count)[inverse]
    sq = torch.zeros_like(count).index_add_(0, inverse, (r - mean) ** 2)
    var = sq / (count - 1).clamp(min=1.0)
    return mean, var.sqrt()[inverse], count[inverse]


def _broadcast(score: Tensor, mask: Tensor) -> Tensor:
    mask = mask.to(torch.float32) if not mask.is_floating_point() else mask
    return score.to(mask.dtype).unsqueeze(1) * (mask > 0).to(mask.dtype)


def grpo(rewards, group_ids, mask, *, params: AdvantageParams, token_rewards=None, values=None) -> Tensor:
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps), or r_i - mean_g when params.norm_std is False.

    Source: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300).
    """
    mean, std, count = _group_stats(rewards, group_ids)
    score = rewards.to(mean.dtype) - mean
    if params.norm_std:
        score = score / (std + params.eps)
    return _broadcast(torch.where(count > 1, score, torch.zeros_like(score)), mask)


def dr_grpo(rewards, group_ids, mask, *, params: AdvantageParams, token_rewards=None, values=None) -> Tensor:
    """Dr. GRPO: A_i = r_i - mean_g (no std division, which biases toward easy/hard prompts).

    Pair it with loss_reduction='seq_mean_token_sum_norm' to also drop the length bias.
    Source: Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv:2503.20783).
    """
    mean, _, count = _group_stats(rewards, group_ids)
    score = rewards.to(mean.dtype) - mean
    return _broadcast(torch.where(count > 1, score, torch.zeros_like(score)), mask)


def rloo(rewards, group_ids, mask, *, params: AdvantageParams, token_rewards=None, values=None) -> Tensor:
    """RLOO: A_i = r_i - (sum_g r - r_i) / (n_g - 1), the leave-one-out baseline.

    Source: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization"
    (arXiv:2402.14740); Kool et al. 2019.
    """
    mean, _, count = _group_stats(rewards, group_ids)
    score = (rewards.to(mean.dtype) - mean) * count / (count - 1).clamp(min=1.0)
    return _broadcast(torch.where(count > 1, score, torch.zeros_like(score)), mask)


def maxrl(rewards, group_ids, mask, *, params: AdvantageParams, token_rewards=None, values=None) -> Tensor:
    """MaxRL: A_i = (r_i - mean_g) / (mean_g + eps), i.e. r_i / mean_g - 1; 0 when mean_g <= 0.

    Dividing by the group's success rate instead of its std turns the RL gradient (of the
    pass rate p) into the maximum-likelihood gradient (of log p), which up-weights hard
    prompts by 1/p. Meant for rewards >= 0 (binary correctness): a group whose mean is <= 0
    is not a success rate, and dividing by it would flip or blow up the sign, so it gets 0
    (the config warns at start-up when the environment's rewards can be negative).
    Source: Tajwar et al. 2026, "Maximum Likelihood Reinforcement Learning" (arXiv:2602.02710).
    """
    mean, _, count = _group_stats(rewards, group_ids)
    score = (rewards.to(mean.dtype) - mean) / (mean + params.eps)
    keep = (count > 1) & (mean > 0)
    return _broadcast(torch.where(keep, score, torch.zeros_like(score)), mask)


def _token_reward_matrix(rewards: Tensor, mask: Tensor, token_rewards: Tensor | None) -> Tensor:
    """[N, T] per-token rewards: token_rewards, or the outcome on each sample's last mask token."""
    live = (mask > 0).to(torch.float64)
    if token_rewards is not None:
        if token_rewards.shape != mask.shape:
            raise ValueError(f"token_rewards must be {tuple(mask.shape)}, got {tuple(token_rewards.shape)}")
        return token_rewards.to(torch.float64) * live
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(live)
    last = torch.where(live > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros_like(live)
    has = last >= 0
    out[has.nonzero().squeeze(1), last[has]] = rewards.to(torch.float64)[has]
    return out


def _discounted_returns(token_r: Tensor, live: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_next, where 'next' is the next mask token (gaps are skipped)."""
    returns = torch.zeros_like(token_r)
    running = torch.zeros(token_r.shape[0], dtype=token_r.dtype, device=token_r.device)
    for t in range(token_r.shape[1] - 1, -1, -1):
        running = torch.where(live[:, t], token_r[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns


def reinforce_pp(rewards, group_ids, mask, *, params: AdvantageParams, token_rewards=None, values=None) -> Tensor:
    """REINFORCE++: per-token returns G_t = sum_{k >= t} gamma^(k-t) r_k, then normalised over
    all mask tokens of the batch (global, not per group): A_t = (G_t - mean G) / (std G + eps).

    Source: Hu 2025, "REINFORCE++" (arXiv:2501.03262). group_ids are unused.
    """
    live = mask > 0
    returns = _discounted_returns(_token_reward_matrix(rewards, mask, token_rewards), live, params.gamma)
    n = live.sum().clamp(min=1)
    mean = returns[live].sum() / n
    var = ((returns - mean) ** 2 * live).sum() / (n - 1).clamp(min=1)
    adv = (returns - mean) / (var.sqrt() + params.eps)
    dtype = mask.dtype if mask.is_floating_point() else torch.float32
    return torch.where(live, adv, torch.zeros_like(adv)).to(dtype)


def gae(rewards, group_ids, mask, *, params: AdvantageParams, token_rewards=None, values=None) -> Tensor:
    """GAE: delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next (next = next
    mask token; V after the last token is 0). Not whitened. ``values`` [N, T] is required.

    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE" (arXiv:1506.02438).
    """
    if values is None:
        raise ValueError("gae needs values [N, T] from a value model (critic)")
    if values.shape != mask.shape:
        raise ValueError(f"values must be {tuple(mask.shape)}, got {tuple(values.shape)}")
    live = mask > 0
    token_r = _token_reward_matrix(rewards, mask, token_rewards)
    v = torch.where(live, values.to(torch.float64), torch.zeros_like(token_r))
    adv = torch.zeros_like(token_r)
    next_v = torch.zeros(token_r.shape[0], dtype=token_r.dtype, device=token_r.device)
    next_a = torch.zeros_like(next_v)
    for t in range(token_r.shape[1] - 1, -1, -1):
        delta = token_r[:, t] + params.gamma * next_v - v[:, t]
        a = delta + params.gamma * params.lam * next_a
        next_a = torch.where(live[:, t], a, next_a)
        next_v = torch.where(live[:, t], v[:, t], next_v)
        adv[:, t] = torch.where(live[:, t], a, torch.zeros_like(a))
    dtype = mask.dtype if mask.is_floating_point() else torch.float32
    return adv.to(dtype)


ADVANTAGE_REGISTRY: dict[str, AdvantageFn] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "gae": gae,
    "maxrl": maxrl,
}


def get_advantage_estimator(name_or_path: str) -> AdvantageFn:
    """A built-in estimator by name, or a user's by import path 'package.module:function'."""
    return lookup(ADVANTAGE_REGISTRY, name_or_path, "advantage estimator")
