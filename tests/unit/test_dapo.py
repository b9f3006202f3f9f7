"""DAPO's overlong handling and dynamic sampling, with hand-computed rewards, masks and weights:
the soft length penalty at its boundaries, the overlong mask and the token_mean weights it
leaves, the config rules, and which groups a generator drops as uniform.

.venv/bin/python -m pytest tests/unit/test_dapo.py -q
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from asyncrl.algo.overlong import MAX_NEW_TOKENS_KEY, penalised_rewards, rewards_tie, soft_overlong_penalty
from asyncrl.config import AlgoConfig, Config, ConfigError, load_config, schema_text
from asyncrl.control.summary import run_summary
from asyncrl.data.batch import build_minibatches
from asyncrl.rollout.envs import make_env
from asyncrl.rollout.groups import GroupMaker
from asyncrl.types import RolloutGroup, Sample

NAN = float("nan")


def sample(n: int, reward: float, stop: str = "stop", **kw) -> Sample:
    return Sample(np.arange(n) + 3, -0.1 * np.ones(n), np.ones(n), reward, 0, stop_reason=stop, **kw)


def group(gid: str, *samples: Sample, **metadata) -> RolloutGroup:
    return RolloutGroup(gid, gid, np.array([1, 2]), list(samples), metadata=metadata)


# ------------------------------------------------------------------ the penalty, eq. (13)


def test_soft_penalty_is_zero_then_linear_then_minus_one_at_its_boundaries():
    # L_max = 16, L_cache = 4: free up to 12 tokens, then -(|y| - 12) / 4, -1 from 16 on.
    got = soft_overlong_penalty([0, 11, 12, 13, 14, 15, 16, 17, 40], max_new_tokens=16, buffer=4)
    assert got.tolist() == [0, 0, 0, -0.25, -0.5, -0.75, -1, -1, -1]
    assert soft_overlong_penalty([14, 16], 16, 4, coef=0.5).tolist() == [-0.25, -0.5]
    assert soft_overlong_penalty([14, 16], 16, 4, coef=0.0).tolist() == [0, 0]
    # A prompt's own budget below the buffer: the whole budget is the buffer, -1 still at the cut.
    assert soft_overlong_penalty([0, 1, 2], max_new_tokens=2, buffer=4).tolist() == [0, -0.5, -1]
    for bad in ({"max_new_tokens": 0, "buffer": 1}, {"max_new_tokens": 8, "buffer": 0}):
        with pytest.raises(ValueError, match="must be >= 1"):
            soft_overlong_penalty([1], **bad)
    with pytest.raises(ValueError, match="coef"):
        soft_overlong_penalty([1], 8, 2, coef=-1.0)


def test_penalised_rewards_use_the_budget_the_group_recorded():
    g = group("g", sample(10, 1.0), sample(14, 1.0), sample(3, NAN))
    assert np.array_equal(penalised_rewards(g, None), [1.0, 1.0, NAN], equal_nan=True)
    assert np.array_equal(penalised_rewards(g, 4, 1.0, default_max_new_tokens=16), [1.0, 0.5, NAN], equal_nan=True)
    g.metadata[MAX_NEW_TOKENS_KEY] = 12  # sampled with a shorter budget: 14 tokens is past it
    assert np.array_equal(penalised_rewards(g, 4, 1.0, default_max_new_tokens=16), [0.5, 0.0, NAN], equal_nan=True)
    with pytest.raises(ValueError, match="no token budget"):
        penalised_rewards(group("h", sample(1, 0.0)), 4)


def test_rewards_tie_only_when_all_equal_and_some_exist():
    assert rewards_tie([0.0, 0.0, 0.0]) and rewards_tie([1.0, 1.0]) and rewards_tie([0.3])
    assert not rewards_tie([1.0, 1.0, 0.999]) and not rewards_tie([])


# ------------------------------------------------------------------ the driver: mask and penalty


def test_overlong_mask_zeroes_exactly_the_truncated_samples_and_token_mean_renormalises():
    g0 = group("g0", sample(3, 1.0), sample(4, 0.0, "length"), sample(2, 0.0))
    g1 = group("g1", sample(5, 1.0, "length"), sample(1, 0.0))
    algo = AlgoConfig(advantage_estimator="dr_grpo", overlong={"mask": True})
    (mb,), metrics = build_minibatches([g0, g1], algo, num_minibatches=1)
    masks = [s.loss_mask[2:].tolist() for s in mb]  # the prompt is 2 tokens
    assert masks == [[1] * 3, [0] * 4, [1] * 2, [0] * 5, [1]]
    # token_mean over the 3 + 2 + 1 = 6 tokens left: the 9 truncated ones are in no denominator.
    for s, m in zip(mb, masks, strict=True):
        np.testing.assert_allclose(s.reduction_weights[2:], np.array(m) / 6, rtol=1e-6)
    assert math.isclose(sum(float(s.reduction_weights.sum()) for s in mb), 1.0, rel_tol=1e-6)
    # A truncated sample still counts in its group's baseline: g0's mean is 1/3, g1's 1/2.
    np.testing.assert_allclose(mb[0].advantages[2:], [2 / 3] * 3, rtol=1e-6)
    np.testing.assert_allclose(mb[2].advantages[2:], [-1 / 3] * 2, rtol=1e-6)
    np.testing.assert_allclose(mb[4].advantages[2:], [-0.5], rtol=1e-6)
    assert not mb[1].advantages.any() and not mb[3].advantages.any()
    assert metrics["overlong/masked_samples"] == 2 and metrics["overlong/truncated_frac"] == pytest.approx(0.4)
    assert metrics["batch/num_loss_tokens"] == 6
    # Off (the default), the same batch trains on all 15 tokens.
    (mb,), _ = build_minibatches([g0, g1], AlgoConfig(advantage_estimator="dr_grpo"), num_minibatches=1)
    assert [int(s.loss_mask.sum()) for s in mb] == [3, 4, 2, 5, 1]


def test_soft_penalty_reaches_the_group_baseline_before_advantages():
    # L_max 16, buffer 4: lengths 10, 14, 16 -> penalties 0, -0.5, -1 on rewards 1, 1, 1.
    g = group("g", sample(10, 1.0), sample(14, 1.0), sample(16, 1.0, "length"))
    algo = AlgoConfig(advantage_estimator="dr_grpo", overlong={"soft_penalty": {"buffer": 4}})
    (mb,), metrics = build_minibatches([g], algo, num_minibatches=1, max_new_tokens=16)
    # shaped [1, 0.5, 0], mean 0.5: the tie of task rewards is broken by length alone.
    assert [float(s.advantages[-1]) for s in mb] == pytest.approx([0.5, 0.0, -0.5])
    assert metrics["reward/mean"] == 1.0  # the task's own reward is what reward/mean reports
    assert metrics["overlong/penalty_mean"] == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="no token budget"):
        build_minibatches([g], algo, num_minibatches=1)


# ------------------------------------------------------------------ config


def test_config_fields_are_validated_and_documented():
    cfg = load_config(
        None,
        [
            "algo.overlong.mask=true",
            "algo.overlong.soft_penalty.buffer=4",
            "algo.overlong.soft_penalty.coef=0.5",
            "rollout.drop_uniform_groups=true",
        ],
    )
    assert cfg.algo.overlong.mask and cfg.rollout.drop_uniform_groups
    assert (cfg.algo.overlong.soft_penalty.buffer, cfg.algo.overlong.soft_penalty.coef) == (4, 0.5)
    assert Config().algo.overlong.soft_penalty is None and not Config().rollout.drop_uniform_groups
    bad = {
        "algo.overlong.soft_penalty.buffer=16": "buffer=16: must be < rollout.max_tokens=16",
        "algo.overlong.soft_penalty.buffer=0": "algo.overlong.soft_penalty.buffer=0: must be > 0",
        "algo.overlong.soft_penalty.coef=-1": "coef=-1: must be >= 0",
    }
    for override, message in bad.items():
        extra = [] if "buffer" in override else ["algo.overlong.soft_penalty.buffer=4"]
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, [override, *extra])
    with pytest.raises(ConfigError, match=r"reinforce_pp.*batch baseline"):
        load_config(None, ["rollout.drop_uniform_groups=true", "algo.advantage_estimator=reinforce_pp"])
    with pytest.raises(ConfigError, match="single-turn"):
        load_config(None, ["algo.overlong.soft_penalty.buffer=4", "rollout.env=countdown_chat"])
    demo = load_config("configs/demo_dapo.yaml")
    assert demo.rollout.drop_uniform_groups and demo.algo.overlong.mask
    assert demo.algo.overlong.soft_penalty is not None and demo.algo.overlong.soft_penalty.buffer == 4
    text = schema_text()
    for line in ("algo.overlong:", "algo.overlong.soft_penalty:", "buffer: int = required  (> 0)", "drop_uniform"):
        assert line in text


# ------------------------------------------------------------------ the generator's drop test


def maker(**algo) -> GroupMaker:
    cfg = Config(algo=AlgoConfig(**algo))
    cfg.rollout.max_tokens = 16
    # uniform() reads rewards only: no engine or tokenizer is reached.
    return GroupMaker(cfg, make_env("copy", {}), None, None, "g")  # type: ignore[arg-type]


def test_uniform_groups_are_exactly_the_ties_of_what_the_estimator_sees():
    m = maker()
    assert m.uniform(group("zeros", sample(3, 0.0), sample(5, 0.0), sample(1, 0.0)))
    assert m.uniform(group("ones", sample(3, 1.0), sample(5, 1.0)))
    assert m.uniform(group("equal", sample(3, 0.25), sample(5, 0.25)))
    assert not m.uniform(group("mixed", sample(3, 1.0), sample(5, 0.0)))
    # Failed rewards take no part (as in the advantages); all failed is a failure, not a tie.
    assert m.uniform(group("failed", sample(3, NAN, error="boom"), sample(5, 1.0), sample(2, 1.0)))
    assert not m.uniform(group("all failed", sample(3, NAN, error="boom"), sample(5, NAN, error="boom")))
    soft = maker(overlong={"soft_penalty": {"buffer": 4}})
    # Equal after the penalty: 1 - 1 (16 tokens, cut) == 0 + 0.
    assert soft.uniform(group("tie after", sample(16, 1.0, "length"), sample(5, 0.0)))
    assert not maker().uniform(group("tie after", sample(16, 1.0, "length"), sample(5, 0.0)))
    # A task-reward tie that the penalty breaks carries gradient: kept.
    assert not soft.uniform(group("broken", sample(14, 1.0), sample(5, 1.0)))
    # Step-wise: one reward per trajectory, its last step's (earlier steps' are ignored).
    steps = maker(stepwise=True)
    t0 = [sample(2, 0.0, trajectory_id=0, step_index=0), sample(2, 1.0, trajectory_id=0, step_index=1)]
    t1 = [sample(2, 1.0, trajectory_id=1, step_index=0)]
    assert steps.uniform(group("traj", *t0, *t1))
    assert not maker().uniform(group("traj", *t0, *t1))


def test_the_end_of_run_summary_counts_the_uniform_drops():
    def summary(counters):
        return run_summary(
            [{"step": 1}],
            startup_s=1.0,
            wall_s=2.0,
            counters=counters,
            max_staleness=1,
            status="finished",
            metrics=Path("m.jsonl"),
            checkpoint=None,
            hf_dir=None,
            resume_cmd="asyncrl train --resume r",
        )

    assert "  uniform groups  7 dropped by the generators (rewards all tied)" in summary({"dropped_uniform": 7})
    assert "uniform groups" not in summary({})
