"""A custom policy loss, found by import path.

    PYTHONPATH=. asyncrl train configs/demo.yaml algo.policy_loss=examples.custom_loss:tanh_ratio_pg
    PYTHONPATH=. asyncrl train configs/demo.yaml \
        "algo.policy_loss={type: 'examples.custom_loss:tanh_ratio_pg', kwargs: {eps: 0.3}}"

or in YAML:  policy_loss: {type: examples.custom_loss:tanh_ratio_pg, kwargs: {eps: 0.3}}

A policy loss is a plain function over [B, T] tensors returning (per-token loss, metrics).
Its settings arrive as ``params.kwargs`` (algo.policy_loss.kwargs). It never sees the
off-policy correction: asyncrl multiplies the per-token loss by the TIS weights and masks
(algo.correction) for every loss, built-in or not, and weights tokens by the mini-batch's
reduction weights, so the gradient does not depend on micro-batching.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.config import CustomLoss


def tanh_ratio_pg(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, params: CustomLoss):
    """A soft trust region: loss_t = -A_t * (1 + eps * tanh((r_t - 1) / eps)), r_t = exp(logp_t - old_t).

    Near r = 1 it is the policy gradient; far from it the push saturates smoothly instead of
    being cut off as in PPO (eps = kwargs.eps, default 0.2).
    """
    live = mask > 0
    log_ratio = torch.where(live, logp - old_logp, torch.zeros_like(logp)).clamp(-20, 20)
    ratio = torch.exp(log_ratio)
    eps = float(params.kwargs.get("eps", 0.2))
    adv = torch.where(live, adv, torch.zeros_like(adv))
    loss = -adv * (1 + eps * torch.tanh((ratio - 1) / eps))
    n = mask.sum().clamp(min=1)
    return loss * mask, {"ratio_mean": (ratio.detach() * mask).sum() / n}
