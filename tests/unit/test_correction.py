"""Off-policy correction (TIS, sequence masks, outlier mask) against hand-computed values.

    .venv/bin/python -m pytest tests/unit/test_correction.py -q
"""

from __future__ import annotations

import math

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
    w, m, met = off_policy_correction(OLD, ROLLOUT, MASK, params=CorrectionParams(tis="token", geo_mask=True),
                                      extra_mask=extra)
    assert torch.equal(m, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=D))
    assert math.isclose(met["extra_masked_frac"].item(), 1 / 3)
    assert math.isclose(met["masked_frac"].item(), 2 / 3)


def test_garbage_in_padding_changes_nothing():
    old = OLD.clone()
    old[MASK == 0] = torch.tensor([1e9, -1e9, float("nan"), 3.0, 7.0, -2.0], dtype=D)
    kw = dict(tis="token", geo_mask=True, product_mask=True, outlier_mask=True, outlier_low=0.1, outlier_high=10)
    a = run(**kw)
    b = off_policy_correction(old, ROLLOUT, MASK, params=CorrectionParams(**kw))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def test_huge_log_ratio_stays_finite():
    old = torch.tensor([[1e4, -1e4]], dtype=D)
    for tis in ("token", "sequence"):
        w, m, met = off_policy_correction(old, torch.zeros_like(old), torch.ones_like(old),
                                          params=CorrectionParams(tis=tis, tis_cap=2.0, geo_mask=True))
        assert torch.isfinite(w).all() and all(torch.isfinite(v) for v in met.values())
    assert torch.equal(w, torch.ones_like(w))  # sequence: the +-20 clamps cancel, product 1


def test_all_masked_input_gives_zero_metrics():
    w, m, met = off_policy_correction(OLD, ROLLOUT, torch.zeros(3, 3, dtype=D),
                                      params=CorrectionParams(tis="token", geo_mask=True))
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
    ],
)
def test_bad_params_are_rejected_by_name(kw, field):
    with pytest.raises(ValueError, match=field):
        CorrectionParams(**kw)
