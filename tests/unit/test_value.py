"""The critic's math (asyncrl.algo.value) and GAE (asyncrl.algo.advantages.gae) against formulas
written from the papers: hand-computed small cases and a float64 brute force.

GAE (Schulman et al. 2016, arXiv:1506.02438, eq. 16): A_t = sum_l (gamma lam)^l delta_{t+l},
delta_t = r_t + gamma V_{t+1} - V_t, V after the terminal step 0. Time steps are the policy's
tokens; observation tokens of a multi-turn sample (mask 0) are not steps.
Value loss (PPO2 baselines): 0.5 max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2).
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.algo.advantages import AdvantageParams, gae
from asyncrl.algo.value import clipped_value_loss, explained_variance, gae_returns, moments, whiten

D = torch.float64


def run_gae(r, v, mask, gamma, lam):
    r, v, mask = (torch.tensor(x, dtype=D) for x in (r, v, mask))
    if r.dim() == 1:
        r, v, mask = r[None], v[None], mask[None]
    return gae(
        torch.zeros(r.shape[0], dtype=D),
        torch.arange(r.shape[0]),
        mask,
        params=AdvantageParams(gamma=gamma, lam=lam),
        token_rewards=r,
        values=v,
    )


def brute_gae(r, v, mask, gamma, lam):
    """The paper's sum, term by term, over the policy steps alone (float64)."""
    steps = [t for t, m in enumerate(mask) if m > 0]
    out = [0.0] * len(mask)
    for i, t in enumerate(steps):
        total = 0.0
        for j, k in enumerate(steps[i:]):
            v_next = v[steps[i + j + 1]] if i + j + 1 < len(steps) else 0.0
            delta = r[k] + gamma * v_next - v[k]
            total += (gamma * lam) ** j * delta
        out[t] = total
    return out


def test_gae_by_hand_three_steps():
    # r = (0, 0, 1), V = (0.5, 0.6, 0.7), gamma = 0.9, lam = 0.8
    # delta = (0 + .9*.6 - .5, 0 + .9*.7 - .6, 1 - .7) = (0.04, 0.03, 0.3)
    # A_2 = 0.3; A_1 = 0.03 + .72 * 0.3 = 0.246; A_0 = 0.04 + .72 * 0.246 = 0.21712
    adv = run_gae([0, 0, 1], [0.5, 0.6, 0.7], [1, 1, 1], 0.9, 0.8)
    torch.testing.assert_close(adv[0], torch.tensor([0.21712, 0.246, 0.3], dtype=adv.dtype))


def test_gae_steps_over_observation_tokens():
    # Policy tokens at 1, 2, 5 (prompt at 0, an observation at 3-4): the observation's values
    # and rewards are not steps; V_next of step 2 is V_5, and gamma counts policy steps.
    r = [0, 0, 0, 9, 9, 1]
    v = [7, 0.5, 0.6, 7, 7, 0.7]
    mask = [0, 1, 1, 0, 0, 1]
    adv = run_gae(r, v, mask, 0.9, 0.8)[0]
    torch.testing.assert_close(adv, torch.tensor([0, 0.21712, 0.246, 0, 0, 0.3], dtype=adv.dtype))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.97, 0.95), (0.9, 0.0), (1.0, 0.5)])
