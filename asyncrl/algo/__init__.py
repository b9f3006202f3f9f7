"""The RL math: plain functions over tensors. No config objects, no I/O, no Ray, no vLLM.

    from asyncrl.algo import get_policy_loss, get_advantage_estimator, kl_penalty
    adv = get_advantage_estimator("grpo")(rewards, group_ids, mask, params=AdvantageParams())
    loss, metrics = get_policy_loss("ppo")(logp, old_logp, adv, mask, params=params_for("ppo"))
    kl = kl_penalty(logp, ref_logp, "k3")

Registries (users extend both by import path, "package.module:function", so that every Ray
worker can import the same function):
    get_policy_loss(name_or_path)          ppo, dual_clip, gspo, sapo, cispo, gmpo, clip_cov, kl_cov, cross_entropy,
                                           importance_sampling, rollout_is, dppo (is_losses.py)
    get_advantage_estimator(name_or_path)  grpo, dr_grpo, rloo, reinforce_pp, gae, maxrl
    clipped_value_loss / gae_returns / whiten / explained_variance    the critic's math (value.py)
Other entry points:
    kl_penalty(logp, other_logp, estimator)                      k1, abs, k2, k3       (kl.py)
    off_policy_correction(old, rollout, mask, params=...)        TIS + token/sequence masks (correction.py)
    corrected_policy_loss(loss_fn, ...)                          the path every loss takes (losses.py)
    reduction_weights(loss_mask, reduction, constant=..., group_ids=...)  per-token weights (reduction.py)
    logprobs_from_logits / entropy_from_logits                   T, top-k, top-p       (logprobs.py)
    broadcast_trajectory_advantages / merge_prefix_steps         step-wise             (stepwise.py)
Parameter types (params.py, torch-free: the config tree holds these very models):
    params_for(name_or_path, **fields), LossParams and one model per loss, CorrectionParams
Formulas and sources: docs/algorithms.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from asyncrl.algo.params import CorrectionParams, LossParams, params_for

if TYPE_CHECKING:
    from asyncrl.algo.advantages import ADVANTAGE_REGISTRY, AdvantageParams, get_advantage_estimator
    from asyncrl.algo.correction import off_policy_correction
    from asyncrl.algo.kl import KL_ESTIMATORS, kl_penalty
    from asyncrl.algo.logprobs import entropy_from_logits, logprobs_from_logits
    from asyncrl.algo.losses import POLICY_LOSS_REGISTRY, corrected_policy_loss, get_policy_loss
    from asyncrl.algo.reduction import LOSS_REDUCTIONS, per_microbatch_token_mean_weights, reduction_weights
    from asyncrl.algo.stepwise import broadcast_trajectory_advantages, merge_prefix_steps
    from asyncrl.algo.value import clipped_value_loss, explained_variance, gae_returns, whiten

# The config tree imports asyncrl.algo.params, which runs this file first: the torch-backed
# entry points are loaded on first use, so that reading a config never imports torch.
_LAZY = {
    "advantages": ("ADVANTAGE_REGISTRY", "AdvantageParams", "get_advantage_estimator"),
    "correction": ("off_policy_correction",),
    "kl": ("KL_ESTIMATORS", "kl_penalty"),
    "logprobs": ("entropy_from_logits", "logprobs_from_logits"),
    "losses": ("POLICY_LOSS_REGISTRY", "corrected_policy_loss", "get_policy_loss"),
    "reduction": ("LOSS_REDUCTIONS", "per_microbatch_token_mean_weights", "reduction_weights"),
    "stepwise": ("broadcast_trajectory_advantages", "merge_prefix_steps"),
    "value": ("clipped_value_loss", "explained_variance", "gae_returns", "whiten"),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ADVANTAGE_REGISTRY",
    "KL_ESTIMATORS",
    "LOSS_REDUCTIONS",
    "POLICY_LOSS_REGISTRY",
    "AdvantageParams",
    "CorrectionParams",
    "LossParams",
    "broadcast_trajectory_advantages",
    "clipped_value_loss",
    "corrected_policy_loss",
    "entropy_from_logits",
    "explained_variance",
    "gae_returns",
    "get_advantage_estimator",
    "get_policy_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "merge_prefix_steps",
    "off_policy_correction",
    "params_for",
    "per_microbatch_token_mean_weights",
    "reduction_weights",
    "whiten",
]
