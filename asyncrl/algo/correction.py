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
    token mask     drop only the tokens with rho_t outside [token_mask_low, token_mask_high]
    extra_mask     any per-token mask of the caller's, multiplied in

Order: outlier mask, token mask, TIS (over the tokens still kept), geometric / product
masks (over the tokens still kept), extra_mask. All bounds are inclusive (on a bound keeps).

Sources: truncated IS for the train/inference mismatch, F. Yao et al., "Your Efficient RL
Framework Secretly Brings You Off-Policy RL Training" (2025); sequence-level IS and the
geometric / product masks, J. Liu et al., "When Speed Kills Stability: Demystifying RL
Collapse from the Training-Inference Mismatch" (2025), section 4; the config layout follows
SkyRL PR #849, and the token mask and the order of the steps follow SkyRL's off-policy
correction (its token_mask_is_threshold_low/high).
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.algo.params import CorrectionParams
from asyncrl.algo.policy_common import LOG_RATIO_CLAMP, masked_mean


def off_policy_correction(
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    params: CorrectionParams,
    extra_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """TIS weights and the combined mask, both [B, T], plus metrics (0-d tensors).

    Applied in this order, each step seeing the mask the previous ones left: outlier
    sequence mask, token mask, TIS (a sequence weight is the product over the tokens still
    kept), geometric and product sequence masks (over the kept tokens), ``extra_mask``.

    Args:
        old_logp: [B, T] proximal-policy log-probs (recomputed by the learner; no gradient).
        rollout_logp: [B, T] behaviour-policy log-probs from the engine.
        mask: [B, T] loss mask (1 on trained tokens). Values elsewhere are ignored.
        params: which corrections to apply and their bounds.
        extra_mask: optional [B, T] mask multiplied into the result.

    Returns:
        weights: [B, T] TIS weight (1 where TIS is off or the token is masked).
        combined_mask: [B, T] ``mask`` with every mask applied.
        metrics: token fractions are over the ``mask`` tokens and row fractions over the rows
        with at least one ``mask`` token; each mask counts only what it removed itself (a row
        the outlier mask dropped is not counted again by the geometric mask), so the
        ``*_masked_frac`` add up to ``masked_frac``. ``tis_ratio_mean/_min/_max``: the
        uncapped token ratio over all ``mask`` tokens (for sequence TIS, each token shows its
        sequence's ratio); ``tis_capped_frac`` (tokens), ``tis_seq_capped_frac`` (rows,
        sequence TIS); ``outlier_``, ``geo_``, ``product_masked_frac`` (tokens) with their
        ``*_seq_masked_frac`` (rows); ``token_masked_frac``; ``extra_masked_frac``.
    """
    mask = mask.to(old_logp.dtype)
    live = mask > 0
    # Masked positions may hold garbage (padding): zero them before any exp.
    log_rho = torch.where(live, (old_logp - rollout_logp).detach(), torch.zeros_like(old_logp))
    log_rho = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = torch.exp(log_rho)
    rows = live.any(dim=1)
    metrics: dict[str, Tensor] = {}
    combined = mask.clone()

    def row_frac(flags: Tensor) -> Tensor:
        return (flags & rows).sum().to(mask.dtype) / rows.sum().clamp(min=1).to(mask.dtype)

    def apply(name: str, keep: Tensor) -> None:
        nonlocal combined
        kept = combined * keep.to(mask.dtype)
        metrics[f"{name}_masked_frac"] = masked_mean(combined - kept, mask)
        combined = kept

    def apply_rows(name: str, keep_row: Tensor) -> None:
        had_tokens = (combined > 0).any(dim=1)
        metrics[f"{name}_seq_masked_frac"] = row_frac(had_tokens & ~keep_row)
        apply(name, keep_row.unsqueeze(1))

    def kept_sequence_log_ratio() -> tuple[Tensor, Tensor]:
        kept = (combined > 0).to(mask.dtype)
        return (log_rho * kept).sum(dim=1), kept.sum(dim=1)

    if params.outlier_mask:
        bad_token = live & ((rho < params.outlier_low) | (rho > params.outlier_high))
        apply_rows("outlier", ~bad_token.any(dim=1))
    low, high = params.token_mask_low, params.token_mask_high
    if low is not None and high is not None:  # params.token_mask, spelled out for the type checker
        apply("token", (rho >= low) & (rho <= high))

    weights = torch.ones_like(old_logp)
    ratio = rho
    if params.tis == "token":
        weights = torch.where(combined > 0, rho.clamp(max=params.tis_cap), weights)
    elif params.tis == "sequence":
        seq_log, _ = kept_sequence_log_ratio()
        seq_ratio = torch.exp(seq_log.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        ratio = seq_ratio.unsqueeze(1).expand_as(old_logp)
        weights = torch.where(combined > 0, ratio.clamp(max=params.tis_cap), weights)
        metrics["tis_seq_capped_frac"] = row_frac((combined > 0).any(dim=1) & (seq_ratio > params.tis_cap))
    big, small = torch.finfo(ratio.dtype).max, torch.finfo(ratio.dtype).min
    any_live = live.any()
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    metrics["tis_ratio_mean"] = masked_mean(ratio, mask)
    metrics["tis_ratio_max"] = torch.where(any_live, torch.where(live, ratio, small).max(), zero)
    metrics["tis_ratio_min"] = torch.where(any_live, torch.where(live, ratio, big).min(), zero)
    if params.tis != "none":
        metrics["tis_capped_frac"] = masked_mean(((combined > 0) & (ratio > params.tis_cap)).to(mask.dtype), mask)

    if params.geo_mask:
        seq_log, lengths = kept_sequence_log_ratio()
        geo = torch.exp(seq_log / lengths.clamp(min=1.0))
        apply_rows("geo", ((geo >= params.geo_mask_low) & (geo <= params.geo_mask_high)) | (lengths == 0))
    if params.product_mask:
        seq_log, lengths = kept_sequence_log_ratio()
        prod = torch.exp(seq_log.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        apply_rows("product", ((prod >= params.product_mask_low) & (prod <= params.product_mask_high)) | (lengths == 0))
    if extra_mask is not None:
        apply("extra", extra_mask > 0)
    metrics["masked_frac"] = masked_mean(mask - combined, mask)
    return weights, combined, metrics
