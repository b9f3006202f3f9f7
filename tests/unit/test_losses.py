"""Policy losses and microbatch_loss against hand-computed values.

.venv/bin/python -m pytest tests/unit/test_losses.py -q
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from asyncrl import config
from asyncrl.algo import (
    POLICY_LOSS_REGISTRY,
    CorrectionParams,
    corrected_policy_loss,
    get_policy_loss,
    params_for,
)
from asyncrl.algo.losses import takes_rollout_logprobs
from asyncrl.config import AlgoConfig, CorrectionConfig
from asyncrl.learner.loss import microbatch_loss, token_logprobs

D = torch.float64
LN = math.log


def t(rows):
    return torch.tensor(rows, dtype=D)


def behaviour(fn, old, rollout=None):
    """The rollout_logp keyword for losses that take one (the old log-probs unless given)."""
    return {"rollout_logp": old if rollout is None else rollout} if takes_rollout_logprobs(fn) else {}


def grad_wrt_logp(fn, logp, old, adv, mask, params, rollout=None):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = fn(logp, old, adv, mask, params=params, **behaviour(fn, old, rollout))
    (loss * mask).sum().backward()
    return loss.detach(), logp.grad, metrics


def test_ppo_asymmetric_clip_and_effective_clip_fraction():
    # ratios 1.5 (A=1, clipped high), 0.5 (A=1, not clipped: the unclipped term is smaller),
    # 1.25 (A=1, exactly on the bound 1 + 0.25: not clipped), 0.5 (A=-1, clipped low at 0.8),
    # 1.5 (A=-1, not clipped), 1.0 (A=0).
    r = [1.5, 0.5, 1.25, 0.5, 1.5, 1.0]
    logp, old = t([[LN(x) for x in r]]), torch.zeros(1, 6, dtype=D)
    adv, mask = t([[1, 1, 1, -1, -1, 0]]), torch.ones(1, 6, dtype=D)
    params = params_for("ppo", eps_clip_low=0.2, eps_clip_high=0.25)
    loss, grad, m = grad_wrt_logp(POLICY_LOSS_REGISTRY["ppo"], logp, old, adv, mask, params)
    assert torch.allclose(loss, t([[-1.25, -0.5, -1.25, 0.8, 1.5, 0.0]]))
    # d/dlogp of -A r is -A r where unclipped; 0 where the clipped term won.
    assert torch.allclose(grad, t([[0.0, -0.5, -1.25, 0.0, 1.5, 0.0]]))
    assert math.isclose(m["clip_frac"].item(), 2 / 6)
    assert math.isclose(m["clip_frac_high"].item(), 1 / 6)
    assert math.isclose(m["clip_frac_low"].item(), 1 / 6)


def test_dual_clip_caps_negative_advantage_tokens():
    logp, old = t([[LN(5.0), LN(1.5)]]), torch.zeros(1, 2, dtype=D)
    adv, mask = t([[-1.0, -1.0]]), torch.ones(1, 2, dtype=D)
    loss, grad, m = grad_wrt_logp(
        POLICY_LOSS_REGISTRY["dual_clip"], logp, old, adv, mask, params_for("dual_clip", dual_clip_c=3.0)
    )
    assert torch.allclose(loss, t([[3.0, 1.5]]))  # ppo would give 5.0 on the first
    assert torch.allclose(grad, t([[0.0, 1.5]]))
    assert math.isclose(m["dual_clip_frac"].item(), 0.5)


def test_gspo_uses_the_sequence_ratio_with_token_gradients():
    logp, old = t([[0.1, 0.3], [0.4, 0.0]]), torch.zeros(2, 2, dtype=D)
    adv, mask = t([[1.0, 1.0], [1.0, 0.0]]), t([[1.0, 1.0], [1.0, 0.0]])
    params = params_for("gspo", eps_clip_low=0.2, eps_clip_high=0.25)
    loss, grad, m = grad_wrt_logp(POLICY_LOSS_REGISTRY["gspo"], logp, old, adv, mask, params)
    s = math.exp(0.2)  # exp(mean(0.1, 0.3)) = 1.2214 < 1.25
    assert torch.allclose(loss[0], t([-s, -s]))
    assert torch.allclose(grad[0], t([-s, -s]))
    assert math.isclose(loss[1, 0].item(), -1.25)  # exp(0.4) = 1.49 clipped at 1.25
    assert grad[1, 0].item() == 0.0
    assert math.isclose(m["clip_frac"].item(), 1 / 3)


def test_sapo_gate_value_and_unit_slope_at_ratio_one():
    logp, old = torch.zeros(1, 2, dtype=D), torch.zeros(1, 2, dtype=D)
    adv, mask = t([[1.0, -1.0]]), torch.ones(1, 2, dtype=D)
    loss, grad, _ = grad_wrt_logp(
        POLICY_LOSS_REGISTRY["sapo"], logp, old, adv, mask, params_for("sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    )
    assert torch.allclose(loss, t([[-2.0, 2.0 / 1.05]]))
    assert torch.allclose(grad, t([[-1.0, 1.0]]))  # f'(1) = 1 for any tau


def test_cispo_clips_the_weight_but_keeps_the_gradient():
    logp, old = t([[LN(2.0), 0.0]]), torch.zeros(1, 2, dtype=D)
    adv, mask = t([[1.0, 1.0]]), torch.ones(1, 2, dtype=D)
    loss, grad, m = grad_wrt_logp(
        POLICY_LOSS_REGISTRY["cispo"], logp, old, adv, mask, params_for("cispo", cispo_eps_high=0.5)
    )
    assert torch.allclose(loss, t([[-1.5, -1.0]]))
    assert torch.allclose(grad, t([[-1.5, -1.0]]))  # ppo would give 0 gradient on the first
    assert math.isclose(m["clip_frac"].item(), 0.5)


def test_gmpo_geometric_mean_with_log_space_clip():
    logp = t([[0.1, 0.5], [-0.5, 0.1]])
    adv, mask = t([[1.0, 1.0], [-1.0, -1.0]]), torch.ones(2, 2, dtype=D)
    params = params_for("gmpo", eps_clip_low=0.2, eps_clip_high=0.2)
    loss, m = POLICY_LOSS_REGISTRY["gmpo"](logp, torch.zeros(2, 2, dtype=D), adv, mask, params=params)
    # Row 0: log r = [0.1, 0.5] -> [0.1, 0.2], R = exp(0.15), loss -R on each token.
    # Row 1 (A < 0): sign * log r = [0.5, -0.1] -> [0.2, -0.1]; back: [-0.2, 0.1], R = exp(-0.05).
    assert torch.allclose(loss, t([[-math.exp(0.15)] * 2, [math.exp(-0.05)] * 2]))
    assert math.isclose(m["clip_frac"].item(), 2 / 4)
    # With sequence_mean weights 1/(S len), the weighted sum is the GMPO objective (1/S) sum -A R.
    w = mask / (2 * 2)
    assert math.isclose((w * loss).sum().item(), (-math.exp(0.15) + math.exp(-0.05)) / 2)


def test_clip_cov_and_kl_cov_pick_the_top_covariance_token():
    logp = t([[-1.0, -2.0, -3.0, -4.0]])
    adv, mask = t([[2.0, 0.0, 0.0, -1.0]]), torch.ones(1, 4, dtype=D)
    # cov = (logp - mean)(A - mean) = [2.625, -0.125, 0.125, 1.875]
    params = params_for("clip_cov", clip_cov_ratio=0.25, clip_cov_lb=1.0, clip_cov_ub=5.0)
    loss, m = POLICY_LOSS_REGISTRY["clip_cov"](logp, logp.clone(), adv, mask, params=params)
    assert torch.allclose(loss, t([[0.0, 0.0, 0.0, 1.0]]))
    assert math.isclose(m["clip_cov_frac"].item(), 0.25)
    old = logp - t([[0.1, 0.0, 0.0, 0.0]])
    params = params_for("kl_cov", kl_cov_ratio=0.25, kl_cov_coef=2.0)
    loss, m = POLICY_LOSS_REGISTRY["kl_cov"](logp, old, adv, mask, params=params)
    assert torch.allclose(loss, t([[-2.0 * math.exp(0.1) + 2.0 * 0.1, 0.0, 0.0, 1.0]]))
    assert math.isclose(m["kl_cov_frac"].item(), 0.25)


def test_clip_cov_skips_tokens_the_ppo_clip_already_clipped():
    # Token 0 is the case that catches the bug: A = 1.028, ratio 1.698 > 1 + 0.2, so PPO already clipped it
    # (no gradient). Its covariance is the highest, but Clip-Cov must spend its one slot on
    # token 3, the live token with the next covariance in (lb, ub).
    logp = t([[-1.0, -2.0, -3.0, -4.0]])
    old = logp - t([[LN(1.698), 0.0, 0.0, 0.0]])
    adv, mask = t([[1.028, 0.0, 0.0, -0.8]]), torch.ones(1, 4, dtype=D)
    # mean logp -2.5, mean A 0.057: cov = (logp - mean)(A - mean) = [1.4565, -0.0285, 0.0285, 1.2855]
    cov = [1.5 * 0.971, 0.5 * -0.057, -0.5 * -0.057, -1.5 * -0.857]
    assert cov[0] > cov[3] > 1.0
    params = params_for("clip_cov", clip_cov_ratio=0.25, clip_cov_lb=1.0, clip_cov_ub=5.0)
    loss, grad, m = grad_wrt_logp(POLICY_LOSS_REGISTRY["clip_cov"], logp, old, adv, mask, params)
    assert torch.allclose(loss, t([[-1.2 * 1.028, 0.0, 0.0, 0.0]]))  # token 0 keeps its clipped loss
    assert torch.equal(grad, torch.zeros(1, 4, dtype=D))  # clipped token 0, detached token 3
    assert math.isclose(m["clip_cov_frac"].item(), 0.25)
    assert math.isclose(m["clip_frac"].item(), 0.25)


def test_clip_cov_bounds_are_strict():
    logp = t([[-1.0, -2.0, -3.0, -4.0]])
    adv, mask = t([[2.0, 0.0, 0.0, -1.0]]), torch.ones(1, 4, dtype=D)
    fn = POLICY_LOSS_REGISTRY["clip_cov"]
    # cov = [2.625, -0.125, 0.125, 1.875] exactly; token 0 sits on ub: not eligible, token 3 is.
    loss, m = fn(
        logp,
        logp.clone(),
        adv,
        mask,
        params=params_for("clip_cov", clip_cov_ratio=0.25, clip_cov_lb=1.0, clip_cov_ub=2.625),
    )
    assert torch.allclose(loss, t([[-2.0, 0.0, 0.0, 0.0]]))
    # Token 3 on lb as well: nothing eligible, the PPO loss is untouched.
    loss, m = fn(
        logp,
        logp.clone(),
        adv,
        mask,
        params=params_for("clip_cov", clip_cov_ratio=0.25, clip_cov_lb=1.875, clip_cov_ub=2.625),
    )
    assert torch.allclose(loss, t([[-2.0, 0.0, 0.0, 1.0]]))
    assert m["clip_cov_frac"].item() == 0.0


def test_cross_entropy_is_negative_logprob():
    logp = t([[-0.5, -2.0]])
    loss, m = POLICY_LOSS_REGISTRY["cross_entropy"](
        logp, logp, torch.zeros(1, 2, dtype=D), t([[1.0, 0.0]]), params=params_for("cross_entropy")
    )
    assert torch.allclose(loss, t([[0.5, 0.0]]))
    assert math.isclose(m["nll"].item(), 0.5)


def test_importance_sampling_is_the_unclipped_ratio_times_advantage():
    logp, old = t([[LN(1.5), LN(0.5), LN(3.0)]]), torch.zeros(1, 3, dtype=D)
    adv, mask = t([[1.0, -1.0, 2.0]]), torch.ones(1, 3, dtype=D)
    loss, grad, m = grad_wrt_logp(
        POLICY_LOSS_REGISTRY["importance_sampling"], logp, old, adv, mask, params_for("importance_sampling")
    )
    assert torch.allclose(loss, t([[-1.5, 0.5, -6.0]]))
    assert torch.allclose(grad, t([[-1.5, 0.5, -6.0]]))  # no clip: ratio 3 keeps its gradient
    assert math.isclose(m["ratio_mean"].item(), (1.5 + 0.5 + 3.0) / 3)


def test_rollout_is_keeps_the_open_band_and_ignores_old():
    # Ratios to the rollout policy: 1.2 (inside), 1.25 (on 1 + eps_high: dropped), 0.5 (on
    # 1 - eps_low: dropped), 2.0 (outside), 0.8 with A = 0. Old log-probs are garbage: unused.
    logp = t([[LN(1.2), LN(1.25), LN(0.5), LN(2.0), LN(0.8)]])
    rollout, old = torch.zeros(1, 5, dtype=D), torch.full((1, 5), -7.0, dtype=D)
    adv, mask = t([[1.0, 1.0, -1.0, 2.0, 0.0]]), torch.ones(1, 5, dtype=D)
    params = params_for("rollout_is", eps_clip_low=0.5, eps_clip_high=0.25)
    loss, grad, m = grad_wrt_logp(POLICY_LOSS_REGISTRY["rollout_is"], logp, old, adv, mask, params, rollout=rollout)
    # loss = -w A logp with w constant: value -1.2 * 1 * log 1.2, gradient -w A.
    assert torch.allclose(loss, t([[-1.2 * LN(1.2), 0.0, 0.0, 0.0, 0.0]]))
    assert torch.allclose(grad, t([[-1.2, 0.0, 0.0, 0.0, 0.0]]))
    assert math.isclose(m["clip_frac"].item(), 3 / 5)  # the zero-advantage token changed nothing
    with pytest.raises(ValueError, match=r"rollout_is.*rollout_logprobs"):
        POLICY_LOSS_REGISTRY["rollout_is"](logp, old, adv, mask, params=params)


def dppo_case(p, q, adv, **kw):
    """DPPO on tokens with current probabilities p and behaviour probabilities q."""
    logp, behaviour = t([[LN(x) for x in p]]), t([[LN(x) for x in q]])
    adv, mask = t([adv]), torch.ones(1, len(p), dtype=D)
    garbage_old = torch.full_like(logp, -9.0)  # with rollout log-probs given, old is unused
    return grad_wrt_logp(
        POLICY_LOSS_REGISTRY["dppo"], logp, garbage_old, adv, mask, params_for("dppo", **kw), rollout=behaviour
    )


def test_dppo_binary_tv_masks_only_moves_past_delta_in_the_advantage_direction():
    # (p, q, A): +0.3 with A > 0 masked; -0.3 with A > 0 kept; -0.3 with A < 0 masked;
    # +0.3 with A < 0 kept; exactly +0.25 = delta_high kept; A = 0 never masked.
    p, q = [0.9, 0.3, 0.3, 0.9, 0.75, 0.9], [0.6, 0.6, 0.6, 0.6, 0.5, 0.1]
    adv = [1.0, 1.0, -1.0, -1.0, 2.0, 0.0]
    loss, grad, m = dppo_case(p, q, adv, dppo_mask="binary_tv", dppo_delta_low=0.2, dppo_delta_high=0.25)
    r = [a / b for a, b in zip(p, q, strict=True)]
    keep = [0, 1, 0, 1, 1, 1]
    expected = t([[-ri * a * k for ri, a, k in zip(r, adv, keep, strict=True)]])
    assert torch.allclose(loss, expected) and torch.allclose(grad, expected)  # d/dlogp (-r A) = -r A
    assert math.isclose(m["clip_frac"].item(), 2 / 6)


def test_dppo_binary_kl_masks_by_the_bernoulli_kl():
    def kl(q, p):
        return q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))

    assert math.isclose(kl(0.6, 0.9), 0.3112386, rel_tol=1e-6)
    assert math.isclose(kl(0.6, 0.3), 0.1920420, rel_tol=1e-6)
    # (p, q, A): p > q, A > 0, KL 0.311 > 0.05: masked. p < q, A < 0, KL 0.192: masked.
    # p < q with A > 0 (moving away in the other direction): kept whatever the KL.
    # A small move, KL 0.00084 < 0.05: kept.
    p, q, adv = [0.9, 0.3, 0.3, 0.62], [0.6, 0.6, 0.6, 0.6], [1.0, -1.0, 1.0, 1.0]
    loss, _, m = dppo_case(p, q, adv, dppo_mask="binary_kl", dppo_delta_low=0.05, dppo_delta_high=0.05)
    r = [a / b for a, b in zip(p, q, strict=True)]
    assert torch.allclose(loss, t([[0.0, 0.0, -r[2], -r[3]]]))
    assert math.isclose(m["clip_frac"].item(), 2 / 4)
    # On the boundary: a bound just above the KL keeps the token, just below masks it.
    loss, _, _ = dppo_case([0.9], [0.6], [1.0], dppo_mask="binary_kl", dppo_delta_high=kl(0.6, 0.9) + 1e-9)
    assert math.isclose(loss.item(), -1.5)
    loss, _, _ = dppo_case([0.9], [0.6], [1.0], dppo_mask="binary_kl", dppo_delta_high=kl(0.6, 0.9) - 1e-9)
    assert loss.item() == 0.0


def test_dppo_binary_kl_keeps_a_kl_exactly_on_the_bound_and_never_masks_a_zero_advantage():
    from asyncrl.algo.is_losses import _binary_kl

    # The bound set to the very KL the loss computes (same float64 inputs): strict, so kept.
    lp, lq = t([LN(0.9)]), t([LN(0.6)])
    exact = _binary_kl(lq.exp(), lp.exp(), lq, lp).item()
    assert math.isclose(exact, 0.3112386, rel_tol=1e-6)
    loss, _, m = dppo_case([0.9], [0.6], [1.0], dppo_mask="binary_kl", dppo_delta_high=exact)
    assert math.isclose(loss.item(), -1.5) and m["clip_frac"].item() == 0.0
    # A = 0 with a KL of ~1.5 in either direction: never masked (its loss is 0 anyway; no mask counted).
    loss, _, m = dppo_case(
        [0.99, 0.05], [0.3, 0.6], [0.0, 0.0], dppo_mask="binary_kl", dppo_delta_low=0.01, dppo_delta_high=0.01
    )
    assert torch.equal(loss, t([[0.0, 0.0]])) and m["clip_frac"].item() == 0.0


def test_dppo_falls_back_to_old_logprobs_without_rollout():
    logp, old = t([[LN(0.9), LN(0.3)]]), t([[LN(0.6), LN(0.6)]])
    adv, mask = t([[1.0, 1.0]]), torch.ones(1, 2, dtype=D)
    loss, _ = POLICY_LOSS_REGISTRY["dppo"](logp, old, adv, mask, params=params_for("dppo"), rollout_logp=None)
    assert torch.allclose(loss, t([[0.0, -0.5]]))  # p - q = 0.3 > 0.2 masked; ratio 0.5 kept


def test_cispo_rollout_anchor_caps_the_rollout_ratio():
    logp, old, rollout = t([[LN(2.0), 0.0]]), t([[LN(2.0), 0.0]]), t([[0.0, LN(0.5)]])
    adv, mask = t([[1.0, 1.0]]), torch.ones(1, 2, dtype=D)
    params = params_for("cispo", cispo_eps_high=0.5, cispo_anchor="rollout")
    loss, grad, m = grad_wrt_logp(POLICY_LOSS_REGISTRY["cispo"], logp, old, adv, mask, params, rollout=rollout)
    # Against rollout the ratios are 2 (capped at 1.5) and 2 (capped): with the old anchor both are 1.
    assert torch.allclose(loss, t([[-1.5, -1.5]])) and torch.allclose(grad, t([[-1.5, -1.5]]))
    assert m["clip_frac"].item() == 1.0
    loss, _, _ = grad_wrt_logp(
        POLICY_LOSS_REGISTRY["cispo"], logp, old, adv, mask, params_for("cispo", cispo_eps_high=0.5), rollout=rollout
    )
    assert torch.allclose(loss, t([[-1.0, -1.0]]))
    with pytest.raises(ValueError, match="cispo_anchor='rollout' needs rollout_logprobs"):
        POLICY_LOSS_REGISTRY["cispo"](logp, old, adv, mask, params=params)
    with pytest.raises(ValueError, match="cispo_anchor"):
        params_for("cispo", cispo_anchor="bogus")
    # The config's builder names the field as the config spells it.
    with pytest.raises(ValueError, match="cispo_anchor='bogus'"):
        config.params_for("cispo", cispo_anchor="bogus")
    with pytest.raises(ValueError, match="dppo_mask='tv'"):
        config.params_for("dppo", dppo_mask="tv")


def test_corrected_policy_loss_hands_rollout_logprobs_to_losses_that_take_them():
    logp, old, rollout = t([[LN(1.1), 0.0]]), torch.zeros(1, 2, dtype=D), t([[0.0, LN(2.0)]])
    adv, mask = torch.ones(1, 2, dtype=D), torch.ones(1, 2, dtype=D)
    p = params_for("rollout_is")
    loss, _ = corrected_policy_loss(
        POLICY_LOSS_REGISTRY["rollout_is"], logp, old, rollout, adv, mask, params=p, correction=CorrectionParams()
    )
    assert torch.allclose(loss, t([[-1.1 * LN(1.1), 0.0]]))  # ratio 0.5 to rollout: outside the band
    rollout_cispo = params_for("cispo", cispo_anchor="rollout")
    with pytest.raises(ValueError, match="count it twice"):
        corrected_policy_loss(
            POLICY_LOSS_REGISTRY["cispo"],
            logp,
            old,
            rollout,
            adv,
            mask,
            params=rollout_cispo,
            correction=CorrectionParams(tis="token"),
        )
    # Masks still compose with the rollout anchor: the token mask drops the ratio-0.5 token.
    loss, m = corrected_policy_loss(
        POLICY_LOSS_REGISTRY["cispo"],
        logp,
        old,
        rollout,
        adv,
        mask,
        params=rollout_cispo,
        correction=CorrectionParams(token_mask_low=0.9, token_mask_high=1.15),
    )
    assert torch.allclose(loss, t([[-1.1, 0.0]]))
    assert math.isclose(m["token_masked_frac"].item(), 0.5)
    assert not takes_rollout_logprobs(POLICY_LOSS_REGISTRY["ppo"])


ALL = sorted(POLICY_LOSS_REGISTRY)


# cross_entropy ignores advantages; kl_cov adds a KL term that does not depend on A.
@pytest.mark.parametrize("name", [n for n in ALL if n not in ("cross_entropy", "kl_cov")])
def test_zero_advantages_give_zero_policy_gradient(name):
    logp, old = t([[-1.0, -0.5, -2.0]]), t([[-1.2, -0.4, -2.0]])
    _, grad, _ = grad_wrt_logp(
        POLICY_LOSS_REGISTRY[name], logp, old, torch.zeros(1, 3, dtype=D), torch.ones(1, 3, dtype=D), params_for(name)
    )
    assert torch.equal(grad, torch.zeros(1, 3, dtype=D))


@pytest.mark.parametrize("name", ALL)
def test_garbage_padding_one_token_rows_and_all_masked_rows(name):
    """Row 0: two tokens + padding; row 1: one token; row 2: all masked. Garbage must not matter."""
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    logp, old, adv = (
        t([[-1.0, -0.5, 0.0], [-0.7, 0.0, 0.0], [0, 0, 0]]),
        t([[-1.1, -0.3, 0.0], [-0.9, 0.0, 0.0], [0, 0, 0]]),
        t([[1.0, 1.0, 0], [-0.5, 0, 0], [0, 0, 0]]),
    )
    params = params_for(name, clip_cov_lb=-10.0, clip_cov_ratio=0.3) if name == "clip_cov" else params_for(name)
    clean_loss, clean_grad, clean_m = grad_wrt_logp(POLICY_LOSS_REGISTRY[name], logp, old, adv, mask, params)
    junk = mask == 0
    g_logp, g_old, g_adv = logp.clone(), old.clone(), adv.clone()
    g_logp[junk], g_old[junk], g_adv[junk] = 40.0, -1e4, 3e3
    loss, grad, m = grad_wrt_logp(POLICY_LOSS_REGISTRY[name], g_logp, g_old, g_adv, mask, params)
    assert torch.allclose((loss * mask), (clean_loss * mask))
    assert torch.allclose(grad * mask, clean_grad * mask) and torch.isfinite(grad).all()
    assert all(torch.isclose(m[k], clean_m[k]) for k in m)
    assert (loss[2] * mask[2]).abs().sum() == 0


@pytest.mark.parametrize("name", ALL)
def test_huge_log_ratio_gives_no_inf_or_nan(name):
    logp = t([[500.0, -500.0]]).requires_grad_(True)
    fn, old = POLICY_LOSS_REGISTRY[name], torch.zeros(1, 2, dtype=D)
    loss, m = fn(logp, old, t([[1.0, -1.0]]), torch.ones(1, 2, dtype=D), params=params_for(name), **behaviour(fn, old))
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in m.values())


def test_registry_names_match_config_and_import_paths_resolve():
    assert tuple(POLICY_LOSS_REGISTRY) == config.POLICY_LOSSES
    assert get_policy_loss("asyncrl.algo.losses:ppo") is POLICY_LOSS_REGISTRY["ppo"]
    with pytest.raises(ValueError, match="'nope'"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match=re.escape("cannot import module 'no_such_pkg.mod'")):
        get_policy_loss("no_such_pkg.mod:fn")
    with pytest.raises(ValueError, match="no callable 'missing'"):
        get_policy_loss("asyncrl.algo.losses:missing")


def test_correction_goes_through_the_shared_helper():
    logp, old, rollout = torch.zeros(2, 2, dtype=D), torch.zeros(2, 2, dtype=D), t([[-LN(3.0), 0.0], [0.0, 0.0]])
    adv, mask = torch.ones(2, 2, dtype=D), torch.ones(2, 2, dtype=D)
    fn, p = POLICY_LOSS_REGISTRY["ppo"], params_for("ppo")
    loss, m = corrected_policy_loss(
        fn, logp, old, rollout, adv, mask, params=p, correction=CorrectionParams(tis="token", tis_cap=2.0)
    )
    assert torch.allclose(loss, t([[-2.0, -1.0], [-1.0, -1.0]]))
    assert math.isclose(m["tis_capped_frac"].item(), 0.25)
    loss, m = corrected_policy_loss(
        fn, logp, old, rollout, adv, mask, params=p, correction=CorrectionParams(geo_mask=True)
    )
    assert torch.allclose(loss, t([[0.0, 0.0], [-1.0, -1.0]]))
    assert math.isclose(m["masked_frac"].item(), 0.5)
    # GMPO: sequence TIS scales the whole sequence objective; token TIS is refused.
    gm = POLICY_LOSS_REGISTRY["gmpo"]
    loss, _ = corrected_policy_loss(
        gm,
        logp,
        old,
        rollout,
        adv,
        mask,
        params=params_for("gmpo"),
        correction=CorrectionParams(tis="sequence", tis_cap=5.0),
        sequence_level=True,
    )
    assert torch.allclose(loss, t([[-3.0, -3.0], [-1.0, -1.0]]))
    with pytest.raises(ValueError, match="token TIS"):
        corrected_policy_loss(
            gm,
            logp,
            old,
            rollout,
            adv,
            mask,
            params=params_for("gmpo"),
            correction=CorrectionParams(tis="token"),
            sequence_level=True,
        )
    with pytest.raises(ValueError, match="rollout_logprobs"):
        corrected_policy_loss(fn, logp, old, None, adv, mask, params=p, correction=CorrectionParams(tis="token"))


# ----------------------------------------------------------------------------- microbatch_loss


def small_mb():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 6, generator=g, dtype=D)
    ids = torch.tensor([[1, 2, 3, 4], [5, 0, 1, 0]])
    mask = t([[0, 0, 1, 1], [0, 1, 1, 0]])
    mb = {
        "input_ids": ids,
        "loss_mask": mask,
        "reduction_weights": mask / 4,
        "old_logprobs": t([[0, 0, -1.5, -2.0], [0, -1.0, -2.2, 0]]),
        "rollout_logprobs": t([[0, 0, -1.4, -2.1], [0, -1.1, -2.0, 0]]),
        "advantages": t([[0, 0, 1.0, 1.0], [0, -0.5, -0.5, 0]]),
        "ref_logprobs": t([[0, 0, -1.0, -1.0], [0, -1.0, -1.0, 0]]),
    }
    return logits, mb


def test_token_logprobs_alignment_and_temperature():
    logits, mb = small_mb()
    lp = token_logprobs(logits, mb["input_ids"], 0.5)
    assert torch.equal(lp[:, 0], torch.zeros(2, dtype=D))
    expected = torch.log_softmax(logits[1, 1] / 0.5, dim=-1)[1]  # position 2 predicted from logits at 1
    assert math.isclose(lp[1, 2].item(), expected.item(), rel_tol=1e-12)


def test_microbatch_loss_equals_the_hand_assembled_sum():
    logits, mb = small_mb()
    algo = AlgoConfig(
        kl_coef=0.1,
        kl_estimator="k2",
        rollout_kl_coef=0.2,
        rollout_kl_estimator="k1",
        entropy_coef=0.01,
        correction=CorrectionConfig(tis="token", tis_cap=2.0),
    )
    loss, m = microbatch_loss(logits, mb, algo, temperature=1.0)
    lp = token_logprobs(logits, mb["input_ids"], 1.0)
    mask, w = mb["loss_mask"], mb["reduction_weights"]
    r = torch.exp(lp - mb["old_logprobs"])
    ppo = torch.maximum(-mb["advantages"] * r, -mb["advantages"] * r.clamp(0.8, 1.2))
    tis = torch.exp(mb["old_logprobs"] - mb["rollout_logprobs"]).clamp(max=2.0)
    p = torch.softmax(logits, -1)
    ent = torch.nn.functional.pad(-(p * torch.log(p)).sum(-1)[:, :-1], (1, 0))
    kl = 0.5 * (lp - mb["ref_logprobs"]) ** 2
    rkl = lp - mb["rollout_logprobs"]
    expected = (w * mask * (ppo * tis + 0.1 * kl + 0.2 * rkl - 0.01 * ent)).sum()
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-10)
    assert math.isclose(m["loss/policy"].total.item(), (w * mask * ppo * tis).sum().item(), rel_tol=1e-10)
    assert m["loss/policy"].reduce == "sum" and m["loss/kl_ref"].reduce == "sum"
    assert m["drift/tis_ratio_max"].reduce == "max"
    assert m["drift/tis_ratio_mean"].reduce == "mean" and m["drift/tis_ratio_mean"].count.item() == 4
    mean_diff = ((lp - mb["rollout_logprobs"]).abs() * mask).sum() / 4
    assert math.isclose(m["drift/abs_logp_diff"].value.item(), mean_diff.item(), rel_tol=1e-10)
    assert math.isclose(m["policy/entropy"].value.item(), ((ent * mask).sum() / 4).item(), rel_tol=1e-10)
    assert {"policy/clip_frac", "drift/rollout_kl", "drift/masked_frac", "loss/rollout_kl", "loss/entropy"} <= set(m)


@pytest.mark.parametrize(
    "field, algo",
    [
        ("ref_logprobs", AlgoConfig(kl_coef=0.1)),
        ("rollout_logprobs", AlgoConfig(correction=CorrectionConfig(tis="token"))),
        ("rollout_logprobs", AlgoConfig(rollout_kl_coef=0.1)),
        ("advantages", AlgoConfig()),
        ("reduction_weights", AlgoConfig(policy_loss="cross_entropy")),
    ],
)
def test_missing_fields_are_named(field, algo):
    logits, mb = small_mb()
    del mb[field]
    with pytest.raises(ValueError, match=f"missing field '{field}'"):
        microbatch_loss(logits, mb, algo, temperature=1.0)


def test_all_masked_microbatch_is_zero_and_finite():
    logits, mb = small_mb()
    mb["loss_mask"] = torch.zeros_like(mb["loss_mask"])
    loss, m = microbatch_loss(logits, mb, AlgoConfig(correction=CorrectionConfig(tis="token")), temperature=1.0)
    assert loss.item() == 0.0
    assert all(torch.isfinite(torch.as_tensor(v.total)) for v in m.values())
    # No extremes from an empty micro-batch: a 0 would win every merged min.
    assert "drift/tis_ratio_min" not in m and "drift/tis_ratio_max" not in m
    assert m["drift/tis_ratio_mean"].count == 0


def test_configured_loss_settings_reach_the_loss():
    """The config's loss section is the loss's params object (one definition, no mirror); the
    config's correction is the algo layer's CorrectionParams with an 'auto' default for tis."""
    from asyncrl.learner.loss import correction_params

    corr = CorrectionConfig()
    assert isinstance(corr, CorrectionParams)
    for name, field in CorrectionParams.model_fields.items():
        if name == "tis":  # 'auto' is resolved by the config (token TIS for this loss)
            assert (corr.tis, AlgoConfig().correction.tis) == ("auto", "token")
            continue
        assert getattr(corr, name) == field.default, name
    cfg = config.load_config(
        None,
        [
            "algo.policy_loss.eps_clip_high=0.28",
            "algo.correction.tis=sequence",
            "algo.correction.tis_cap=3.5",
        ],
    )
    assert (correction_params(cfg.algo).tis, correction_params(cfg.algo).tis_cap) == ("sequence", 3.5)
    # The configured clip range is the one the loss applies: ratio 1.3 with A > 0 clips at 1.28.
    logits, mb = small_mb()
    lp = token_logprobs(logits, mb["input_ids"], 1.0)
    mb["old_logprobs"] = lp.detach() - LN(1.3)
    mb["rollout_logprobs"] = mb["old_logprobs"]
    mb["advantages"] = torch.ones_like(lp)
    _, m = microbatch_loss(logits, mb, cfg.algo, temperature=1.0)
    mask = mb["loss_mask"]
    expected = -(mb["reduction_weights"] * mask * 1.28).sum()
    assert math.isclose(m["loss/policy"].total.item(), expected.item(), rel_tol=1e-9)


def test_correction_metrics_are_catalogued_and_row_fractions_merge_over_rows():
    from asyncrl.monitor import metrics as M

    logits, mb = small_mb()
    mb["rollout_logprobs"] = mb["rollout_logprobs"].clone()
    mb["rollout_logprobs"][1, 1] = -3.0  # row 1's token 1: ratio exp(2) = 7.4, outside every band
    corr = CorrectionConfig(
        tis="sequence",
        tis_cap=2.0,
        outlier_mask=True,
        outlier_low=0.01,
        outlier_high=5.0,
        token_mask_low=0.5,
        token_mask_high=2.0,
        geo_mask=True,
        product_mask=True,
    )
    _, m = microbatch_loss(logits, mb, AlgoConfig(correction=corr), temperature=1.0)
    drift = {k for k in m if k.startswith("drift/")}
    assert {
        "drift/outlier_seq_masked_frac",
        "drift/token_masked_frac",
        "drift/tis_seq_capped_frac",
        "drift/geo_seq_masked_frac",
        "drift/product_seq_masked_frac",
    } <= drift
    assert all(M.is_known(k) for k in drift), sorted(k for k in drift if not M.is_known(k))
    # Two rows carry loss tokens (4 tokens): row fractions count rows, token fractions tokens.
    assert m["drift/outlier_seq_masked_frac"].count.item() == 2
    assert m["drift/outlier_seq_masked_frac"].value.item() == 0.5
    assert m["drift/outlier_masked_frac"].count.item() == 4
    assert m["drift/outlier_masked_frac"].value.item() == 0.5
