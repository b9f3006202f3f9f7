"""Reduction weights against hand-computed values.

.venv/bin/python -m pytest tests/unit/test_reduction.py -q
"""

from __future__ import annotations

import pytest
import torch

from asyncrl import config
from asyncrl.algo import LOSS_REDUCTIONS, per_microbatch_token_mean_weights, reduction_weights

# Three tokens, one token, and an all-masked row (a failed sample).
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)


def test_token_mean():
    expected = MASK / 4
    assert torch.allclose(reduction_weights(MASK, "token_mean"), expected)


def test_sequence_mean_counts_only_sequences_with_tokens():
    # Two live sequences: 1 / (2 * 3) on the first, 1 / (2 * 1) on the second.
    expected = torch.tensor([[1 / 6, 1 / 6, 1 / 6, 0], [0.5, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    w = reduction_weights(MASK, "sequence_mean")
    assert torch.allclose(w, expected)
    assert torch.isclose(w.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_seq_mean_token_sum_norm():
    w = reduction_weights(MASK, "seq_mean_token_sum_norm", constant=5.0)
    assert torch.allclose(w, MASK / 10)


def test_seq_mean_token_sum_norm_needs_a_constant():
    with pytest.raises(ValueError, match="constant"):
        reduction_weights(MASK, "seq_mean_token_sum_norm")


def test_prompt_mean_gives_every_prompt_one_share():
    # Rows of 3, 1, 2, 0 and 1 tokens; prompts 7 (rows 0, 1: 4 tokens), 9 (rows 2, 3: 2 tokens)
    # and 4 (row 4, a one-token row alone). G = 3 prompts with tokens.
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0], [0, 1, 0]], dtype=torch.float64)
    w = reduction_weights(mask, "prompt_mean", group_ids=torch.tensor([7, 7, 9, 9, 4]))
    expected = torch.tensor(
        [[1 / 12] * 3, [1 / 12, 0, 0], [1 / 6, 1 / 6, 0], [0, 0, 0], [0, 1 / 3, 0]], dtype=torch.float64
    )
    assert torch.allclose(w, expected)
    for ids in ([7, 7, 9, 9, 4], [4, 4, 7, 7, 9]):  # each prompt sums to 1/G whatever its ids
        w = reduction_weights(mask, "prompt_mean", group_ids=torch.tensor(ids))
        assert torch.allclose(
            torch.stack([w[:2].sum(), w[2:4].sum(), w[4].sum()]), torch.full((3,), 1 / 3, dtype=torch.float64)
        )
    # A prompt whose samples all failed (no loss tokens) does not dilute the others.
    w = reduction_weights(MASK, "prompt_mean", group_ids=torch.tensor([0, 0, 1]))
    assert torch.allclose(w, MASK / 4)
    # One prompt: prompt_mean is token_mean.
    assert torch.allclose(
        reduction_weights(MASK, "prompt_mean", group_ids=torch.zeros(3)), reduction_weights(MASK, "token_mean")
    )
    assert torch.equal(
        reduction_weights(torch.zeros(2, 3), "prompt_mean", group_ids=torch.tensor([0, 1])), torch.zeros(2, 3)
    )


def test_prompt_mean_needs_group_ids():
    with pytest.raises(ValueError, match="prompt_mean needs group_ids"):
        reduction_weights(MASK, "prompt_mean")
    with pytest.raises(ValueError, match="group_ids must be"):
        reduction_weights(MASK, "prompt_mean", group_ids=torch.tensor([0, 1]))


def test_per_microbatch_legacy_returns_the_mask_and_the_loss_normalises():
    assert torch.equal(reduction_weights(MASK, "token_mean_per_microbatch"), MASK)
    # Micro-batch = rows 0..1 (4 tokens), 3 micro-batches in the mini-batch over all ranks.
    assert torch.allclose(per_microbatch_token_mean_weights(MASK[:2], 3), MASK[:2] / 12)
    with pytest.raises(ValueError, match="num_microbatches"):
        per_microbatch_token_mean_weights(MASK, 0)


def test_all_masked_batch_gives_zero_weights_not_nan():
    for name in ("token_mean", "sequence_mean"):
        w = reduction_weights(torch.zeros(2, 3), name)
        assert torch.equal(w, torch.zeros(2, 3))


def test_integer_masks_and_bad_input():
    assert torch.allclose(reduction_weights(MASK.long(), "token_mean"), MASK / 4)
    with pytest.raises(ValueError, match="'bogus'"):
        reduction_weights(MASK, "bogus")
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        reduction_weights(torch.ones(3), "token_mean")


def test_names_match_config():
    assert tuple(LOSS_REDUCTIONS) == config.LOSS_REDUCTIONS
