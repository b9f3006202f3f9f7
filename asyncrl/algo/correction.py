"""Off-policy correction between the proximal policy (old) and the behaviour policy (rollout).

    params = CorrectionParams(tis="token", tis_cap=2.0)
    weights, mask, metrics = off_policy_correction(old_logp, rollout_logp, loss_mask, params=params)
    per_token_loss = per_token_loss * weights * mask

Every policy loss goes through this one helper (``asyncrl.algo.losses.corrected_policy_loss``).
With the per-token ratio rho_t = exp(old_t - rollout_t) (log-ratios clamped to +-20 first):

    token TIS      w_t = min(rho_t, cap)
    sequence TIS   w_t = min(prod_t rho_t, cap)   = min(exp(sum_t log rho_t), cap), same for all t of a sequence
    geometric mask keep a sequence iff low <= exp(mean_t log rho_t) <= high
    product mask   keep a sequence iff low <= prod_t rho_t <= high
    outlier mask   drop a whole sequence if any one token has rho_t outside [low, high]
    extra_mask     any per-token mask of the caller's, multiplied in

Sources: truncated IS for the train/inference mismatch, F. Yao et al., "Your Efficient RL
Framework Secretly Brings You Off-Policy RL Training" (2025); sequence-level IS and the
geometric / product masks, J. Liu et al., "When Speed Kills Stability: Demystifying RL
Collapse from the Training-Inference Mismatch" (2025), section 4; the config layout follows
SkyRL PR #849.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class CorrectionParams:
    """The scalars of the correction (mirrors ``asyncrl.config.CorrectionConfig``)."""

    tis: str = "none"
    tis_cap: float = 2.0
    geo_mask: bool = False
    geo_mask_low: float = 0.99
    geo_mask_high: float = 1.01
    product_mask: bool = False
    product_mask_low: float = 0.5
    product_mask_high: float = 2.0
    outlier_mask: bool = False
    outlier_low: float = 1e-4
    outlier_high: float = 100.0

    def __post_init__(self) -> None:
        if self.tis not in ("none", "token", "sequence"):
            raise ValueError(f"tis={self.tis!r}: must be 'none', 'token' or 'sequence'")
        if not self.tis_cap > 0:
            raise ValueError(f"tis_cap={self.tis_cap!r}: must be > 0")
        for name in ("geo_mask", "product_mask", "outlier_mask"):
            low_name = "outlier_low" if name == "outlier_mask" else f"{name}_low"
            high_name = "outlier_high" if name == "outlier_mask" else f"{name}_high"
            low, high = getattr(self, low_name), getattr(self, high_name)
            if not 0 < low < high:
                raise ValueError(f"{low_name}={low!r}, {high_name}={high!r}: need 0 < low < high")

    @property
    def enabled(self) -> bool:
        return self.tis != "none" or self.geo_mask or self.product_mask or self.outlier_mask


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _sequence_keep(keep_seq: Tensor, mask: Tensor) -> Tensor:
    """[B] bool -> [B, T] float mask on the tokens of the kept sequences."""
    return mask * keep_seq.to(mask.dtype).unsqueeze(1)


def off_policy_correction(
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    params: CorrectionParams,
    extra_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """TIS weights and the combined mask, both [B, T], plus metrics (0-d tensors).

    Args:
        old_logp: [B, T] proximal-policy log-probs (recomputed by the learner; no gradient).
        rollout_logp: [B, T] behaviour-policy log-probs from the engine.
        mask: [B, T] loss mask (1 on trained tokens). Values elsewhere are ignored.
        params: which corrections to apply and their bounds.
        extra_mask: optional [B, T] mask multiplied into the result.

    Returns:
        weights: [B, T] TIS weight (1 where TIS is off or the token is masked).
        combined_mask: [B, T] ``mask`` with every sequence mask and ``extra_mask`` applied.
        metrics: means are over ``mask`` tokens: ``tis_ratio_mean/_min/_max`` (uncapped
        token ratio, or the sequence ratio for sequence TIS), ``tis_capped_frac``,
        ``geo_masked_frac``, ``product_masked_frac``, ``outlier_masked_frac``,
        ``extra_masked_frac`` and ``masked_frac`` (all masks together).
    """
    mask = mask.to(old_logp.dtype)
    live = mask > 0
    # Masked positions may hold garbage (padding): zero them before any exp.
    log_rho = torch.where(live, (old_logp - rollout_logp).detach(), torch.zeros_like(old_logp))
    log_rho = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_log_rho = log_rho.sum(dim=1)
    lengths = mask.sum(dim=1)
    has_tokens = lengths > 0
    metrics: dict[str, Tensor] = {}

    weights = torch.ones_like(old_logp)
    if params.tis == "token":
        ratio = torch.exp(log_rho)
        weights = torch.where(live, ratio.clamp(max=params.tis_cap), weights)
    elif params.tis == "sequence":
        seq_ratio = torch.exp(seq_log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        ratio = seq_ratio.unsqueeze(1).expand_as(old_logp)
        weights = torch.where(live, ratio.clamp(max=params.tis_cap), weights)
    else:
        ratio = torch.exp(log_rho)
    big, small = torch.finfo(ratio.dtype).max, torch.finfo(ratio.dtype).min
    any_live = live.any()
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    metrics["tis_ratio_mean"] = _masked_mean(ratio, mask)
    metrics["tis_ratio_max"] = torch.where(any_live, torch.where(live, ratio, small).max(), zero)
    metrics["tis_ratio_min"] = torch.where(any_live, torch.where(live, ratio, big).min(), zero)
    if params.tis != "none":
        metrics["tis_capped_frac"] = _masked_mean((ratio > params.tis_cap).to(mask.dtype), mask)

    combined = mask.clone()
    if params.geo_mask:
        geo = torch.exp(seq_log_rho / lengths.clamp(min=1.0))
        keep = ((geo >= params.geo_mask_low) & (geo <= params.geo_mask_high)) | ~has_tokens
        metrics["geo_masked_frac"] = _masked_mean(1.0 - _sequence_keep(keep, mask), mask)
        combined = combined * _sequence_keep(keep, mask)
    if params.product_mask:
        prod = torch.exp(seq_log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        keep = ((prod >= params.product_mask_low) & (prod <= params.product_mask_high)) | ~has_tokens
        metrics["product_masked_frac"] = _masked_mean(1.0 - _sequence_keep(keep, mask), mask)
        combined = combined * _sequence_keep(keep, mask)
    if params.outlier_mask:
        rho = torch.exp(log_rho)
        bad_token = live & ((rho < params.outlier_low) | (rho > params.outlier_high))
        keep = ~bad_token.any(dim=1)
        metrics["outlier_masked_frac"] = _masked_mean(1.0 - _sequence_keep(keep, mask), mask)
        combined = combined * _sequence_keep(keep, mask)
    if extra_mask is not None:
        extra = (extra_mask > 0).to(mask.dtype)
        metrics["extra_masked_frac"] = _masked_mean(1.0 - extra, mask)
        combined = combined * extra
    metrics["masked_frac"] = _masked_mean(1.0 - combined, mask)
    return weights, combined, metrics
