"""The algo section: advantages, the policy loss (asyncrl.config.losses), reduction, KL,
entropy and the off-policy correction, with the rules that involve only these fields."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from asyncrl.config.base import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_REDUCTIONS,
    OUTCOME_ESTIMATORS,
    ConfigError,
    Section,
    one_of,
    ordered,
)
from asyncrl.config.losses import LOSS_FIELDS, PolicyLoss, PpoLoss, moved_loss_field, normalise_loss

log = logging.getLogger("asyncrl.config")


class CorrectionConfig(Section):
    """Off-policy correction between the proximal (old) policy and the behaviour (rollout) policy.

    All ratios are exp(old_logprob - rollout_logprob). See docs/algorithms.md.
    """

    tis: Literal["auto", "none", "token", "sequence"] = "auto"
    """Truncated importance sampling weight: per token, or one per sequence (product of ratios).
    'auto' (the default) resolves at load to 'token', except 'none' for a policy loss that is
    already anchored at the rollout policy, is sequence-level, or is cross_entropy."""
    tis_cap: float = Field(2.0, gt=0)
    """Upper cap of the TIS weight."""
    geo_mask: bool = False
    """Mask a sequence whose geometric-mean ratio lies outside [geo_mask_low, geo_mask_high]."""
    geo_mask_low: float = Field(0.99, gt=0)
    geo_mask_high: float = 1.01
    product_mask: bool = False
    """Mask a sequence whose product of ratios lies outside [product_mask_low, product_mask_high]."""
    product_mask_low: float = Field(0.5, gt=0)
    product_mask_high: float = 2.0
    outlier_mask: bool = False
    """Mask a whole sequence if any one token's ratio lies outside [outlier_low, outlier_high]."""
    outlier_low: float = Field(1e-4, gt=0)
    outlier_high: float = 100.0
    token_mask_low: float | None = Field(None, gt=0)
    """Token IS mask: zero only the tokens whose ratio lies outside [token_mask_low,
    token_mask_high] (bounds keep), the rest of the sequence trains. On when both are set."""
    token_mask_high: float | None = None
    _tis_auto: bool = PrivateAttr(False)
    """tis was 'auto' (resolved by AlgoConfig): a cross-section rule may still turn it off."""

    @property
    def tis_auto(self) -> bool:
        return self._tis_auto

    @property
    def token_mask(self) -> bool:
        return self.token_mask_low is not None and self.token_mask_high is not None

    @property
    def enabled(self) -> bool:
        return self.tis != "none" or self.geo_mask or self.product_mask or self.outlier_mask or self.token_mask

    @model_validator(mode="after")
    def _ranges(self) -> CorrectionConfig:
        w = "algo.correction."
        ordered(w + "geo_mask_low", self.geo_mask_low, w + "geo_mask_high", self.geo_mask_high)
        ordered(w + "product_mask_low", self.product_mask_low, w + "product_mask_high", self.product_mask_high)
        ordered(w + "outlier_low", self.outlier_low, w + "outlier_high", self.outlier_high)
        if (self.token_mask_low is None) != (self.token_mask_high is None):
            unset = "token_mask_high" if self.token_mask_high is None else "token_mask_low"
            given = "token_mask_low" if unset == "token_mask_high" else "token_mask_high"
            raise ConfigError(
                f"{w}{unset}=None while {w}{given}={getattr(self, given)!r}: the token mask needs both "
                f"bounds (set {w}{unset}, or unset both to turn it off)"
            )
        if self.token_mask_low is not None and self.token_mask_high is not None:
            ordered(w + "token_mask_low", self.token_mask_low, w + "token_mask_high", self.token_mask_high)
        return self


