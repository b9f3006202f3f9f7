"""KL estimators against hand-computed values, and the rollout-KL gradient against its derivative.

.venv/bin/python -m pytest tests/unit/test_kl.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl import config
from asyncrl.algo import KL_ESTIMATORS, kl_penalty
from asyncrl.config import AlgoConfig
from asyncrl.learner.loss import microbatch_loss

D = torch.float64
LOGP = torch.tensor([[0.0, -1.0, -2.0]], dtype=D)
OTHER = torch.tensor([[-0.5, -1.0, -1.0]], dtype=D)  # delta = [0.5, 0, -1]


@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("k1", [0.5, 0.0, -1.0]),
        ("abs", [0.5, 0.0, 1.0]),
        ("k2", [0.125, 0.0, 0.5]),
        ("k3", [math.exp(-0.5) - 0.5, 0.0, math.e - 2.0]),
    ],
)
def test_values(estimator, expected):
    assert torch.allclose(kl_penalty(LOGP, OTHER, estimator), torch.tensor([expected], dtype=D), atol=1e-12)


def test_k3_is_clamped_and_finite_for_huge_log_ratios():
    logp = torch.tensor([100.0, -100.0, 1e6, -1e6], dtype=D, requires_grad=True)
    k3 = kl_penalty(logp, torch.zeros(4, dtype=D), "k3")
    assert torch.equal(k3.detach(), torch.full((4,), 10.0, dtype=D))
    k3.sum().backward()
    assert torch.isfinite(logp.grad).all()
    for est in ("k1", "abs", "k2"):
        assert torch.isfinite(kl_penalty(torch.tensor([1e6]), torch.tensor([-1e6]), est)).all()


@pytest.mark.parametrize(
    "estimator, derivative",
    [
        ("k1", lambda d: torch.ones_like(d)),
        ("abs", torch.sign),
        ("k2", lambda d: d),
        ("k3", lambda d: 1.0 - torch.exp(-d)),
    ],
)
def test_elementwise_gradient(estimator, derivative):
    logp = LOGP.clone().requires_grad_(True)
    kl_penalty(logp, OTHER, estimator).sum().backward()
    assert torch.allclose(logp.grad, derivative(LOGP - OTHER), atol=1e-12)


def test_unknown_estimator_is_rejected_by_name():
    with pytest.raises(ValueError, match="'k4'"):
        kl_penalty(LOGP, OTHER, "k4")


def test_estimator_names_match_config():
    assert tuple(KL_ESTIMATORS) == config.KL_ESTIMATORS


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_rollout_kl_gradient_through_microbatch_loss_matches_analytic(estimator):
    """d/dlogits of coef * sum_t w_t k(logp_t - r_t): k'(delta_t) * (onehot - softmax(z/T)) / T."""
    temp, coef = 0.7, 0.4
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 4, 5, generator=g, dtype=D, requires_grad=True)
    ids = torch.tensor([[2, 0, 4, 1]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]], dtype=D)
    w = torch.tensor([[0.0, 0.5, 0.2, 0.3]], dtype=D)
    rollout = torch.tensor([[0.0, -1.0, -2.5, -0.3]], dtype=D)
    mb = {
        "input_ids": ids,
        "loss_mask": mask,
        "reduction_weights": w,
        "rollout_logprobs": rollout,
        "old_logprobs": rollout,
        "advantages": torch.zeros(1, 4, dtype=D),
    }
    algo = AlgoConfig(rollout_kl_coef=coef, rollout_kl_estimator=estimator)
    loss, metrics = microbatch_loss(logits, mb, algo, temperature=temp)
    loss.backward()

    z = logits.detach() / temp
    logp_all = torch.log_softmax(z, dim=-1)
    expected = torch.zeros_like(logits)
    deriv = {"k1": lambda d: 1.0, "k2": lambda d: d, "k3": lambda d: 1.0 - math.exp(-d)}[estimator]
    for t in range(1, 4):
        logp = logp_all[0, t - 1, ids[0, t]].item()
        onehot = torch.nn.functional.one_hot(ids[0, t], 5).to(D)
        expected[0, t - 1] = (
            coef * w[0, t].item() * deriv(logp - rollout[0, t].item()) * (onehot - logp_all[0, t - 1].exp()) / temp
        )
    assert torch.allclose(logits.grad, expected, atol=1e-12)
    assert metrics["loss/rollout_kl"].reduce == "sum"
