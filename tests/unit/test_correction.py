"""Off-policy correction (TIS, token and sequence masks, outlier mask, their order) against hand-computed values.

.venv/bin/python -m pytest tests/unit/test_correction.py -q
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from asyncrl.algo import CorrectionParams, off_policy_correction

D = torch.float64
L2, L3 = math.log(2.0), math.log(3.0)
# Row 0: ratios 2 and 0.5 (product 1, geometric mean 1); its third slot is padding with garbage.
# Row 1: one token, ratio 3. Row 2: all masked.
OLD = torch.tensor([[L2, -L2, 50.0], [L3, 0.0, 0.0], [9.0, -9.0, 4.0]], dtype=D)
ROLLOUT = torch.zeros(3, 3, dtype=D)
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=D)


def run(**kw):
    return off_policy_correction(OLD, ROLLOUT, MASK, params=CorrectionParams(**kw))


def test_token_tis_caps_each_ratio_and_on_the_cap_is_not_capped():
    w, m, met = run(tis="token", tis_cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.0], [2.0, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=D))
    assert torch.equal(m, MASK)
    assert math.isclose(met["tis_capped_frac"].item(), 1 / 3)  # ratio 2 sits on the cap: not capped
    assert math.isclose(met["tis_ratio_mean"].item(), (2 + 0.5 + 3) / 3)
    assert math.isclose(met["tis_ratio_max"].item(), 3.0)
    assert math.isclose(met["tis_ratio_min"].item(), 0.5)
    assert met["masked_frac"].item() == 0.0


def test_sequence_tis_uses_the_product_of_ratios():
    w, _, met = run(tis="sequence", tis_cap=2.0)
    assert torch.allclose(w[:2], torch.tensor([[1.0, 1.0, 1.0], [2.0, 1.0, 1.0]], dtype=D))
    assert math.isclose(met["tis_ratio_max"].item(), 3.0)
    assert math.isclose(met["tis_ratio_mean"].item(), (1 + 1 + 3) / 3)


def test_geometric_mask_drops_sequences_outside_the_band():
    w, m, met = run(geo_mask=True, geo_mask_low=0.99, geo_mask_high=1.01)
    assert torch.equal(w, torch.ones(3, 3, dtype=D))
    assert torch.equal(m, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=D))
    assert math.isclose(met["geo_masked_frac"].item(), 1 / 3)
    assert math.isclose(met["masked_frac"].item(), 1 / 3)


def test_product_mask_bounds_are_inclusive():
    _, m, _ = run(product_mask=True, product_mask_low=1.0, product_mask_high=2.0)
    assert torch.equal(m[0], MASK[0]) and m[1].sum() == 0  # row 0's product is exactly 1: kept
    _, m, met = run(product_mask=True, product_mask_low=1.5, product_mask_high=2.0)
    assert torch.equal(m, torch.zeros(3, 3, dtype=D))
    assert met["product_masked_frac"].item() == 1.0


def test_outlier_token_masks_its_whole_sequence():
    _, m, _ = run(outlier_mask=True, outlier_low=0.4, outlier_high=2.5)
    assert torch.equal(m[0], MASK[0]) and m[1].sum() == 0
    _, m, met = run(outlier_mask=True, outlier_low=0.6, outlier_high=2.5)  # ratio 0.5 < 0.6 drops row 0
    assert m.sum() == 0
    assert met["outlier_masked_frac"].item() == 1.0


def test_extra_mask_and_masks_combine():
    extra = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=D)
    _, m, met = off_policy_correction(
        OLD, ROLLOUT, MASK, params=CorrectionParams(tis="token", geo_mask=True), extra_mask=extra
    )
    assert torch.equal(m, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=D))
    assert math.isclose(met["extra_masked_frac"].item(), 1 / 3)
    assert math.isclose(met["masked_frac"].item(), 2 / 3)


def test_garbage_in_padding_changes_nothing():
    old = OLD.clone()
    old[MASK == 0] = torch.tensor([1e9, -1e9, float("nan"), 3.0, 7.0, -2.0], dtype=D)
    kw = dict(
        tis="token",
        geo_mask=True,
        product_mask=True,
        outlier_mask=True,
        outlier_low=0.1,
        outlier_high=10,
        token_mask_low=0.4,
        token_mask_high=2.5,
    )
    a = run(**kw)
    b = off_policy_correction(old, ROLLOUT, MASK, params=CorrectionParams(**kw))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def test_huge_log_ratio_stays_finite():
    old = torch.tensor([[1e4, -1e4]], dtype=D)
    for tis in ("token", "sequence"):
        w, _, met = off_policy_correction(
            old,
            torch.zeros_like(old),
            torch.ones_like(old),
            params=CorrectionParams(tis=tis, tis_cap=2.0, geo_mask=True),
        )
        assert torch.isfinite(w).all() and all(torch.isfinite(v) for v in met.values())
    assert torch.equal(w, torch.ones_like(w))  # sequence: the +-20 clamps cancel, product 1


def test_all_masked_input_gives_zero_metrics():
    w, m, met = off_policy_correction(
        OLD,
        ROLLOUT,
        torch.zeros(3, 3, dtype=D),
        params=CorrectionParams(
            tis="sequence", geo_mask=True, outlier_mask=True, token_mask_low=0.5, token_mask_high=2.0
        ),
    )
    assert torch.equal(m, torch.zeros(3, 3, dtype=D)) and torch.equal(w, torch.ones(3, 3, dtype=D))
    assert all(v.item() == 0.0 for v in met.values())


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(tis="tokens"), "tis"),
        (dict(tis_cap=0.0), "tis_cap"),
        (dict(geo_mask_low=1.01, geo_mask_high=0.99), "geo_mask_low"),
        (dict(product_mask_low=2.0, product_mask_high=2.0), "product_mask_low"),
        (dict(outlier_low=0.0), "outlier_low"),
        (dict(token_mask_low=0.0, token_mask_high=2.0), "token_mask_low"),
        (dict(token_mask_low=1.5), "token_mask_high"),
    ],
)
def test_bad_params_are_rejected_by_name(kw, field):
    with pytest.raises(ValueError, match=field):
        CorrectionParams(**kw)


# ----------------------------------------------------------------------------- token mask, order, row metrics


def test_token_mask_drops_only_the_tokens_outside_inclusive_bounds():
    # Row 0 (ratios 2 and 0.5) sits exactly on both bounds: kept. Row 1 (one token, ratio 3) is
    # dropped; the all-masked row 2 counts for nothing.
    w, m, met = run(token_mask_low=0.5, token_mask_high=2.0)
    assert torch.equal(w, torch.ones(3, 3, dtype=D))
    assert torch.equal(m, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=D))
    assert math.isclose(met["token_masked_frac"].item(), 1 / 3)
    # A tighter low bound drops token 1 of row 0 and keeps its token 0: no whole-sequence drop.
    _, m, met = run(token_mask_low=0.6, token_mask_high=2.0)
    assert torch.equal(m, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=D))
    assert math.isclose(met["token_masked_frac"].item(), 2 / 3)
    assert math.isclose(met["masked_frac"].item(), 2 / 3)
    assert "token_seq_masked_frac" not in met  # a token mask has no row fraction


def test_token_mask_needs_both_bounds():
    assert not CorrectionParams(token_mask_low=None, token_mask_high=None).enabled
    assert CorrectionParams(token_mask_low=0.5, token_mask_high=2.0).enabled
    with pytest.raises(ValueError, match=r"token_mask_high=None while .* needs both bounds"):
        CorrectionParams(token_mask_low=0.5)
    with pytest.raises(ValueError, match=r"token_mask_low=None while .* needs both bounds"):
        CorrectionParams(token_mask_high=2.0)
    with pytest.raises(ValueError, match=re.escape("token_mask_low=2.0")):
        CorrectionParams(token_mask_low=2.0, token_mask_high=2.0)


def test_order_token_mask_then_sequence_tis_then_sequence_mask():
    # Token mask [0.6, 2.5] drops row 0's ratio-0.5 token and row 1's ratio-3 token. Sequence
    # TIS over the kept tokens: row 0's product is 2 (not 2 * 0.5 = 1), capped at 1.5; row 1
    # has no kept token (not counted as capped). The geometric mask then sees row 0's kept
    # ratio 2, outside [0.99, 1.01]: dropped (over all tokens its mean would be 1: kept).
    kw = dict(token_mask_low=0.6, token_mask_high=2.5, tis="sequence", tis_cap=1.5, geo_mask=True)
    w, m, met = run(**kw)
    assert torch.allclose(w, torch.tensor([[1.5, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=D))
    assert m.sum() == 0
    assert math.isclose(met["token_masked_frac"].item(), 2 / 3)
    assert math.isclose(met["tis_capped_frac"].item(), 1 / 3)  # row 0 token 0, the only kept token
    assert math.isclose(met["tis_seq_capped_frac"].item(), 1 / 2)  # row 0 of the 2 rows with tokens
    assert math.isclose(met["geo_masked_frac"].item(), 1 / 3)
    assert math.isclose(met["geo_seq_masked_frac"].item(), 1 / 2)
    assert math.isclose(met["masked_frac"].item(), 1.0)
    # Without the token mask row 0's product is 1 (not capped) and its geometric mean 1 (kept).
    w, m, met = run(tis="sequence", tis_cap=1.5, geo_mask=True)
    assert torch.allclose(w[0, :2], torch.ones(2, dtype=D)) and torch.equal(m[0], MASK[0])


def test_outlier_mask_comes_first_and_each_row_is_counted_once():
    # The outlier mask [0.4, 2.5] drops row 1 (ratio 3) before the token mask sees it; the
    # token mask then drops only row 0's ratio-0.5 token, and the geometric mask row 0's rest.
    kw = dict(
        outlier_mask=True, outlier_low=0.4, outlier_high=2.5, token_mask_low=0.6, token_mask_high=2.5, geo_mask=True
    )
    _, m, met = run(**kw)
    assert m.sum() == 0
    assert math.isclose(met["outlier_masked_frac"].item(), 1 / 3)
    assert math.isclose(met["outlier_seq_masked_frac"].item(), 1 / 2)
    assert math.isclose(met["token_masked_frac"].item(), 1 / 3)
    assert math.isclose(met["geo_masked_frac"].item(), 1 / 3)
    assert math.isclose(met["geo_seq_masked_frac"].item(), 1 / 2)
    parts = sum(met[k].item() for k in ("outlier_masked_frac", "token_masked_frac", "geo_masked_frac"))
    assert math.isclose(parts, met["masked_frac"].item())


def test_row_fractions_count_rows_with_loss_tokens():
    # Geometric mask: row 1 (one token, ratio 3) dropped; the all-masked row 2 is not a row.
    _, _, met = run(geo_mask=True)
    assert math.isclose(met["geo_seq_masked_frac"].item(), 1 / 2)
    assert math.isclose(met["geo_masked_frac"].item(), 1 / 3)
    _, _, met = run(product_mask=True, product_mask_low=1.5, product_mask_high=2.0)
    assert met["product_seq_masked_frac"].item() == 1.0
    _, _, met = run(outlier_mask=True, outlier_low=0.4, outlier_high=2.5)
    assert math.isclose(met["outlier_seq_masked_frac"].item(), 1 / 2)
    # Sequence TIS: row 1's ratio 3 is capped at 2, row 0's product 1 is not.
    _, _, met = run(tis="sequence", tis_cap=2.0)
    assert math.isclose(met["tis_seq_capped_frac"].item(), 1 / 2)
    assert math.isclose(met["tis_capped_frac"].item(), 1 / 3)
