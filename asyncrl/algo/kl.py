"""KL estimators between the current policy and another policy, per token.

    from asyncrl.algo.kl import kl_penalty
    kl = kl_penalty(logprobs, ref_logprobs, "k3")          # [B, T], weight it yourself

Used twice: for the KL-to-reference term (``algo.kl_estimator``, default k3) and for the
rollout-KL trust region, a penalty on ``logprob - rollout_logprob`` (``algo.rollout_kl_estimator``,
default k2). With ``delta = logp - other_logp`` and samples drawn from the current policy:

    k1  = delta                              unbiased for KL(p || q), high variance, can be < 0
    abs = |delta|
    k2  = 0.5 * delta**2                     low bias; gradient is exactly delta (a soft L2 trust region)
    k3  = exp(-delta) - 1 + delta            unbiased, always >= 0 (clamped at 10)

Source: J. Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html.
The k2 trust region in fully-async training follows prime-rl's squared log-ratio penalty.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.algo.policy_common import LOG_RATIO_CLAMP

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")

# k3 grows like exp(-delta); a single runaway token would otherwise dominate the batch.
K3_MAX = 10.0


def kl_penalty(logp: Tensor, other_logp: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimate between the current policy (``logp``) and ``other_logp``.

    Args:
        logp: [B, T] log-probs of the sampled tokens under the current policy (differentiable).
        other_logp: [B, T] log-probs of the same tokens under the reference / rollout policy.
        estimator: one of ``k1``, ``abs``, ``k2``, ``k3`` (see the module docstring).

    Returns:
        [B, T] estimate per token; masking and weighting are the caller's.
    """
    delta = logp - other_logp
    if estimator == "k1":
        return delta
    if estimator == "abs":
        return delta.abs()
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        delta = delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(-delta) - 1.0 + delta).clamp(max=K3_MAX)
    raise ValueError(f"unknown KL estimator {estimator!r}: must be one of {', '.join(KL_ESTIMATORS)}")
