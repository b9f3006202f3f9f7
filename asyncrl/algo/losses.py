"""Policy losses: per-token loss [B, T] and metrics, in a registry users extend by import path.

    loss_fn = get_policy_loss("ppo")                      # or "my_pkg.losses:my_loss"
    per_token, metrics = loss_fn(logp, old_logp, adv, mask, params=params_for("ppo", eps_clip_high=0.28))
    per_token, metrics = corrected_policy_loss(loss_fn, logp, old_logp, rollout_logp, adv, mask,
                                               params=..., correction=CorrectionParams(tis="token"))

A policy loss is ``fn(logprobs, old_logprobs, advantages, mask, *, params) -> (loss [B, T],
metrics {name: 0-d tensor})``. Values at positions where ``mask`` is 0 are never used: the
caller weights the result with reduction weights that are 0 there. Metric names ending in
``_max``/``_min`` are extremes; every other metric is a mean over ``mask`` tokens.
Clip fractions count only tokens where clipping changed the objective (a token outside the
clip range whose unclipped term is already the smaller one is not "clipped").

With r_t = exp(logp_t - old_t) (log-ratio clamped to +-20) and A the advantage:

    ppo           -min(r A, clip(r, 1-eps_low, 1+eps_high) A)          Schulman et al. 2017; DAPO clip-higher 2025
    dual_clip     ppo, and for A < 0 also capped at -c A                Ye et al. 2020 (dual-clip PPO, MOBA games)
    gspo          ppo on s_t = sg(exp(mean_t log r)) * pi/sg(pi)        Zheng et al. 2025 (GSPO)
    sapo          -(4/tau) sigmoid(tau (r - 1)) A, tau by sign of A      Gao et al. 2025 (SAPO)
    cispo         -sg(min(r, 1+eps)/r) r A (grad: min(r,1+eps) A dlogp) MiniMax-M1 report, 2025
    gmpo          -A exp(mean_t sgn(A) min(sgn(A) log r, clip(...)))    Zhao et al. 2025 (GMPO)
    clip_cov      ppo, unclipped high-cov tokens dropped               Cui et al. 2025 (entropy mechanism of RL)
    kl_cov        -r A, plus coef |logp - old| on the highest-covariance tokens   (same paper)
    cross_entropy -logp (SFT; advantages unused)

importance_sampling, rollout_is and dppo (no PPO clip) live in ``asyncrl.algo.is_losses``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from asyncrl.algo.correction import off_policy_correction
from asyncrl.algo.is_losses import dppo, importance_sampling, rollout_is
from asyncrl.algo.params import (
    POLICY_LOSSES,
    CispoLoss,
    ClipCovLoss,
    ClippedLoss,
    CorrectionParams,
    CrossEntropyLoss,
    DualClipLoss,
    GmpoLoss,
    GspoLoss,
    KlCovLoss,
    LossParams,
    SapoLoss,
)
from asyncrl.algo.policy_common import (
    LOG_RATIO_CLAMP,
    PolicyLossFn,
    clean,
    clip_metrics,
    clipped_surrogate,
    log_ratio,
    masked_mean,
)


def ppo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, params: ClippedLoss):
    """PPO clipped surrogate with an asymmetric range [1 - eps_clip_low, 1 + eps_clip_high].

    loss_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t),  r_t = exp(logp_t - old_t).
    Source: Schulman et al. 2017 (arXiv:1707.06347); clip-higher from DAPO (arXiv:2503.14476).
    """
    mask = mask.to(logp.dtype)
    adv = clean(adv, mask)
    ratio = torch.exp(log_ratio(logp, old_logp, mask))
    loss, clip_high, clip_low = clipped_surrogate(ratio, adv, mask, params)
    metrics = clip_metrics(clip_high, clip_low, mask)
    metrics["ratio_mean"] = masked_mean(ratio.detach(), mask)
    return loss, metrics


def dual_clip(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, params: DualClipLoss):
    """Dual-clip PPO: for A < 0 the loss is also capped at -c A (c = dual_clip_c > 1).

    loss_t = min(ppo_t, -c A_t) if A_t < 0 else ppo_t, so a huge ratio on a bad token cannot
    produce an unbounded push. Source: Ye et al. 2020 (arXiv:1912.09729).
    """
    loss, metrics = ppo(logp, old_logp, adv, mask, params=params)
    mask = mask.to(logp.dtype)
    adv = clean(adv, mask)
    cap = -params.dual_clip_c * adv
    dual = (adv < 0) & (loss > cap) & (mask > 0)
    loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    metrics["dual_clip_frac"] = masked_mean(dual.to(mask.dtype), mask)
    return loss, metrics


def _sequence_mean_log_ratio(log_r: Tensor, mask: Tensor) -> Tensor:
    return (log_r * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)


def gspo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, params: GspoLoss):
    """GSPO: the PPO clip applied to the length-normalised sequence ratio.

    s_i = exp(mean_t log r_i,t); per token s_i,t = sg(s_i) * pi_t / sg(pi_t) (same value,
    token-level gradient), loss_t = -min(s_i,t A_t, clip(s_i,t) A_t).
    Source: Zheng et al. 2025 (arXiv:2507.18071), which uses much smaller eps (3e-4, 4e-4).
    """
    mask = mask.to(logp.dtype)
    adv = clean(adv, mask)
    log_r = log_ratio(logp, old_logp, mask)
    seq_log = _sequence_mean_log_ratio(log_r, mask).detach()
    log_s = seq_log + logp - logp.detach()
    log_s = torch.where(mask > 0, log_s, torch.zeros_like(log_s)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_s)
    loss, clip_high, clip_low = clipped_surrogate(ratio, adv, mask, params)
    metrics = clip_metrics(clip_high, clip_low, mask)
    metrics["ratio_mean"] = masked_mean(ratio.detach(), mask)
    return loss, metrics


def sapo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, params: SapoLoss):
    """SAPO: a smooth sigmoid gate instead of a hard clip.

    f(r) = (4 / tau) * sigmoid(tau (r - 1)), loss_t = -f(r_t) A_t with tau = tau_pos if A_t > 0
    else tau_neg. f(1) = 2/tau and f'(1) = 1, so near r = 1 it matches the plain ratio
    gradient and fades smoothly far from it. Source: Gao et al. 2025 (arXiv:2511.20347).
    """
    mask = mask.to(logp.dtype)
    adv = clean(adv, mask)
    ratio = torch.exp(log_ratio(logp, old_logp, mask))
    tau = torch.where(adv > 0, torch.full_like(adv, params.sapo_tau_pos), torch.full_like(adv, params.sapo_tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = -gate * adv
    return loss, {"gate_mean": masked_mean(gate.detach(), mask), "ratio_mean": masked_mean(ratio.detach(), mask)}


def cispo(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    params: CispoLoss,
    rollout_logp: Tensor | None = None,
):
    """CISPO: clip the (stop-gradient) IS weight, never the token's gradient.

    loss_t = -sg(min(r_t, 1 + eps) / r_t) * r_t * A_t, whose value is -min(r_t, 1 + eps) A_t
    and whose gradient is -min(r_t, 1 + eps) A_t dlogp_t: every token keeps a gradient.
    r_t = exp(logp_t - anchor_t) with anchor = old (``cispo_anchor='old'``, the paper's) or
    the rollout log-probs (``'rollout'``): with one optimizer step per batch the old ratio is
    1 and the cap never acts, while the rollout ratio carries the async staleness, so the
    weight itself is the off-policy correction (and a TIS weight on top would count it twice).
    Source: MiniMax-M1 technical report (arXiv:2506.13585).
    """
    if params.cispo_anchor == "rollout":
        if rollout_logp is None:
            raise ValueError("cispo with cispo_anchor='rollout' needs rollout_logprobs")
        anchor = rollout_logp
    else:
        anchor = old_logp
    mask = mask.to(logp.dtype)
    adv = clean(adv, mask)
    ratio = torch.exp(log_ratio(logp, anchor, mask))
    high = 1.0 + params.cispo_eps_high
    scale = (ratio.clamp(max=high) / ratio).detach()
    loss = -scale * ratio * adv
    clipped = (ratio > high) & (mask > 0) & (adv != 0)
    return loss, {
        "clip_frac": masked_mean(clipped.to(mask.dtype), mask),
        "ratio_mean": masked_mean(ratio.detach(), mask),
    }


def gmpo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, params: GmpoLoss):
    """GMPO: maximise the geometric mean of the token ratios (clipped in log space).

    With sigma = sign(A_i) (one advantage per sequence, the mean of A over its tokens):
    l_t = sigma * min(sigma log r_t, clip(sigma log r_t, -eps_low, eps_high)),
    R_i = exp(mean_t l_t), and every token of sequence i carries loss -A_i R_i. Weighted by
    sequence_mean (1 / (S len_i)), the sum is (1/S) sum_i -A_i R_i: GMPO's objective, which
    is why the config requires sequence_mean. Source: Zhao et al. 2025 (arXiv:2507.20673).
    """
    mask = mask.to(logp.dtype)
    adv = clean(adv, mask)
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    seq_adv = (adv * mask).sum(dim=1, keepdim=True) / lengths
    sign = torch.sign(seq_adv)
    log_r = log_ratio(logp, old_logp, mask)
    signed = sign * log_r
    effective = sign * torch.minimum(signed, signed.clamp(-params.eps_clip_low, params.eps_clip_high))
    seq_ratio = torch.exp((effective * mask).sum(dim=1, keepdim=True) / lengths)
    loss = (-seq_adv * seq_ratio).expand_as(logp)
    clipped = (effective != log_r) & (mask > 0)
    hi = clipped & (log_r > 0)
    lo = clipped & (log_r < 0)
    metrics = clip_metrics(hi, lo, mask)
    metrics["seq_ratio_mean"] = masked_mean(seq_ratio.detach().expand_as(logp), mask)
    return loss, metrics


def _token_covariance(logp: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
    """cov_t = (logp_t - mean logp)(A_t - mean A), means over ``mask`` tokens (no gradient)."""
    lp = logp.detach()
    return (lp - masked_mean(lp, mask)) * (adv - masked_mean(adv, mask))


def _top_tokens(score: Tensor, eligible: Tensor, ratio: float, mask: Tensor) -> Tensor:
    """The max(1, floor(ratio * n_tokens)) eligible tokens with the largest score (bool mask).

    The paper picks among eligible tokens at random; the top scores are taken here so a
    step is reproducible. k is kept a tensor (ranks compared against it) so nothing syncs
    with the host. Both are computed over the tokens this call sees (a micro-batch), so
    clip_cov and kl_cov are NOT invariant to micro-batching.
    """
    k = torch.floor(ratio * mask.sum()).clamp(min=1.0)
    flat = torch.where(eligible, score, torch.full_like(score, -torch.inf)).flatten()
    order = flat.argsort(descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return eligible & (rank.view_as(score) < k)


def clip_cov(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, params: ClipCovLoss):
    """Clip-Cov: PPO loss, but up to clip_cov_ratio of the tokens, chosen among the eligible
    ones by covariance, get no gradient, which keeps policy entropy from collapsing.

    Eligible: a loss token the PPO clip has not already clipped, with lb < cov_t < ub
    (strict). A token the clip already took carries no gradient; spending a slot on it would
    leave a live high-covariance token untouched.
    Source: Cui et al. 2025 (arXiv:2505.22617) and its reference code.
    """
    mask = mask.to(logp.dtype)
    adv = clean(adv, mask)
    ratio = torch.exp(log_ratio(logp, old_logp, mask))
    loss, clip_high, clip_low = clipped_surrogate(ratio, adv, mask, params)
    metrics = clip_metrics(clip_high, clip_low, mask)
    metrics["ratio_mean"] = masked_mean(ratio.detach(), mask)
    cov = _token_covariance(logp, adv, mask)
    already_clipped = clip_high | clip_low
    eligible = (mask > 0) & ~already_clipped & (cov > params.clip_cov_lb) & (cov < params.clip_cov_ub)
    chosen = _top_tokens(cov, eligible, params.clip_cov_ratio, mask)
    loss = torch.where(chosen, torch.zeros_like(loss), loss)
    metrics["clip_cov_frac"] = masked_mean(chosen.to(mask.dtype), mask)
    return loss, metrics


def kl_cov(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, params: KlCovLoss):
    """KL-Cov: -r A on every token, plus kl_cov_coef |logp - old| on the top kl_cov_ratio of
    tokens by covariance. Source: Cui et al. 2025 (arXiv:2505.22617).
    """
    mask = mask.to(logp.dtype)
    adv = clean(adv, mask)
    log_r = log_ratio(logp, old_logp, mask)
    ratio = torch.exp(log_r)
    cov = _token_covariance(logp, adv, mask)
    chosen = _top_tokens(cov, mask > 0, params.kl_cov_ratio, mask)
    loss = -adv * ratio + torch.where(chosen, params.kl_cov_coef * log_r.abs(), torch.zeros_like(ratio))
    return loss, {
        "kl_cov_frac": masked_mean(chosen.to(mask.dtype), mask),
        "ratio_mean": masked_mean(ratio.detach(), mask),
    }


def cross_entropy(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, params: CrossEntropyLoss):
    """Supervised fine-tuning: loss_t = -logp_t (old log-probs and advantages are unused)."""
    mask = mask.to(logp.dtype)
    return clean(-logp, mask), {"nll": masked_mean(-logp.detach(), mask)}


# Keyed by the schema's names (asyncrl.algo.params): each built-in is the function of that name.
_FUNCTIONS: dict[str, PolicyLossFn] = {
    fn.__name__: fn
    for fn in (
        ppo,
        dual_clip,
        gspo,
        sapo,
        cispo,
        gmpo,
        clip_cov,
        kl_cov,
        cross_entropy,
        importance_sampling,
        rollout_is,
        dppo,
    )
}
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {name: _FUNCTIONS[name] for name in POLICY_LOSSES}


def takes_rollout_logprobs(loss_fn: PolicyLossFn) -> bool:
    """Whether the loss declares a ``rollout_logp`` keyword (then it is given the behaviour log-probs)."""
    try:
        return "rollout_logp" in inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return False


def load_by_import_path(path: str, what: str) -> Callable:
    """Resolve 'package.module:function' (the same string works in every Ray worker)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {path!r}: an import path must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # user code: whatever its import raises (not only ImportError) is this path's failure
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def lookup(registry: dict[str, Callable], name_or_path: str, what: str) -> Callable:
    """A built-in by registry name, or a user's function by import path 'package.module:function'."""
    if name_or_path in registry:
        return registry[name_or_path]
    if ":" in name_or_path:
        return load_by_import_path(name_or_path, what)
    raise ValueError(
        f"unknown {what} {name_or_path!r}: must be one of {', '.join(registry)} "
        f"or an import path 'package.module:function'"
    )


def get_policy_loss(name_or_path: str) -> PolicyLossFn:
    """A built-in policy loss by name, or a user's by import path 'package.module:function'."""
    return lookup(POLICY_LOSS_REGISTRY, name_or_path, "policy loss")


def corrected_policy_loss(
    loss_fn: PolicyLossFn,
    logp: Tensor,
    old_logp: Tensor,
    rollout_logp: Tensor | None,
    adv: Tensor,
    mask: Tensor,
    *,
    params: LossParams,
    correction: CorrectionParams,
    extra_mask: Tensor | None = None,
    sequence_level: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The one path every policy loss takes: correction masks in, TIS weights on, masked out.

    The loss sees the combined mask (so sequence statistics such as GMPO's mean log-ratio
    and the covariance of clip_cov skip masked tokens), and its per-token output is
    multiplied by the TIS weight and the combined mask. A loss that declares a
    ``rollout_logp`` keyword (rollout_is, dppo, cispo) is given ``rollout_logp`` as passed
    (None when the caller has none). A sequence-level loss
    (``sequence_level=True``, e.g. GMPO) accepts only a sequence TIS weight, which is one
    constant per sequence and therefore scales the sequence objective as a whole.

    Returns per-token loss [B, T] (0 on masked tokens) and the loss's metrics plus the
    correction's under ``drift/``-ready names (``tis_ratio_mean``, ``masked_frac``, ...).
    """
    mask = mask.to(logp.dtype)
    metrics: dict[str, Tensor] = {}
    weights = torch.ones_like(logp)
    combined = mask
    given_rollout = rollout_logp
    if (
        loss_fn is cispo
        and isinstance(params, CispoLoss)
        and params.cispo_anchor == "rollout"
        and correction.tis != "none"
    ):
        raise ValueError("cispo_anchor='rollout' already weights by the rollout ratio: TIS would count it twice")
    if correction.enabled or extra_mask is not None:
        if correction.enabled and rollout_logp is None:
            raise ValueError("off-policy correction is enabled but rollout_logprobs were not given")
        if sequence_level and correction.tis == "token":
            raise ValueError("token TIS does not compose with a sequence-level loss (gmpo): use tis='sequence'")
        if rollout_logp is None:
            rollout_logp = old_logp
        weights, combined, metrics = off_policy_correction(
            old_logp, rollout_logp, mask, params=correction, extra_mask=extra_mask
        )
    behaviour = {"rollout_logp": given_rollout} if takes_rollout_logprobs(loss_fn) else {}
    loss, loss_metrics = loss_fn(logp, old_logp, adv, combined, params=params, **behaviour)
    loss = clean(loss, combined) * weights.detach()
    return loss, {**loss_metrics, **metrics}
