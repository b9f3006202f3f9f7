"""What every policy loss shares: its parameters and the masked, clamped ratio helpers.

Kept apart from the loss modules (``losses.py``, ``is_losses.py``) so that both can use it
and the registry in ``losses.py`` can import both without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0

PolicyLossFn = Callable[..., "tuple[Tensor, dict[str, Tensor]]"]

CISPO_ANCHORS = ("old", "rollout")
DPPO_MASKS = ("binary_tv", "binary_kl")


@dataclass(frozen=True)
class PolicyLossParams:
    """The scalars policy losses need (mirrors the fields of ``asyncrl.config.AlgoConfig``)."""

    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    dual_clip_c: float = 3.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    cispo_eps_high: float = 5.0
    cispo_anchor: str = "old"
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-3
    kl_cov_coef: float = 1.0
    dppo_mask: str = "binary_tv"
    dppo_delta_low: float = 0.2
    dppo_delta_high: float = 0.2

    def __post_init__(self) -> None:
        # A typo here would otherwise fall through to a default branch and train silently.
        if self.cispo_anchor not in CISPO_ANCHORS:
            raise ValueError(f"cispo_anchor={self.cispo_anchor!r}: must be one of {', '.join(CISPO_ANCHORS)}")
        if self.dppo_mask not in DPPO_MASKS:
            raise ValueError(f"dppo_mask={self.dppo_mask!r}: must be one of {', '.join(DPPO_MASKS)}")


def log_ratio(logp: Tensor, other_logp: Tensor, mask: Tensor) -> Tensor:
    """logp - other_logp on mask tokens, 0 elsewhere, clamped to +-LOG_RATIO_CLAMP."""
    # Zero padded positions first: garbage there must not turn into inf/NaN gradients.
    live = mask > 0
    diff = torch.where(live, logp - other_logp, torch.zeros_like(logp))
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def clean(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask > 0, x, torch.zeros_like(x))


def clipped_surrogate(ratio: Tensor, adv: Tensor, mask: Tensor, params: PolicyLossParams):
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