def test_gae_matches_brute_force(gamma, lam):
    g = torch.Generator().manual_seed(0)
    n, t = 5, 9
    r = torch.randn(n, t, generator=g, dtype=D)
    v = torch.randn(n, t, generator=g, dtype=D)
    mask = (torch.rand(n, t, generator=g) > 0.35).to(D)
    mask[0] = 0  # a sample with no policy token (a failed one): all zero
    got = run_gae(r.tolist(), v.tolist(), mask.tolist(), gamma, lam).to(D)
    want = torch.tensor(
        [brute_gae(r[i].tolist(), v[i].tolist(), mask[i].tolist(), gamma, lam) for i in range(n)], dtype=D
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_gae_gamma1_lam1_is_return_minus_value():
    # A_t = sum_{k>=t} r_k - V_t (the Monte-Carlo return minus the baseline).
    r, v, mask = [0, 0.5, 0, 2.0], [1.0, -1.0, 0.25, 3.0], [1, 1, 0, 1]
    adv = run_gae(r, v, mask, 1.0, 1.0)[0].tolist()
    assert adv == pytest.approx([2.5 - 1.0, 2.5 + 1.0, 0.0, 2.0 - 3.0])


def test_gae_lambda0_is_one_step_td():
    r, v, mask = [0.1, 0.2, 0.3, 0.4], [1.0, 2.0, 3.0, 4.0], [1, 1, 0, 1]
    adv = run_gae(r, v, mask, 0.5, 0.0)[0].tolist()
    # delta_t = r_t + gamma V_next - V_t with next = next policy token (3 after 1), 0 after the last
    assert adv == pytest.approx([0.1 + 0.5 * 2 - 1, 0.2 + 0.5 * 4 - 2, 0.0, 0.4 - 4])


def test_returns_are_advantage_plus_value_on_the_mask():
    adv = torch.tensor([[1.0, 2.0, 3.0]], dtype=D)
    v = torch.tensor([[0.5, 0.5, 9.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=D)
    assert gae_returns(adv, v, mask).tolist() == [[1.5, 2.5, 0.0]]


def test_clipped_value_loss_by_hand():
    # eps = 0.2, R = 1. V_old = 0.
    #   V = 0.1: inside the clip range: both terms (0.9^2), loss 0.405, not clipped
    #   V = 0.5: V_clip = 0.2, (0.5-1)^2 = .25 < (0.2-1)^2 = .64: loss 0.32, clipped
    #   V = 1.5: V_clip = 0.2: .25 < .64: loss .32, clipped (overshoot also held back)
    #   V = -0.5: V_clip = -0.2: 2.25 > 1.44: loss 1.125, unclipped term is the max
    #   masked position: 0
    v = torch.tensor([[0.1, 0.5, 1.5, -0.5, 5.0]], dtype=D, requires_grad=True)
    old = torch.zeros(1, 5, dtype=D)
    ret = torch.ones(1, 5, dtype=D)
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=D)
    loss, clipped = clipped_value_loss(v, old, ret, mask, clip=0.2)
    torch.testing.assert_close(loss[0], torch.tensor([0.405, 0.32, 0.32, 1.125, 0.0], dtype=D))
    assert clipped[0].tolist() == [False, True, True, False, False]
    loss.sum().backward()
    # Where the clipped term wins its gradient is 0 (V_clip is constant in V there).
    assert v.grad is not None
    torch.testing.assert_close(v.grad[0], torch.tensor([-0.9, 0.0, 0.0, -1.5, 0.0], dtype=D))


def test_value_loss_without_clip_is_half_squared_error():
    v = torch.tensor([[3.0, 0.0]], dtype=D)
    loss, clipped = clipped_value_loss(v, torch.zeros_like(v), torch.ones_like(v), torch.ones_like(v), clip=None)
    assert loss.tolist() == [[2.0, 0.5]] and not clipped.any()


def test_whiten_over_moments_of_several_parts_equals_whole():
    """Moments summed over ranks whiten as the whole batch would (sample std)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 7, generator=g, dtype=D)
    mask = (torch.rand(6, 7, generator=g) > 0.3).to(D)
    parts = [moments(x[i : i + 2], mask[i : i + 2]) for i in range(0, 6, 2)]
    stats = sum(parts[1:], parts[0])
    got = torch.cat([whiten(x[i : i + 2], mask[i : i + 2], stats) for i in range(0, 6, 2)])
    live = x[mask > 0]
    want = torch.where(mask > 0, (x - live.mean()) / (live.std() + 1e-8), torch.zeros_like(x))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("noise,expected", [(0.0, 1.0), (None, 0.0)])
def test_explained_variance(noise, expected):
    ret = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=D)
    mask = torch.ones_like(ret)
    values = ret.clone() if noise is not None else torch.full_like(ret, ret.mean().item())
    ev = explained_variance(moments(ret, mask), moments(ret - values, mask))
    assert ev == pytest.approx(expected)


def test_explained_variance_brute_force():
    g = torch.Generator().manual_seed(2)
    ret, v = torch.randn(4, 5, generator=g, dtype=D), torch.randn(4, 5, generator=g, dtype=D)
    mask = torch.ones_like(ret)
    mask[1, 2:] = 0
    live = mask > 0
    want = 1 - (ret - v)[live].var() / ret[live].var()
    assert explained_variance(moments(ret, mask), moments(ret - v, mask)) == pytest.approx(float(want))
