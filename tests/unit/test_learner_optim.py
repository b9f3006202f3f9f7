"""The learning-rate schedule and the driver-side batch validation (pure, no ranks)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.config import AlgoConfig, CorrectionConfig, LearnerConfig
from asyncrl.learner.optim import build_optimizer, build_scheduler, lr_factor
from asyncrl.learner.validate import validate_minibatches
from asyncrl.types import TrainSequence


def test_lr_factor_warmup_then_each_schedule():
    kw = {"warmup_steps": 4, "total_steps": 14}
    assert [lr_factor(s, schedule="constant", **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(9, schedule="constant", **kw) == 1.0
    # After warm-up, progress p = (step - 4) / 10.
    assert lr_factor(4, schedule="linear", **kw) == 1.0
    assert lr_factor(9, schedule="linear", **kw) == pytest.approx(0.5)
    assert lr_factor(14, schedule="linear", **kw) == 0.0
    assert lr_factor(40, schedule="linear", **kw) == 0.0  # clipped past the end
    assert lr_factor(9, schedule="cosine", **kw) == pytest.approx(0.5)
    assert lr_factor(6, schedule="cosine", **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
    with pytest.raises(ValueError, match="lr_schedule='step'"):
        lr_factor(5, schedule="step", **kw)


def test_scheduler_drives_adamw_lr():
    model = torch.nn.Linear(2, 1)
    cfg = LearnerConfig(lr=0.1, warmup_steps=2, lr_schedule="linear")
    opt = build_optimizer(model.parameters(), cfg)
    sched = build_scheduler(opt, cfg, total_steps=4)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.05, 0.0])
    frozen = torch.nn.Linear(2, 1).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(frozen.parameters(), cfg)


def _seq(n=6, **over) -> TrainSequence:
    m = np.ones(n, dtype=np.float32)
    fields = dict(
        input_ids=np.arange(n, dtype=np.int32) + 4,
        loss_mask=m,
        rollout_logprobs=-m,
        advantages=m,
        reduction_weights=m / n,
        token_versions=np.zeros(n, dtype=np.int32),
        behavior_version=0,
        group_id="g7",
        sample_index=2,
    )
    fields.update(over)
    return TrainSequence(**fields)


def test_validation_names_field_and_sequence():
    plain = AlgoConfig(correction=CorrectionConfig(tis="none"))
    rkl = AlgoConfig(rollout_kl_coef=0.1, correction=CorrectionConfig(tis="none"))
    validate_minibatches([[_seq(), _seq()]], rkl, max_positions=8, vocab_size=20)
    nan = _seq(rollout_logprobs=np.array([-1, -1, np.nan, -1, -1, -1], dtype=np.float32))
    # Without rollout-KL or a correction the loss never reads rollout logprobs: accepted.
    validate_minibatches([[nan]], plain, max_positions=8)
    with pytest.raises(
        ValueError,
        match=r"mini-batch 0, sequence 1 \(group_id='g7', sample_index=2\): field "
        r"'rollout_logprobs' is NaN/inf/positive on trained positions \[2\]",
    ):
        validate_minibatches([[_seq(), nan]], rkl, max_positions=8)
    tis = AlgoConfig()
    tis.correction.tis = "token"
    with pytest.raises(ValueError, match="rollout_logprobs"):
        validate_minibatches([[nan]], tis, max_positions=8)
    with pytest.raises(ValueError, match="field 'token_versions' is missing"):
        validate_minibatches([[_seq(token_versions=None)]], plain, max_positions=8)
    with pytest.raises(ValueError, match=r"field 'loss_mask' has shape \(5,\), input_ids has \(6,\)"):
        validate_minibatches([[_seq(loss_mask=np.ones(5, dtype=np.float32))]], plain, max_positions=8)
    with pytest.raises(ValueError, match="9 tokens exceed the model's max_position_embeddings=8"):
        validate_minibatches([[_seq(9)]], plain, max_positions=8)
    with pytest.raises(ValueError, match=r"input_ids outside \[0, 5\)"):
        validate_minibatches([[_seq()]], plain, max_positions=8, vocab_size=5)
    with pytest.raises(ValueError, match="field 'advantages' has NaN/inf at positions \\[0\\]"):
        validate_minibatches(
            [[_seq(advantages=np.array([np.inf, 1, 1, 1, 1, 1], dtype=np.float32))]], plain, max_positions=8
        )
    with pytest.raises(ValueError, match="mini-batch 1 is empty"):
        validate_minibatches([[_seq()], []], plain, max_positions=8)
