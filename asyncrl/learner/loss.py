"""The per-micro-batch loss the learner calls: policy + KL to reference + rollout KL - entropy.

    logits = model(mb["input_ids"]).logits                        # [B, L, V], or packed [R, W, V]
    loss, metrics = microbatch_loss(logits, mb, cfg.algo, temperature=cfg.rollout.temperature)
    loss.backward()                                               # FSDP sums the ranks' gradients

The return value is this micro-batch's contribution

    sum_t w_t * (policy_t + kl_coef * kl_t + rollout_kl_coef * rkl_t - entropy_coef * H_t)

with w = ``mb["reduction_weights"]`` computed by the driver over the whole mini-batch
(``asyncrl.data.batch``). Summed over all micro-batches and ranks it is exactly the
mini-batch loss, so the gradient does not depend on the micro-batching (FSDP sums the
ranks' gradients: asyncrl.learner.fsdp sets its divide factor to 1). Every term uses the same w: a
term normalised inside the micro-batch would be amplified by the number of micro-batches
(SkyRL PR #1296's review finding for KL and entropy).

A packed micro-batch (asyncrl.data.microbatch) gives logits over its packed rows; the
log-probs and entropy are taken there and unpacked to the [B, L] layout of every other field
before any loss term sees them, so each term, weight and metric is the padded path's.

Pass ``rollout_logprobs`` only when the engine recorded them: the ``drift/*`` metrics are
computed whenever the field is present.

``token_mean_per_microbatch`` (legacy) ignores ``reduction_weights`` and uses
w = m / (sum m in this micro-batch * num_microbatches); pass ``num_microbatches`` =
micro-batches per rank * world size. Its gradient depends on the micro-batching by design.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.algo.kl import kl_penalty
from asyncrl.algo.logprobs import entropy_from_logits, logprobs_from_logits, truncates
from asyncrl.algo.losses import corrected_policy_loss, get_policy_loss
from asyncrl.algo.params import CorrectionParams
from asyncrl.algo.reduction import per_microbatch_token_mean_weights
from asyncrl.config import AlgoConfig, RolloutConfig
from asyncrl.data import microbatch as mbatch
from asyncrl.types import MetricValue


def token_logprobs(
    logits: Tensor, input_ids: Tensor, temperature: float, *, top_k: int = -1, top_p: float = 1.0
) -> Tensor:
    """[B, L]: position t holds log p(input_ids[t] | input_ids[:t]) from logits[:, t-1]; position 0 is 0.

    logp = the engine's ``processed_logprobs``: log_softmax(logits / T) after the top-k /
    top-p cut (asyncrl.algo.logprobs); -inf for a token outside the kept set (a prompt token
    often is: only the loss decides what to do with those, see microbatch_loss).
    """
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, L, V] and input_ids [B, L]; got {tuple(logits.shape)}, {tuple(input_ids.shape)}"
        )
    shifted = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature, top_k=top_k, top_p=top_p)
    return torch.nn.functional.pad(shifted, (1, 0), value=0.0)


def token_entropy(logits: Tensor, temperature: float, *, top_k: int = -1, top_p: float = 1.0) -> Tensor:
    """[B, L]: entropy of the (cut) distribution that predicted input_ids[t] (from logits[:, t-1]); 0 at t = 0."""
    ent = entropy_from_logits(logits[:, :-1], temperature, top_k=top_k, top_p=top_p)
    return torch.nn.functional.pad(ent, (1, 0), value=0.0)


def _rows(values: Tensor, mb: dict[str, Tensor]) -> Tensor:
    """Per-position values over the forward layout, in the [B, L] layout of mb's fields."""
    return mbatch.unpack(values, mb) if mbatch.is_packed(mb) else values


@dataclass(frozen=True)
class RowScores:
    """Per-token values of a micro-batch over its [B, L] layout, taken where its logits are
    (context parallelism: each rank holds part of the row, asyncrl.learner.context_parallel)."""

    logprobs: Tensor
    """[B, L] as token_logprobs after unpacking: slot t scores input_ids[t]; 0 at t = 0."""
    entropy: Callable[[bool], Tensor]
    """[B, L] as token_entropy after unpacking; True: differentiable."""
    vocab_size: int


