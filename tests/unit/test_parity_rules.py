"""The parity suite's rules (tests.support.parity) on hand-made metric rows, and the config
accepting learner.lr=0 (the parity runs' premise: the policy never moves)."""

from __future__ import annotations

import math
import re

import pytest

from asyncrl.config import ConfigError, load_config
from tests.support.parity import PARITY_OVERRIDES, TOLERANCES, format_table, parity_of_rows, run_dtype


def row(step: int, **drift: float | None) -> dict:
    base = {
        "drift/tis_ratio_max": math.exp(2e-6),
        "drift/tis_ratio_min": math.exp(-3e-6),
        "drift/abs_logp_diff": 5e-7,
        "drift/masked_frac": 0.0,
        "drift/tis_capped_frac": 0.0,
        "drift/rollout_kl": 1e-12,
    }
    base.update({f"drift/{k}": v for k, v in drift.items()})
    return {"step": step, **base}


def test_rows_at_parity_pass_and_report_the_largest_log_ratio():
    r = parity_of_rows("ok", [row(1), row(2, tis_ratio_min=math.exp(-4e-5))], covers="x")
    assert r.ok and r.steps == 2 and r.max_from == "tis_ratio"
    assert r.max_abs_diff == pytest.approx(4e-5, rel=1e-6)
    assert "ok" in format_table([r]) and "pass" in format_table([r])


def test_the_learners_own_max_is_preferred_over_the_ratios():
    r = parity_of_rows("direct", [row(1, logprob_abs_diff_max=2e-3)])
    assert r.max_from == "logprob_abs_diff_max" and r.max_abs_diff == 2e-3
    assert not r.ok and "max |diff| 0.002 >= 0.001 (float32)" in r.why()


@pytest.mark.parametrize(
    ("drift", "message"),
    [
        ({"tis_ratio_max": 0.8}, "max |diff|"),  # top_p's kept mass: every ratio < 1
        ({"abs_logp_diff": 2e-4}, "mean |diff|"),
        ({"masked_frac": 0.25}, "masks removed"),
        ({"tis_capped_frac": 0.01}, "capped"),
        ({"tis_ratio_max": None, "tis_ratio_min": None}, "no drift/logprob_abs_diff_max"),
        ({"abs_logp_diff": None}, "no drift/abs_logp_diff"),
        ({"masked_frac": None}, "correction off"),
    ],
)
def test_each_rule_fails_a_step_that_breaks_it(drift, message):
    r = parity_of_rows("bad", [row(1), row(2, **drift)])
    assert not r.ok and message in r.why() and "step 2" in r.why(), r.why()
    assert "FAIL" in format_table([r])


def test_no_rows_is_a_failure():
    assert not parity_of_rows("empty", []).ok


def test_bfloat16_has_its_own_tolerance():
    rows = [row(1, logprob_abs_diff_max=2e-2, abs_logp_diff=2e-3)]
    assert parity_of_rows("bf16", rows, dtype="bfloat16").ok
    assert not parity_of_rows("f32", rows, dtype="float32").ok


def test_tolerance_follows_the_runs_compute_dtype():
    # A CPU run is float32 on both sides whatever learner.dtype says; CUDA follows learner.dtype.
    assert run_dtype("bfloat16", "cpu") == "float32"
    assert run_dtype("bfloat16", "cuda") == "bfloat16"
    assert TOLERANCES["float32"].max_abs < TOLERANCES["float16"].max_abs < TOLERANCES["bfloat16"].max_abs


def test_learning_rate_zero_is_a_valid_config_and_negative_is_not():
    assert load_config(None, list(PARITY_OVERRIDES)).learner.lr == 0.0
    with pytest.raises(ConfigError, match=re.escape("learner.lr")):
        load_config(None, ["learner.lr=-1e-5"])


def test_the_gate_must_have_run_once_per_start_and_passed():
    from tests.support.parity import gate_problems

    gate = {"parity/gate_max_abs_diff": 4e-7, "parity/gate_passed": 1.0, "parity/gate_tokens": 96.0}
    rows = [{**row(1), **gate}, row(2), row(3), {**row(3), **gate}]  # a run resumed at step 2's checkpoint
    assert gate_problems(rows, 2) == []
    assert gate_problems(rows, 1) == ["the gate ran 2 times, not once per start (1)"]
    assert gate_problems([row(1)], 1) == ["the gate ran 0 times, not once per start (1)"]
    failed = {**gate, "parity/gate_max_abs_diff": 0.39, "parity/gate_passed": 0.0}
    assert gate_problems([{**row(1), **failed}], 1) == ["step 1: gate max |diff| 0.39, passed 0.0"]
