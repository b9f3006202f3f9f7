"""One mini-batch per step: the proximal policy is the current weights, so the loss may take
old logprobs from its own forward (detached) instead of a separate pre-pass."""

from __future__ import annotations

import torch

from asyncrl.config import load_config
from asyncrl.learner.loss import microbatch_loss, token_logprobs


def test_old_from_current_equals_a_separate_prepass_in_value_and_gradient():
    torch.manual_seed(0)
    algo = load_config(
        None,
        [
            "algo.correction.tis=token",
            "algo.rollout_kl_coef=0.1",
            "algo.entropy_coef=0.01",
            "algo.policy_loss.eps_clip_high=0.28",
        ],
    ).algo
    B, L, V = 3, 7, 11
    logits = torch.randn(B, L, V, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (B, L))
    mask = torch.ones(B, L, dtype=torch.float64)
    mask[:, :2] = 0
    mask[2, 5:] = 0
    mb = {
        "input_ids": ids,
        "loss_mask": mask,
        "advantages": torch.randn(B, L, dtype=torch.float64),
        "reduction_weights": mask / mask.sum(),
        "rollout_logprobs": (token_logprobs(logits.detach(), ids, 0.7) + 0.05 * torch.randn(B, L)) * mask,
    }
    with torch.no_grad():
        prepass = dict(mb, old_logprobs=token_logprobs(logits, ids, 0.7))
    loss_a, metrics_a = microbatch_loss(logits, prepass, algo, temperature=0.7)
    (grad_a,) = torch.autograd.grad(loss_a, logits)
    loss_b, metrics_b = microbatch_loss(logits, mb, algo, temperature=0.7, old_from_current=True)
    (grad_b,) = torch.autograd.grad(loss_b, logits)
    assert torch.equal(loss_a, loss_b)
    assert torch.allclose(grad_a, grad_b, rtol=0, atol=1e-12)
    assert float(metrics_a["drift/tis_ratio_mean"].value) == float(metrics_b["drift/tis_ratio_mean"].value)
    assert grad_a.abs().sum() > 0
