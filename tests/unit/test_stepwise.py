"""Step-wise trajectories: advantage broadcast on each step's own mask, and prefix merging.

.venv/bin/python -m pytest tests/unit/test_stepwise.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.algo import broadcast_trajectory_advantages, merge_prefix_steps
from asyncrl.config import AlgoConfig
from asyncrl.data.batch import build_minibatches
from asyncrl.types import RolloutGroup, Sample

D = torch.float64


def test_earlier_steps_get_the_advantage_at_their_own_positions():
    """SkyRL #1492: a 3-step trajectory, right-aligned (prompt left-padded, response at the end)."""
    # Padded [S, 8]: each step's response occupies different positions.
    masks = torch.tensor(
        [
            [0, 0, 0, 0, 0, 0, 1, 1],  # step 0: short response at the far right
            [0, 0, 0, 0, 1, 1, 1, 0],  # step 1
            [0, 0, 1, 1, 0, 0, 0, 0],  # step 2 (last)
            [0, 0, 0, 0, 0, 1, 1, 1],  # another trajectory's only step
        ],
        dtype=D,
    )
    traj_adv = torch.tensor([0.7, -1.2], dtype=D)
    adv = broadcast_trajectory_advantages(traj_adv, torch.tensor([0, 0, 0, 1]), masks)
    expected = masks * torch.tensor([[0.7], [0.7], [0.7], [-1.2]], dtype=D)
    assert torch.equal(adv, expected)
    # The bug this prevents: copying the last step's masked row gives earlier steps nothing.
    buggy = (traj_adv[0] * masks[2]).expand(3, -1)
    assert (buggy * masks[:3])[0].abs().sum() == 0 and adv[0].abs().sum() > 0


def test_broadcast_rejects_misaligned_input():
    with pytest.raises(ValueError, match="line up"):
        broadcast_trajectory_advantages(torch.ones(2), torch.tensor([0, 1]), torch.ones(3, 4))
    with pytest.raises(ValueError, match="outside"):
        broadcast_trajectory_advantages(torch.ones(2), torch.tensor([0, 5]), torch.ones(2, 4))


def seq(ids, mask, adv):
    return {
        "input_ids": torch.tensor(ids),
        "loss_mask": torch.tensor(mask, dtype=D),
        "advantages": torch.tensor(adv, dtype=D),
    }


def test_merge_consecutive_prefix_steps_keeps_loss_mask_on_generated_tokens_only():
    s0 = seq([1, 2, 3, 4], [0, 0, 1, 1], [0, 0, 0.5, 0.5])  # prompt 1 2, gen 3 4
    s1 = seq([1, 2, 3, 4, 9, 9, 5], [0, 0, 0, 0, 0, 0, 1], [0] * 6 + [0.5])  # + observation 9 9, gen 5
    s2 = seq([7, 7, 6], [0, 0, 1], [0, 0, 0.5])  # context reset: not a prefix
    merged, sources = merge_prefix_steps([s0, s1, s2])
    assert sources == [[0, 1], [2]]
    assert merged[0]["input_ids"].tolist() == [1, 2, 3, 4, 9, 9, 5]
    assert merged[0]["loss_mask"].tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert merged[0]["advantages"].tolist() == [0, 0, 0.5, 0.5, 0, 0, 0.5]
    assert merged[1]["input_ids"].tolist() == [7, 7, 6]
    with pytest.raises(ValueError, match="fields"):
        merge_prefix_steps([s0, {"input_ids": torch.tensor([1, 2, 3, 4, 5])}])


def step(prompt, resp, reward, traj, idx, version=4):
    n = len(resp)
    return Sample(
        response_ids=resp,
        rollout_logprobs=-0.1 * np.arange(1, n + 1),
        loss_mask=np.ones(n),
        reward=reward,
        behavior_version=version,
        prompt_ids=np.array(prompt),
        trajectory_id=traj,
        step_index=idx,
    )


def test_build_minibatches_stepwise_broadcast_and_merge():
    # Trajectory 0: two steps sharing the prefix; final reward 1. Trajectory 1: one step, reward 0.
    # Steps arrive out of order; step 0's reward (NaN placeholder) is not the trajectory's.
    t0s0 = step([1, 2], [3, 4], float("nan"), 0, 0)
    t0s1 = step([1, 2, 3, 4, 8], [5], 1.0, 0, 1, version=5)
    t1s0 = step([1, 2], [6, 6, 6], 0.0, 1, 0)
    group = RolloutGroup("g", "p", np.array([1, 2]), [t0s1, t1s0, t0s0])
    algo = AlgoConfig(stepwise=True, advantage_estimator="rloo")
    (mb,), metrics = build_minibatches([group], algo, num_minibatches=1)
    # rloo over trajectories: 1 - 0 = 1 and 0 - 1 = -1.
    assert metrics["stepwise/num_seq_before_merge"] == 3.0 and metrics["stepwise/num_seq_after_merge"] == 2.0
    by_len = sorted(mb, key=lambda s: s.num_tokens)
    short, merged = by_len
    assert short.input_ids.tolist() == [1, 2, 6, 6, 6]
    assert short.advantages.tolist() == [0, 0, -1, -1, -1]
    assert merged.input_ids.tolist() == [1, 2, 3, 4, 8, 5]
    assert merged.loss_mask.tolist() == [0, 0, 1, 1, 0, 1]
    assert merged.advantages.tolist() == [0, 0, 1, 1, 0, 1]
    assert merged.token_versions.tolist() == [4, 4, 4, 4, 5, 5]
    assert merged.behavior_version == 4
    np.testing.assert_allclose(merged.rollout_logprobs, [0, 0, -0.1, -0.2, 0, -0.1], rtol=1e-6)
    # token_mean over the mini-batch: 3 + 3 loss tokens.
    np.testing.assert_allclose(merged.reduction_weights, np.array([0, 0, 1, 1, 0, 1]) / 6, rtol=1e-6)


def test_build_minibatches_stepwise_without_merge_keeps_every_step():
    t0s0 = step([1, 2], [3, 4], 0.0, 0, 0)
    t0s1 = step([1, 2, 3, 4, 8], [5], 1.0, 0, 1)
    t1s0 = step([1, 2], [6], 0.0, 1, 0)
    group = RolloutGroup("g", "p", np.array([1, 2]), [t0s0, t0s1, t1s0])
    algo = AlgoConfig(stepwise=True, merge_stepwise=False, advantage_estimator="dr_grpo")
    (mb,), metrics = build_minibatches([group], algo, num_minibatches=1)
    assert metrics["stepwise/num_seq_after_merge"] == 3.0
    # dr_grpo: trajectory rewards 1 and 0, mean 0.5: +0.5 on both steps of trajectory 0.
    assert [s.advantages[-1] for s in mb] == [0.5, 0.5, -0.5]
    assert mb[0].advantages.tolist() == [0, 0, 0.5, 0.5]
