"""On-policy distillation: the teacher's log-prob of each token the student sampled, as a
per-token advantage term.

    k = reverse_kl_per_token(behaviour_logp, teacher_logp, mask)               # [N, T]
    adv = adv + teacher_advantages(behaviour_logp, teacher_logp, mask, coef=1.0, discount=0.0)

The student samples y ~ pi_s; the teacher scores the same tokens. On the sampled token,

    k_t = log pi_s(y_t | y_<t) - log pi_t(y_t | y_<t)

is a one-sample (unbiased) estimate of the per-token reverse KL KL(pi_s || pi_t) at that
position, and A_t = -coef * k_t pushes the student toward tokens the teacher likes more than
it does. Source: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning
from Self-Generated Mistakes" (GKD, arXiv:2306.13649), reverse-KL case; Thinking Machines Lab
2025, "On-Policy Distillation" (blog post) (per-token reverse KL as the advantage, discount 0).
"""

from __future__ import annotations

import torch
from torch import Tensor


def reverse_kl_per_token(behaviour_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """k_t = behaviour_logp_t - teacher_logp_t on mask tokens, 0 elsewhere; all [N, T].

    The student's log-prob is the rollout (behaviour) one, recorded by the engine when it
    sampled the token, not the learner's current one: the teacher's log-prob also scores that
    behaviour sample, so k_t is a fixed per-token reward of the record, independent of how
    stale the record is when it is trained (the off-policy correction handles the staleness,
    as for any reward). The learner's current log-prob would make the term depend on the
    update it is part of, and it is not known where advantages are computed (the driver).
    """
    if behaviour_logp.shape != teacher_logp.shape or behaviour_logp.shape != mask.shape:
        raise ValueError(
            f"behaviour_logp {tuple(behaviour_logp.shape)}, teacher_logp {tuple(teacher_logp.shape)} and "
            f"mask {tuple(mask.shape)} must have one shape [N, T]"
        )
    live = mask > 0
    k = behaviour_logp.to(torch.float64) - teacher_logp.to(torch.float64)
    return torch.where(live, k, torch.zeros_like(k))


def teacher_advantages(
    behaviour_logp: Tensor, teacher_logp: Tensor, mask: Tensor, *, coef: float, discount: float = 0.0
) -> Tensor:
    """The teacher's advantage term [N, T] (float64), 0 where ``mask`` is 0.

    discount = 0 (the default):  A_t = -coef * k_t
    discount = g in (0, 1]:      A_t = -coef * sum_{u >= t, mask_u} g^(#mask tokens in (t, u]) * k_u

    Discount 0 is the default, as in the on-policy distillation recipe: the teacher's log-prob
    already scores each token in its context, so its own KL is a dense, low-variance signal per
    token; summing future KLs (discount 1) is the REINFORCE gradient of the sequence-level KL, but
    adds the variance of every later token to each one. The sum runs over mask tokens only, so in
    multi-turn the observation tokens (mask 0: written by the environment, not sampled) neither get
    a term nor carry one, and the discount counts policy tokens, not the gaps between turns.
    """
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount={discount!r}: must be in [0, 1]")
    k = reverse_kl_per_token(behaviour_logp, teacher_logp, mask)
    if discount == 0.0:
        return -coef * k
    live = mask > 0
    out = torch.zeros_like(k)
    running = torch.zeros(k.shape[0], dtype=k.dtype, device=k.device)
    for t in range(k.shape[1] - 1, -1, -1):
        running = torch.where(live[:, t], k[:, t] + discount * running, running)
        out[:, t] = torch.where(live[:, t], running, torch.zeros_like(running))
    return -coef * out
