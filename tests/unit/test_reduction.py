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