class AlgoConfig(Section):
    """The RL objective: advantages, policy loss, reduction, KL and entropy terms."""

    advantage_estimator: str = "grpo"
    """One of grpo, dr_grpo, rloo, reinforce_pp, gae, maxrl, or an import path 'package.module:function'."""
    grpo_norm_std: bool = True
    """GRPO: divide group-centred rewards by the group std (False gives Dr.GRPO-style centring)."""
    gamma: float = Field(1.0, gt=0)
    """Discount (reinforce_pp, gae)."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda (gae only)."""
    policy_loss: PolicyLoss = Field(default_factory=PpoLoss)
    """The policy loss and its own settings: a name (ppo; its defaults), {type: NAME, field: value, ...},
    or {type: 'package.module:function', kwargs: {...}}. `asyncrl train --help-config` lists every loss."""
    loss_reduction: str = "token_mean"
    """How per-token terms are weighted within a mini-batch (all DP ranks together)."""
    reduction_constant: float | None = Field(None, gt=0)
    """The constant C of seq_mean_token_sum_norm (usually the max response length)."""
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    """Off-policy correction between the proximal and the behaviour policy."""
    kl_coef: float = Field(0.0, ge=0)
    """Coefficient of the KL-to-reference term (0 disables the reference model)."""
    kl_estimator: str = "k3"
    """One of k1, abs, k2, k3."""
    rollout_kl_coef: float = Field(0.0, ge=0)
    """Rollout-KL trust region: penalty on (logprob - rollout_logprob)."""
    rollout_kl_estimator: str = "k2"
    """One of k1, abs, k2, k3."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient (the loss subtracts entropy_coef * entropy)."""
    stepwise: bool = False
    """Multi-turn samples are step-wise trajectories (one sequence per step)."""
    merge_stepwise: bool = True
    """Merge consecutive steps that share a prefix into one sequence."""

    @property
    def rollout_anchored(self) -> bool:
        """The policy loss's ratio is already against the rollout policy."""
        return self.policy_loss.rollout_anchored

    @property
    def needs_rollout_logprobs(self) -> bool:
        return self.correction.enabled or self.rollout_kl_coef > 0 or self.rollout_anchored

    @model_validator(mode="before")
    @classmethod
    def _no_flat_loss_knobs(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key in LOSS_FIELDS:
                    raise ConfigError(moved_loss_field(key))
        return data

    @field_validator("policy_loss", mode="before")
    @classmethod
    def _loss_shorthand(cls, value: Any) -> Any:
        return normalise_loss(value)

    @model_validator(mode="after")
    def _rules(self) -> AlgoConfig:
        if self.correction.tis == "auto":
            self.correction.tis = default_tis(self.policy_loss)
            self.correction._tis_auto = True
        one_of("algo.advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS, import_path_ok=True)
        one_of("algo.loss_reduction", self.loss_reduction, LOSS_REDUCTIONS)
        one_of("algo.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        one_of("algo.rollout_kl_estimator", self.rollout_kl_estimator, KL_ESTIMATORS)
        if self.loss_reduction == "seq_mean_token_sum_norm" and self.reduction_constant is None:
            raise ConfigError(
                "algo.reduction_constant is required when algo.loss_reduction='seq_mean_token_sum_norm' "
                "(set it to the max response length, e.g. rollout.max_tokens)"
            )
        loss, tis = self.policy_loss, self.correction.tis
        if loss.sequence_level and self.loss_reduction != "sequence_mean":
            raise ConfigError(
                f"algo.policy_loss={loss.type!r} requires algo.loss_reduction='sequence_mean' "
                f"(got {self.loss_reduction!r}): its objective is a per-sequence geometric mean"
            )
        if loss.sequence_level and tis == "token":
            raise ConfigError(
                f"algo.correction.tis='token' does not compose with algo.policy_loss={loss.type!r}: it averages "
                "log-ratios per sequence, so a per-token weight has no place in its objective. "
                "Use algo.correction.tis='sequence' (applied to the sequence objective) or a sequence mask."
            )
        if loss.type == "cispo" and loss.rollout_anchored and tis != "none":
            raise ConfigError(
                f"algo.correction.tis={tis!r} does not compose with algo.policy_loss.cispo_anchor='rollout': the "
                f"CISPO weight already is the rollout ratio exp(logp - rollout_logprob), so a TIS weight would "
                f"correct twice. Use algo.correction.tis='none' (the masks still apply) or "
                f"algo.policy_loss.cispo_anchor='old'."
            )
        if loss.rollout_anchored and loss.type != "cispo" and tis != "none":
            log.warning(
                "algo.policy_loss=%r already takes its ratio against the rollout policy; algo.correction.tis=%r "
                "multiplies in exp(old - rollout) on top. Use algo.correction.tis='none' unless that is meant.",
                loss.type,
                tis,
            )
        if self.stepwise and self.advantage_estimator not in OUTCOME_ESTIMATORS:
            raise ConfigError(
                f"algo.advantage_estimator={self.advantage_estimator!r} cannot be used with algo.stepwise=true: "
                f"step-wise trajectories broadcast one scalar advantage per trajectory, so only outcome "
                f"estimators work ({', '.join(OUTCOME_ESTIMATORS)})"
            )
        if self.advantage_estimator == "gae":
            raise ConfigError(
                "algo.advantage_estimator='gae' needs a value model (critic), which asyncrl does not train yet; "
                f"use one of {', '.join(e for e in ADVANTAGE_ESTIMATORS if e != 'gae')}"
            )
        return self


def default_tis(loss: PolicyLoss) -> Literal["none", "token"]:
    """What algo.correction.tis='auto' means for `loss`.

    Token TIS capped at tis_cap (default 2): a learner's data is off-policy whenever it is
    stale (async) and, in any mode, wherever the engine's numerics differ from the learner's
    (Yao et al. 2025), and the weight is 1 where neither holds. 'none' where a TIS weight has
    no place: the loss's ratio already is against the rollout policy (it would correct twice),
    its objective is per sequence (tis='sequence' is the explicit choice there), or it is
    plain cross-entropy.
    """
    if loss.rollout_anchored or loss.sequence_level or loss.type == "cross_entropy":
        return "none"
    return "token"
