"""Importance-weighted policy gradients without the PPO clip: importance_sampling, rollout_is, dppo.

Same contract as ``asyncrl.algo.losses`` (``fn(logp, old_logp, adv, mask, *, params) ->
(loss [B, T], metrics)``); ``rollout_is`` and ``dppo`` also take ``rollout_logp``, the
behaviour policy's log-probs, which ``corrected_policy_loss`` passes to any loss that
declares that keyword.

    importance_sampling  -exp(logp - old) A                          Tinker's importance_sampling loss
    rollout_is           -sg(w) A logp,  w = r if 1-eps_low < r < 1+eps_high else 0,
                         r = exp(logp - rollout)                     calibrated IS on the behaviour policy
    dppo                 -r A keep,  r = exp(logp - mu), keep from p - q    Divergence PPO, arXiv:2602.04879
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.algo.params import DppoLoss, ImportanceSamplingLoss, RolloutIsLoss
from asyncrl.algo.policy_common import clean, log_ratio, masked_mean

# 1 - p for a token the policy is certain of is 0; its log would be -inf.
_ONE_MINUS_FLOOR = 1e-12


def importance_sampling(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, params: ImportanceSamplingLoss):
    """Plain importance-weighted policy gradient, no clip: loss_t = -exp(logp_t - old_t) A_t.

    Gradient -r_t A_t dlogp_t on every token, however far r_t has moved: use it where the
    policy cannot drift far (one step per batch) or with a trust region elsewhere
    (``algo.rollout_kl_coef``). Source: Tinker's ``importance_sampling`` loss
    (tinker-docs.thinkingmachines.ai/losses), as SkyRL ships it.
    """
    mask = mask.to(logp.dtype)
    adv = clean(adv, mask)
    ratio = torch.exp(log_ratio(logp, old_logp, mask))
    return -ratio * adv, {"ratio_mean": masked_mean(ratio.detach(), mask)}


def rollout_is(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    params: RolloutIsLoss,
    rollout_logp: Tensor | None = None,
):
    """Calibrated importance sampling against the behaviour (rollout) policy.

    r_t = exp(logp_t - rollout_t); w_t = r_t if 1 - eps_clip_low < r_t < 1 + eps_clip_high
    (open interval) else 0, held constant; loss_t = -w_t A_t logp_t, so the gradient is
    -w_t A_t dlogp_t: the CISPO-style gradient anchored on the engine's policy, with tokens
    outside the band dropped instead of capped. Needs no proximal (old) log-probs.
    Source: SkyRL's ``rollout_is`` policy loss (the CISPO gradient, arXiv:2506.13585, on
    rollout log-probs).
    """
    if rollout_logp is None:
        raise ValueError("policy loss 'rollout_is' needs rollout_logprobs (the behaviour policy's log-probs)")
    mask = mask.to(logp.dtype)
    adv = clean(adv, mask)
    ratio = torch.exp(log_ratio(logp, rollout_logp, mask)).detach()
    in_band = (ratio > 1.0 - params.eps_clip_low) & (ratio < 1.0 + params.eps_clip_high)
    weight = torch.where(in_band, ratio, torch.zeros_like(ratio))
    loss = -weight * adv * clean(logp, mask)
    dropped = ~in_band & (mask > 0) & (adv != 0)
    return loss, {"clip_frac": masked_mean(dropped.to(mask.dtype), mask), "ratio_mean": masked_mean(ratio, mask)}


def _binary_kl(q: Tensor, p: Tensor, logq: Tensor, logp: Tensor) -> Tensor:
    """KL(Bernoulli(q) || Bernoulli(p)): the sampled token against all the others."""
    rest_q = (1.0 - q).clamp(min=_ONE_MINUS_FLOOR)
    rest_p = (1.0 - p).clamp(min=_ONE_MINUS_FLOOR)
    return q * (logq - logp) + rest_q * (torch.log(rest_q) - torch.log(rest_p))


def dppo(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    params: DppoLoss,
    rollout_logp: Tensor | None = None,
):
    """DPPO: a divergence trust region on the sampled token's probability instead of a ratio clip.

    mu = rollout log-probs when given, else old; r_t = exp(logp_t - mu_t), p = exp(logp_t),
    q = exp(mu_t). keep_t = 0 (no gradient) when the update moves p away from q past a bound
    in the direction the advantage pushes, else 1:
      binary_tv  A > 0 and p - q > delta_high,  or  A < 0 and q - p > delta_low
      binary_kl  A > 0 and p > q and KL_b > delta_high,  or  A < 0 and p < q and KL_b > delta_low,
                 KL_b = q log(q/p) + (1-q) log((1-q)/(1-p))
    Bounds are strict (a divergence equal to delta keeps the token); a zero-advantage token
    is never masked. loss_t = -r_t A_t keep_t.
    Source: "Divergence Proximal Policy Optimization" (arXiv:2602.04879), eqs. 13-14.
    """
    mask = mask.to(logp.dtype)
    adv = clean(adv, mask)
    behaviour = rollout_logp if rollout_logp is not None else old_logp
    ratio = torch.exp(log_ratio(logp, behaviour, mask))
    with torch.no_grad():
        lp, lq = clean(logp.detach(), mask).clamp(max=0.0), clean(behaviour, mask).clamp(max=0.0)
        p, q = torch.exp(lp), torch.exp(lq)
        diff = p - q
        if params.dppo_mask == "binary_tv":
            drop = ((adv > 0) & (diff > params.dppo_delta_high)) | ((adv < 0) & (-diff > params.dppo_delta_low))
        else:
            kl = _binary_kl(q, p, lq, lp)
            drop = ((adv > 0) & (diff > 0) & (kl > params.dppo_delta_high)) | (
                (adv < 0) & (diff < 0) & (kl > params.dppo_delta_low)
            )
        drop = drop & (mask > 0)
    loss = torch.where(drop, torch.zeros_like(ratio), -ratio * adv)
    return loss, {"clip_frac": masked_mean(drop.to(mask.dtype), mask), "ratio_mean": masked_mean(ratio.detach(), mask)}
