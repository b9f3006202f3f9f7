"""Advantage estimators against hand-computed values.

.venv/bin/python -m pytest tests/unit/test_advantages.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl import config
from asyncrl.algo import ADVANTAGE_REGISTRY, AdvantageParams, get_advantage_estimator

D = torch.float64
# Group 0: rewards 1, 0, 0, 1 (mean 0.5, sample std sqrt(1/3)); group 1: one sample;
# group 2: equal rewards. Group ids need not be contiguous or sorted.
REWARDS = torch.tensor([1.0, 0.0, 5.0, 0.0, 1.0, 2.0, 2.0], dtype=D)
GROUPS = torch.tensor([7, 7, 3, 7, 7, 9, 9])
# Varying lengths; the padding (0) must stay 0 in the output.
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]], dtype=D)


def scores(name: str, rewards=REWARDS, groups=GROUPS, **params) -> list[float]:
    adv = ADVANTAGE_REGISTRY[name](rewards, groups, MASK[: len(rewards)], params=AdvantageParams(**params))
    assert torch.equal(adv * (1 - MASK[: len(rewards)]), torch.zeros_like(adv)), "padding must stay 0"
    rows = [float(adv[i, 0]) for i in range(len(rewards))]
    for i in range(len(rewards)):  # an outcome estimator: the same value on every mask token
        assert torch.allclose(adv[i][MASK[i] > 0], torch.full_like(adv[i][MASK[i] > 0], rows[i]))
    return rows


def test_grpo_with_std():
    a = 0.5 / math.sqrt(1 / 3)
    assert scores("grpo") == pytest.approx([a, -a, 0.0, -a, a, 0.0, 0.0], abs=1e-5)


def test_grpo_without_std_and_dr_grpo():
    expected = [0.5, -0.5, 0.0, -0.5, 0.5, 0.0, 0.0]
    assert scores("grpo", norm_std=False) == pytest.approx(expected, abs=1e-12)
    assert scores("dr_grpo") == pytest.approx(expected, abs=1e-12)


def test_rloo_leave_one_out():
    # r=1: 1 - (0 + 0 + 1) / 3 = 2/3; r=0: 0 - 2/3.
    assert scores("rloo") == pytest.approx([2 / 3, -2 / 3, 0.0, -2 / 3, 2 / 3, 0.0, 0.0], abs=1e-12)


def test_maxrl_divides_by_the_group_mean():
    assert scores("maxrl") == pytest.approx([1.0, -1.0, 0.0, -1.0, 1.0, 0.0, 0.0], abs=1e-5)
    # One success in four: 1/0.25 - 1 = 3 and -1; an all-zero group gets 0 (no division by 0).
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=D)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    assert scores("maxrl", rewards, groups) == pytest.approx([3.0, -1.0, -1.0, -1.0, 0.0, 0.0, 0.0], rel=1e-5)


def test_maxrl_zeroes_every_group_whose_mean_is_not_positive():
    # Group 0 (mean -0.1/3 < 0, a length penalty's doing): 0, not a sign-flipped ratio.
    # Group 1 (mean 0.2): (0.5 - 0.2)/0.2 = 1.5 and (-0.1 - 0.2)/0.2 = -1.5: a negative reward still counts.
    rewards = torch.tensor([-0.2, 0.1, 0.0, 0.5, -0.1], dtype=D)
    groups = torch.tensor([0, 0, 0, 1, 1])
    assert scores("maxrl", rewards, groups) == pytest.approx([0.0, 0.0, 0.0, 1.5, -1.5], rel=1e-5)


def test_zero_rewards_give_zero_advantages_everywhere():
    zeros = torch.zeros(7, dtype=D)
    for name in ("grpo", "dr_grpo", "rloo", "maxrl"):
        assert scores(name, zeros) == [0.0] * 7


def test_reinforce_pp_discounted_returns_and_global_normalisation():
    rewards = torch.tensor([1.0, 0.0], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)
    adv = ADVANTAGE_REGISTRY["reinforce_pp"](rewards, torch.tensor([0, 1]), mask, params=AdvantageParams(gamma=0.5))
    # returns: [0.25, 0.5, 1] and [0, 0]; mean 0.35, sample std sqrt(0.7 / 4)
    std = math.sqrt(0.7 / 4)
    expected = torch.tensor([[-0.1, 0.15, 0.65], [-0.35, -0.35, 0.0]], dtype=D) / std * mask
    assert torch.allclose(adv.to(D), expected, atol=1e-5)


def test_reinforce_pp_token_rewards_skip_unmasked_gaps():
    mask = torch.tensor([[1, 0, 1]], dtype=D)
    token_rewards = torch.tensor([[1.0, 9.0, 2.0]], dtype=D)  # the 9 sits on an observation token
    # returns with gamma 0.5: [1 + 0.5 * 2, -, 2] = [2, 0, 2]; mean 2, std 0 -> all 0
    adv = ADVANTAGE_REGISTRY["reinforce_pp"](
        torch.zeros(1, dtype=D),
        torch.zeros(1, dtype=torch.long),
        mask,
        params=AdvantageParams(gamma=0.5),
        token_rewards=token_rewards,
    )
    assert torch.equal(adv, torch.zeros(1, 3, dtype=D))


def test_gae_by_hand():
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=D)
    values = torch.tensor([[0.5, 0.2, 0.4], [0.5, 99.0, 0.4]], dtype=D)
    adv = ADVANTAGE_REGISTRY["gae"](
        torch.tensor([1.0, 1.0], dtype=D),
        torch.tensor([0, 0]),
        mask,
        params=AdvantageParams(gamma=1.0, lam=0.5),
        values=values,
    )
    # Row 0: deltas [-0.3, 0.2, 0.6] -> A = [-0.3 + 0.5 * 0.5, 0.2 + 0.5 * 0.6, 0.6] = [-0.05, 0.5, 0.6]
    # Row 1: the unmasked middle token is skipped: delta0 = 0 + 0.4 - 0.5 = -0.1, A0 = -0.1 + 0.5 * 0.6
    expected = torch.tensor([[-0.05, 0.5, 0.6], [0.2, 0.0, 0.6]], dtype=D)
    assert torch.allclose(adv.to(D), expected, atol=1e-12)
    with pytest.raises(ValueError, match="values"):
        ADVANTAGE_REGISTRY["gae"](torch.ones(2, dtype=D), torch.tensor([0, 0]), mask, params=AdvantageParams())


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="NaN"):
        scores("grpo", torch.tensor([1.0, float("nan"), 0, 0, 0, 0, 0], dtype=D))
    with pytest.raises(ValueError, match=r"\[N\]"):
        ADVANTAGE_REGISTRY["grpo"](REWARDS, GROUPS[:3], MASK, params=AdvantageParams())


def test_registry_names_match_config_and_import_paths_resolve():
    assert tuple(ADVANTAGE_REGISTRY) == config.ADVANTAGE_ESTIMATORS
    assert get_advantage_estimator("asyncrl.algo.advantages:rloo") is ADVANTAGE_REGISTRY["rloo"]
    with pytest.raises(ValueError, match="'bogus'"):
        get_advantage_estimator("bogus")
    with pytest.raises(ValueError, match="no callable"):
        get_advantage_estimator("asyncrl.algo.advantages:nothing_here")


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "maxrl", "reinforce_pp"])
def test_all_masked_and_one_token_rows(name):
    rewards = torch.tensor([1.0, 0.0, 3.0], dtype=D)
    mask = torch.tensor([[0, 0], [1, 0], [1, 1]], dtype=D)  # all-masked, one token, two tokens
    adv = ADVANTAGE_REGISTRY[name](rewards, torch.tensor([0, 0, 0]), mask, params=AdvantageParams())
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[0], torch.zeros(2, dtype=adv.dtype))
    assert adv[1, 0] != 0 and adv[1, 1] == 0
