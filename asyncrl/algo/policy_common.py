"""What every policy loss shares: the masked, clamped ratio helpers. Each loss's parameters
are its model in ``asyncrl.algo.params`` (the one definition of their names, defaults and
checks, torch-free); ``params_for("ppo", eps_clip_high=0.28)`` builds one.

Kept apart from the loss modules (``losses.py``, ``is_losses.py``) so that both can use it
and the registry in ``losses.py`` can import both without a cycle.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from asyncrl.algo.params import ClippedLoss

LOG_RATIO_CLAMP = 20.0

PolicyLossFn = Callable[..., "tuple[Tensor, dict[str, Tensor]]"]


def log_ratio(logp: Tensor, other_logp: Tensor, mask: Tensor) -> Tensor:
    """logp - other_logp on mask tokens, 0 elsewhere, clamped to +-LOG_RATIO_CLAMP."""
    # Zero padded positions first: garbage there must not turn into inf/NaN gradients.
    live = mask > 0
    diff = torch.where(live, logp - other_logp, torch.zeros_like(logp))
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over the mask's tokens (0 for an empty mask, never NaN): every loss and correction metric."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def clean(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask > 0, x, torch.zeros_like(x))


def clipped_surrogate(ratio: Tensor, adv: Tensor, mask: Tensor, params: ClippedLoss):
    """-min(r A, clip(r) A) and the effective upper/lower clip indicators."""
    low, high = 1.0 - params.eps_clip_low, 1.0 + params.eps_clip_high
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(low, high)
    loss = torch.maximum(unclipped, clipped)
    live = mask > 0
    # The clipped term wins (and has zero gradient) only in these two cases.
    clip_high = live & (adv > 0) & (ratio > high)
    clip_low = live & (adv < 0) & (ratio < low)
    return loss, clip_high, clip_low


def clip_metrics(clip_high: Tensor, clip_low: Tensor, mask: Tensor) -> dict[str, Tensor]:
    hi, lo = clip_high.to(mask.dtype), clip_low.to(mask.dtype)
    return {
        "clip_frac": masked_mean(hi + lo, mask),
        "clip_frac_high": masked_mean(hi, mask),
        "clip_frac_low": masked_mean(lo, mask),
    }
