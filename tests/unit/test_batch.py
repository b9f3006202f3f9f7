"""Driver-side batch assembly: advantages, whole-group mini-batches, reduction weights, layout.

.venv/bin/python -m pytest tests/unit/test_batch.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from asyncrl.config import AlgoConfig
from asyncrl.data.batch import build_minibatches
from asyncrl.types import RolloutGroup, Sample

A = 0.5 / math.sqrt(0.5)  # grpo: rewards {1, 0} -> mean 0.5, sample std sqrt(0.5)


def sample(resp, reward, mask=None, lp=None, version=3, **kw):
    n = len(resp)
    return Sample(
        response_ids=resp,
        rollout_logprobs=lp if lp is not None else -0.1 * np.ones(n),
        loss_mask=mask if mask is not None else np.ones(n),
        reward=reward,
        behavior_version=version,
        **kw,
    )


def make_groups():
    g0 = RolloutGroup(
        "g0",
        "p0",
        np.array([5, 6]),
        [
            sample([7, 8, 9], 1.0, lp=np.array([-0.1, -0.2, -0.3]), token_versions=np.array([3, 4, 4])),
            sample([7], 0.0, version=4),
            sample([8, 8], float("nan"), error="reward function timed out"),
        ],
    )
    g1 = RolloutGroup(
        "g1", "p1", np.array([4]), [sample([3, 3], 2.0), sample([2, 2, 2], 2.0, mask=np.array([1, 0, 1]))]
    )
    g2 = RolloutGroup("g2", "p2", np.array([4, 4, 4]), [sample([1], 0.5), sample([2], 1.5)])
    return [g0, g1, g2]


def test_layout_advantages_weights_and_failed_samples():
    (mb0, mb1), metrics = build_minibatches(make_groups(), AlgoConfig(), num_minibatches=2)
    assert [s.group_id for s in mb0] == ["g0"] * 3 + ["g1"] * 2 and [s.group_id for s in mb1] == ["g2"] * 2
    s = mb0[0]
    assert s.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert s.loss_mask.tolist() == [0, 0, 1, 1, 1]
    np.testing.assert_allclose(s.rollout_logprobs, [0, 0, -0.1, -0.2, -0.3], rtol=1e-6)
    np.testing.assert_allclose(s.advantages, [0, 0, A, A, A], rtol=1e-5)
    assert s.token_versions.tolist() == [3, 3, 3, 4, 4] and s.behavior_version == 3
    # token_mean over mini-batch 0: 3 + 1 (+ 0 for the failed sample) + 2 + 2 = 8 tokens.
    np.testing.assert_allclose(s.reduction_weights, [0, 0, 1 / 8, 1 / 8, 1 / 8], rtol=1e-6)
    np.testing.assert_allclose(mb0[1].advantages, [0, 0, -A], rtol=1e-5)
    assert mb0[1].token_versions.tolist() == [4, 4, 4]
    failed = mb0[2]
    assert failed.loss_mask.sum() == 0 and failed.advantages.sum() == 0 and failed.reduction_weights.sum() == 0
    # Equal rewards: zero advantage; the masked observation token gets no weight.
    assert mb0[4].advantages.tolist() == [0, 0, 0, 0] and mb0[4].reduction_weights.tolist() == [0, 0.125, 0, 0.125]
    np.testing.assert_allclose([x.advantages[-1] for x in mb1], [-A, A], rtol=1e-5)
    np.testing.assert_allclose(mb1[0].reduction_weights, [0, 0, 0, 0.5])
    assert metrics["reward/mean"] == pytest.approx(7 / 6)
    assert metrics["reward/num_failed"] == 1.0
    assert metrics["response/length_mean"] == pytest.approx(13 / 7)
    assert metrics["batch/num_loss_tokens"] == 10.0 and metrics["batch/num_sequences"] == 7.0


def test_weights_sum_to_one_per_minibatch_for_each_mean_reduction():
    for reduction, expected_first in (("sequence_mean", 1 / (4 * 3)), ("token_mean", 1 / 8)):
        (mb0, mb1), _ = build_minibatches(make_groups(), AlgoConfig(loss_reduction=reduction), num_minibatches=2)
        assert sum(s.reduction_weights.sum() for s in mb0) == pytest.approx(1.0, abs=1e-6)
        assert sum(s.reduction_weights.sum() for s in mb1) == pytest.approx(1.0, abs=1e-6)
        assert mb0[0].reduction_weights[-1] == pytest.approx(expected_first)
    algo = AlgoConfig(loss_reduction="seq_mean_token_sum_norm", reduction_constant=10.0)
    (mb0, _), _ = build_minibatches(make_groups(), algo, num_minibatches=2)
    assert mb0[0].reduction_weights[-1] == pytest.approx(1 / 40)


def test_other_estimators_reach_the_sequences():
    (mb,), _ = build_minibatches(make_groups(), AlgoConfig(advantage_estimator="maxrl"), num_minibatches=1)
    # g2: rewards 0.5, 1.5, mean 1: 0.5/1 - 1 = -0.5 and 0.5.
    np.testing.assert_allclose([mb[5].advantages[-1], mb[6].advantages[-1]], [-0.5, 0.5], rtol=1e-5)
    (mb,), _ = build_minibatches(make_groups(), AlgoConfig(advantage_estimator="reinforce_pp"), num_minibatches=1)
    live = np.concatenate([s.advantages[s.loss_mask > 0] for s in mb])
    assert abs(live.mean()) < 1e-5 and live.std(ddof=1) == pytest.approx(1.0, rel=1e-4)


def test_bad_input_is_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="3 groups cannot fill num_minibatches=4"):
        build_minibatches(make_groups(), AlgoConfig(), num_minibatches=4)
    with pytest.raises(ValueError, match="num_minibatches=0"):
        build_minibatches(make_groups(), AlgoConfig(), num_minibatches=0)
    bad = make_groups()
    bad[1].samples[0].rollout_logprobs = np.zeros(5, dtype=np.float32)
    with pytest.raises(ValueError, match="group 'g1' sample 0: rollout_logprobs"):
        build_minibatches(bad, AlgoConfig(), num_minibatches=1)
    with pytest.raises(ValueError, match="gae"):
        build_minibatches(make_groups(), AlgoConfig(advantage_estimator="gae"), num_minibatches=1)


def test_a_batch_where_every_reward_failed_trains_on_nothing_and_says_so():
    groups = [RolloutGroup("g", "p", np.array([1]), [sample([2, 3], float("nan")), sample([4], float("inf"))])]
    (mb,), metrics = build_minibatches(groups, AlgoConfig(loss_reduction="sequence_mean"), num_minibatches=1)
    assert all(s.loss_mask.sum() == 0 and s.reduction_weights.sum() == 0 and s.advantages.sum() == 0 for s in mb)
    assert metrics["reward/num_failed"] == 2.0 and "reward/mean" not in metrics
    assert metrics["batch/num_loss_tokens"] == 0.0


def test_reinforce_pp_mixes_token_rewards_and_outcome_rewards():
    g = RolloutGroup(
        "g",
        "p",
        np.array([1]),
        [
            sample([2, 3], 0.0, token_rewards=np.array([1.0, 0.0])),  # returns (gamma 1): [1, 0]
            sample([4, 5], 2.0),  # outcome on the last token: [2, 2]
        ],
    )
    (mb,), _ = build_minibatches([g], AlgoConfig(advantage_estimator="reinforce_pp"), num_minibatches=1)
    returns = np.array([1.0, 0.0, 2.0, 2.0])
    expected = (returns - returns.mean()) / returns.std(ddof=1)
    np.testing.assert_allclose(np.concatenate([s.advantages[1:] for s in mb]), expected, rtol=1e-5)


def test_critic_batches_carry_token_rewards_not_advantages():
    """algo.critic: the learner computes GAE, so the driver sends each sequence's reward on its
    last policy token (observation tokens after it get none), 0 for a failed sample, and
    advantages 0; the soft overlong penalty lands on the last policy token too."""
    algo = AlgoConfig(
        advantage_estimator="gae",
        critic={"enabled": True},
        overlong={"soft_penalty": {"buffer": 2, "coef": 1.0}},
    )
    groups = [
        RolloutGroup(
            "g0",
            "p0",
            np.array([1, 2]),
            [
                sample([5, 6, 7, 8], 1.0, mask=[1, 1, 0, 0]),  # an observation after the last policy token
                sample([5, 6, 7], math.nan, error="boom"),
            ],
        )
    ]
    (mb,), metrics = build_minibatches(groups, algo, num_minibatches=1, max_new_tokens=5)
    ok, failed = mb
    # The driver's advantages are all 0 here: reporting their mean (0) would read as no signal.
    assert not any(k.startswith("advantages/") for k in metrics) and "reward/mean" in metrics
    assert ok.token_rewards is not None and failed.token_rewards is not None
    # 4 tokens of a 5-token budget: the soft penalty (buffer 2, from 3 tokens) is -(4 - 3) / 2
    assert ok.token_rewards.tolist() == [0, 0, 0, 1.0 - 0.5, 0, 0]
    assert not failed.token_rewards.any() and not ok.advantages.any() and not failed.loss_mask.any()