def _scores(logits: Tensor, mb: dict[str, Tensor], temperature: float, top_k: int, top_p: float) -> RowScores:
    """RowScores of a forward whose logits are all here."""

    def entropy(grad: bool) -> Tensor:
        src = logits if grad else logits.detach()
        return _rows(token_entropy(src, temperature, top_k=top_k, top_p=top_p), mb)

    logp = _rows(token_logprobs(logits, mbatch.forward_ids(mb), temperature, top_k=top_k, top_p=top_p), mb)
    return RowScores(logprobs=logp, entropy=entropy, vocab_size=int(logits.shape[-1]))


@dataclass(frozen=True)
class Sampling:
    """What the engines did to the logits before recording a token's log-prob, and whether
    they recorded one at all: the learner must compute the same quantity."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    rollout_logprobs: bool = True
    """False: the micro-batches' ``rollout_logprobs`` are zeros, not the engine's, so nothing
    is compared against them (no ``drift/*`` metrics; the config allows no loss that needs them)."""

    @classmethod
    def of(cls, rollout: RolloutConfig) -> Sampling:
        return cls(rollout.temperature, rollout.top_k, rollout.top_p, rollout.logprobs)

    def logprob_fn(self) -> Callable[[Tensor, Tensor, float], Tensor]:
        """token_logprobs at this top-k / top-p, taking the temperature (what step.py calls)."""
        return functools.partial(token_logprobs, top_k=self.top_k, top_p=self.top_p)


def learner_loss_fn(
    algo: AlgoConfig, sampling: Sampling, *, num_microbatches: int = 1, old_from_current: bool = False
) -> Callable[[Tensor, dict[str, Tensor]], tuple[Tensor, dict[str, MetricValue]]]:
    """microbatch_loss bound to the run's settings: the loss_fn of asyncrl.learner.step.train_step."""
    return functools.partial(
        microbatch_loss,
        algo=algo,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        rollout_recorded=sampling.rollout_logprobs,
        num_microbatches=num_microbatches,
        old_from_current=old_from_current,
    )


def correction_params(algo: AlgoConfig) -> CorrectionParams:
    """The config's correction (a CorrectionParams with tis resolved) as the frozen value the
    algo layer takes."""
    return algo.correction.params()


def required_fields(algo: AlgoConfig, *, old_from_current: bool = False) -> tuple[str, ...]:
    """The micro-batch fields the configured loss reads."""
    fields = ["input_ids", "loss_mask", "reduction_weights"]
    if algo.policy_loss.type != "cross_entropy":
        fields += ["advantages"] if old_from_current else ["old_logprobs", "advantages"]
    if algo.needs_rollout_logprobs:
        fields.append("rollout_logprobs")
    if algo.kl_coef > 0:
        fields.append("ref_logprobs")
    return tuple(fields)


def _check_fields(
    mb: dict[str, Tensor], algo: AlgoConfig, shape: torch.Size, *, old_from_current: bool = False
) -> None:
    for name in required_fields(algo, old_from_current=old_from_current):
        if name not in mb or mb[name] is None:
            raise ValueError(
                f"micro-batch is missing field {name!r}, needed by algo.policy_loss={algo.policy_loss.type!r} "
                f"(kl_coef={algo.kl_coef}, rollout_kl_coef={algo.rollout_kl_coef}, "
                f"correction={'on' if algo.correction.enabled else 'off'})"
            )
        if mb[name].shape != shape:
            raise ValueError(f"micro-batch field {name!r} has shape {tuple(mb[name].shape)}, expected {tuple(shape)}")


# Metric names the algo functions return -> the namespace they are reported under.
# Fractions of rows (sequences with a loss token) merge over rows, the rest over loss tokens.
_DRIFT_ROWS = {"geo_seq_masked_frac", "product_seq_masked_frac", "outlier_seq_masked_frac", "tis_seq_capped_frac"}
_DRIFT = {
    "tis_ratio_mean",
    "tis_ratio_min",
    "tis_ratio_max",
    "tis_capped_frac",
    "masked_frac",
    "geo_masked_frac",
    "product_masked_frac",
    "outlier_masked_frac",
    "token_masked_frac",
    "extra_masked_frac",
} | _DRIFT_ROWS


def _metric(name: str, value: Tensor, count: Tensor) -> tuple[str, MetricValue]:
    full = f"drift/{name}" if name in _DRIFT else f"policy/{name}"
    if name.endswith("_max"):
        return full, MetricValue("max", value.detach(), 1.0)
    if name.endswith("_min"):
        return full, MetricValue("min", value.detach(), 1.0)
    return full, MetricValue("mean", value.detach() * count, count)


def microbatch_loss(
    logits: Tensor | RowScores,
    mb: dict[str, Tensor],
    algo: AlgoConfig,
    *,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    rollout_recorded: bool = True,
    num_microbatches: int = 1,
    old_from_current: bool = False,
) -> tuple[Tensor, dict[str, MetricValue]]:
    """This micro-batch's share of the mini-batch loss, and its metrics.

    Args:
        logits: [B, L, V] model output for ``mb["input_ids"]``; for a packed micro-batch
            [R, W, V] for its packed rows (``mb[PACKED_IDS]``); or the RowScores a
            context-parallel forward took from them.
        mb: [B, L] tensors ``input_ids, loss_mask, rollout_logprobs, old_logprobs, advantages,
            reduction_weights`` and ``ref_logprobs`` when ``algo.kl_coef > 0``.
        algo: the algo branch of the config (read here, never passed into the math).
        temperature, top_k, top_p: the engines' sampling settings; logprobs and entropy are
            those of the distribution they sampled from (asyncrl.algo.logprobs).
        rollout_recorded: False when the engines recorded no logprobs (``rollout.logprobs``
            off): ``mb["rollout_logprobs"]`` then holds zeros and is ignored.
        num_microbatches: only for ``token_mean_per_microbatch``: micro-batches in the
            mini-batch over all ranks.
        old_from_current: the proximal policy is the current weights (one mini-batch per
            step), so ``old_logprobs`` is this forward's logprobs, detached: exactly what a
            separate pre-pass would compute, without its cost. ``mb`` then needs no
            ``old_logprobs``.

    Returns:
        (scalar loss, metrics). Loss terms are ``loss/*`` sums; ratios and fractions are
        means over loss tokens (``count`` = tokens) so they merge exactly across micro-batches.
    """
    shape = mb["input_ids"].shape if "input_ids" in mb else None
    if shape is None:
        raise ValueError("micro-batch is missing field 'input_ids'")
    _check_fields(mb, algo, shape, old_from_current=old_from_current)
    # All loss math runs in float32 at least (logp is upcast from bf16 logits).
    scores = logits if isinstance(logits, RowScores) else _scores(logits, mb, temperature, top_k, top_p)
    logp = scores.logprobs
    dtype = logp.dtype
    mask = mb["loss_mask"].to(dtype)
    if algo.policy_loss.type == "cross_entropy":
        old, adv = logp.detach(), torch.zeros_like(logp)
    else:
        old = logp.detach() if old_from_current else mb["old_logprobs"].to(dtype)
        adv = mb["advantages"].to(dtype)
    # With top-k / top-p a token outside the learner's kept set has logp (or old) = -inf:
    # probability 0 under that policy, so its IS weight is 0. It is masked, counted, and its
    # values are replaced by 0 so no exp/multiply downstream meets an inf (its gradient is 0).
    outside = (mask > 0) & (torch.isneginf(logp) | torch.isneginf(old))
    truncated = truncates(top_k, top_p, scores.vocab_size)
    n_before = mask.sum().detach()
    if truncated:
        mask = mask * ~outside
        logp = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
        old = torch.where(torch.isfinite(old), old, torch.zeros_like(old))
    if algo.loss_reduction == "token_mean_per_microbatch":
        weights = per_microbatch_token_mean_weights(mask, num_microbatches)
    else:
        weights = mb["reduction_weights"].to(dtype) * (mask > 0)
    n_tokens = mask.sum().detach()
    rollout = mb.get("rollout_logprobs") if rollout_recorded else None
    rollout = rollout.to(dtype) if rollout is not None else None
    per_token, algo_metrics = corrected_policy_loss(
        get_policy_loss(algo.policy_loss.type),
        logp,
        old,
        rollout,
        adv,
        mask,
        params=algo.policy_loss,
        correction=correction_params(algo),
        sequence_level=algo.policy_loss.sequence_level,
    )
    policy = (weights * per_token).sum()
    total = policy
    # Correction metrics are means over loss tokens; the loss's own over the tokens it kept.
    kept = n_tokens * (1.0 - algo_metrics["masked_frac"].detach()) if "masked_frac" in algo_metrics else n_tokens
    # An extreme over no tokens has no value; a stand-in 0 would corrupt the merged min/max.
    # (One host sync per micro-batch: cheap next to its forward/backward.)
    has_tokens = bool(n_tokens > 0)
    n_rows = (mask > 0).any(dim=1).sum().to(dtype)
    metrics: dict[str, MetricValue] = dict(
        _metric(k, v, n_rows if k in _DRIFT_ROWS else n_tokens if k in _DRIFT else kept)
        for k, v in algo_metrics.items()
        if has_tokens or not k.endswith(("_max", "_min"))
    )
    metrics["loss/policy"] = MetricValue("sum", policy.detach())
    if truncated:
        metrics["drift/outside_kept_frac"] = MetricValue("mean", outside.sum().to(dtype), n_before)

    if algo.kl_coef > 0:
        ref = mb["ref_logprobs"].to(dtype)
        in_kl = mask > 0
        if truncated:  # KL to a reference that cannot sample the token is infinite: left out, counted
            ref_out = (mask > 0) & torch.isneginf(ref)
            ref = torch.where(torch.isfinite(ref), ref, logp.detach())
            in_kl = in_kl & ~ref_out
            metrics["policy/ref_outside_kept_frac"] = MetricValue("mean", ref_out.sum().to(dtype), n_tokens)
        kl = kl_penalty(logp, ref, algo.kl_estimator)
        kl_term = (weights * torch.where(in_kl, kl, torch.zeros_like(kl))).sum()
        total = total + algo.kl_coef * kl_term
        metrics["loss/kl_ref"] = MetricValue("sum", kl_term.detach())
    if rollout is not None:
        live = mask > 0
        if algo.rollout_kl_coef > 0:
            rkl = kl_penalty(logp, rollout, algo.rollout_kl_estimator)
            rkl_term = (weights * torch.where(live, rkl, torch.zeros_like(rkl))).sum()
            total = total + algo.rollout_kl_coef * rkl_term
            metrics["loss/rollout_kl"] = MetricValue("sum", rkl_term.detach())
        with torch.no_grad():
            k3 = torch.where(live, kl_penalty(logp, rollout, "k3"), torch.zeros_like(logp))
            diff = torch.where(live, (logp - rollout).abs(), torch.zeros_like(logp))
            metrics["drift/rollout_kl"] = MetricValue("mean", k3.sum(), n_tokens)
            metrics["drift/abs_logp_diff"] = MetricValue("mean", diff.sum(), n_tokens)
            if has_tokens:
                # The proximal policy's (old) log-prob: with lr = 0 it must equal the engine's.
                worst = torch.where(live, (old - rollout).abs(), torch.zeros_like(old)).max()
                metrics["drift/logprob_abs_diff_max"] = MetricValue("max", worst, 1.0)

    if algo.entropy_coef > 0:
        ent = scores.entropy(True)
        ent_term = (weights * torch.where(mask > 0, ent, torch.zeros_like(ent))).sum()
        total = total - algo.entropy_coef * ent_term
        metrics["loss/entropy"] = MetricValue("sum", ent_term.detach())
        ent_sum = torch.where(mask > 0, ent, torch.zeros_like(ent)).sum().detach()
    else:
        with torch.no_grad():
            ent = scores.entropy(False)
            ent_sum = torch.where(mask > 0, ent, torch.zeros_like(logp)).sum()
    metrics["policy/entropy"] = MetricValue("mean", ent_sum, n_tokens)
    metrics["loss/total"] = MetricValue("sum", total.detach())
    return total, metrics
