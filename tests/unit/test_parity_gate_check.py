"""The parity gate's arithmetic and its verdicts, on hand-made sequences: which tokens it
compares (loss tokens sampled at the learner's version), its tolerance by dtype, the causes
it names from the run's settings and model, and what stop and warn do."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.control.parity_gate import (
    OUTSIDE_FRAC,
    GateResult,
    ParityGate,
    ParityMismatch,
    at_version,
    compare,
    compute_dtype,
    likely_causes,
)
from asyncrl.infra import ExpectedFailure
from asyncrl.monitor.alerts import state_alerts
from asyncrl.monitor.metrics import is_known
from asyncrl.types import TrainSequence


def seq(rollout: list[float], mask: list[int], versions: list[int]) -> TrainSequence:
    n = len(rollout)
    return TrainSequence(
        input_ids=np.arange(n, dtype=np.int32),
        loss_mask=np.asarray(mask, dtype=np.float32),
        rollout_logprobs=np.asarray(rollout, dtype=np.float32),
        advantages=np.zeros(n, dtype=np.float32),
        reduction_weights=np.zeros(n, dtype=np.float32),
        token_versions=np.asarray(versions, dtype=np.int32),
        behavior_version=int(min(versions)),
    )


def test_only_loss_tokens_sampled_at_the_learners_version_are_compared():
    a = seq([0.0, -1.0, -2.0, -3.0], [0, 1, 1, 0], [3, 3, 3, 3])  # prompt and an observation token
    b = seq([0.0, -1.0, -2.0], [0, 1, 1], [3, 2, 3])  # keep mode: its first response token is v2's
    c = seq([0.0, -1.0], [0, 1], [2, 2])  # all v2: not at the learner's version
    assert at_version([a, b, c], 3) == [a, b]
    learner = [np.array([0.0, -1.5, -2.001, -9.0]), np.array([0.0, -7.0, -2.0])]
    used, tokens, worst, mean, outside = compare(learner, [a, b], 3)
    # a: |-1.5+1| = 0.5, |-2.001+2| = 0.001 (index 3 is not a loss token); b: only index 2, diff 0
    assert (used, tokens, outside) == (2, 3, 0)
    assert worst == pytest.approx(0.5) and mean == pytest.approx(0.501 / 3)


def test_a_token_the_learner_cuts_off_is_counted_apart():
    s = seq([0.0, -1.0, -2.0], [0, 1, 1], [0, 0, 0])
    used, tokens, worst, _mean, outside = compare([np.array([0.0, -1.0, -math.inf])], [s], 0)
    assert (used, tokens, worst, outside) == (1, 2, 0.0, 1)
    # a NaN from the learner is no cut token: it fails the gate
    nan = compare([np.array([0.0, math.nan, -2.0])], [s], 0)
    assert nan[4] == 0 and math.isnan(nan[2]) and not result(nan[2]).passed
    # nothing comparable at all: the gap is unknown, never a pass
    assert compare([np.array([0.0, -math.inf])], [seq([0.0, -1.0], [0, 1], [0, 0])], 0)[2] == math.inf


def result(worst: float, *, tokens: int = 1000, outside: int = 0, mode: str = "stop") -> GateResult:
    return GateResult(0, 8, tokens, worst, worst / 10, outside, 1e-3, "float32", mode)


def test_the_verdict_the_line_and_the_metrics():
    assert result(5e-7).passed and not result(2e-3).passed and not result(math.inf).passed
    assert result(0.0, outside=int(OUTSIDE_FRAC * 1000)).passed
    assert not result(0.0, outside=int(OUTSIDE_FRAC * 1000) + 1).passed
    line = result(0.39).line()
    assert line.startswith("parity gate FAILED at v0: learner vs engine log-probs on 1000 tokens of 8 samples")
    assert "max |diff| 0.39 (mean 0.039; tolerance 0.001, float32)" in line
    metrics = result(0.39).metrics()
    assert all(is_known(name) for name in metrics) and metrics["parity/gate_passed"] == 0.0
    assert json.loads(json.dumps(result(0.39).record()))["passed"] is False


def test_tolerance_follows_the_dtype_both_sides_compute_in():
    cfg = load_config(None, ["learner.dtype=bfloat16"])
    assert compute_dtype(cfg, "cpu") == "float32"  # the CPU learner and engine compute float32
    assert compute_dtype(cfg, "cuda:0") == "bfloat16"
    f16 = load_config(None, ["rollout.engine_kwargs={dtype: float16}"])
    assert compute_dtype(f16, "cpu") == "float16"  # the engine's own dtype: the coarser side
    assert ParityGate(cfg, "/nonexistent").tolerance("cuda:0") == (0.1, "bfloat16")
    assert ParityGate(load_config(None, ["control.parity_tolerance=0.5"]), "x").tolerance("cpu") == (0.5, "float32")
    with pytest.raises(ConfigError):
        load_config(None, ["control.parity_gate=maybe"])
    with pytest.raises(ConfigError):
        load_config(None, ["control.parity_tolerance=0"])
    assert load_config(None, []).control.parity_gate == "stop"


def test_the_causes_named_come_from_the_run_first(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"attn_logit_softcapping": 50.0, "sliding_window": None}))
    cfg = load_config(None, ["rollout.engine_kwargs={hf_overrides: {rms_norm_eps: 0.5}, quantization: fp8}"])
    causes = likely_causes(cfg, str(tmp_path))
    assert causes[0].startswith("the model's config sets attn_logit_softcapping=50.0:")
    assert "sliding_window" not in causes[0]  # None: not set
    assert causes[1].startswith("rollout.engine_kwargs.hf_overrides={'rms_norm_eps': 0.5} changes the engine's")
    assert causes[2].startswith("rollout.engine_kwargs.quantization='fp8' quantises")
    assert any("mis" in c or "maps to another parameter" in c for c in causes)
    assert any("tokenizer or chat template" in c for c in causes)


def test_stop_raises_a_one_line_expected_failure_and_warn_only_warns(caplog):
    stop = ParityGate(load_config(None, ["rollout.engine_kwargs={hf_overrides: {rope_theta: 10}}"]), "/nonexistent")
    with pytest.raises(ParityMismatch) as raised:
        stop.enforce(result(0.39))
    assert isinstance(raised.value, ExpectedFailure) and "\n" not in str(raised.value)
    text = str(raised.value)
    assert text.startswith("parity gate FAILED at v0") and "rollout.engine_kwargs.hf_overrides" in text
    assert "Stopped before any update (control.parity_gate=stop" in text
    stop.enforce(result(1e-6))  # a pass: nothing
    warn = ParityGate(load_config(None, ["control.parity_gate=warn"]), "/nonexistent")
    with caplog.at_level(logging.WARNING, logger="asyncrl.control.parity_gate"):
        warn.enforce(result(0.39, mode="warn"))
    assert "Training anyway (control.parity_gate=warn)" in caplog.text


def test_off_and_unrecorded_logprobs_leave_nothing_pending():
    assert not ParityGate(load_config(None, ["control.parity_gate=off"]), "x").pending
    assert ParityGate(load_config(None, []), "x").pending


def test_the_dashboard_alerts_on_a_failed_gate_read_as_untrusted():
    failed = result(0.39).record()
    (alert,) = state_alerts(failed)
    assert alert["kind"] == "parity_gate" and alert["value"] == pytest.approx(0.39)
    assert "stopped before any update" in alert["message"]
    assert "trained anyway" in state_alerts(result(0.39, mode="warn").record())[0]["message"]
    assert state_alerts(result(1e-6).record()) == []
    (nan,) = state_alerts({**failed, "max_abs_diff": None})  # a NaN gap, as JSON brings it
    assert nan["value"] is None and "not a number" in nan["message"]
    for bad in ({"passed": False, "max_abs_diff": "x", "tolerance": 1e-3}, ["passed"], "no", None):
        assert state_alerts(bad) == []
    huge = 10**400  # JSON integers a float cannot hold: no OverflowError on the dashboard's page
    assert state_alerts({**failed, "tolerance": huge}) == []
    assert state_alerts({**failed, "max_abs_diff": huge}) == []  # not what a trainer writes: no alert
    (unloadable,) = state_alerts(None, "no generator can load the weights (v3: ...)")
    assert unloadable["kind"] == "weights_unloadable"


class ScriptedLearner:
    """The two things ParityGate.check asks of a LearnerGroup: log-probs, and its device."""

    rank_info = ({"device": "cpu"},)

    def __init__(self, logprobs: dict[str, list[float]]):
        self.logprobs = logprobs

    def compute_logprobs(self, sequences, temperature):
        return [np.asarray(self.logprobs[s.group_id], dtype=np.float32) for s in sequences]


def test_one_odd_group_is_named_and_does_not_stop_the_run_a_mismatch_everywhere_does(caplog):
    """A record another writer put at the learner's version (or an elastic generator set up
    differently) disagrees on its own; the run's engines agree: named, not a reason to stop."""
    gate = ParityGate(load_config(None, []), "/nonexistent")
    honest = [-0.5, -1.0, -0.25]
    seqs = []
    for gid in ("g0", "g1", "g2", "odd"):
        s = seq([-20.0] * 3 if gid == "odd" else honest, [1, 1, 1], [0, 0, 0])
        s.group_id = gid
        seqs.append(s)
    learner = ScriptedLearner({gid: honest for gid in ("g0", "g1", "g2", "odd")})
    with caplog.at_level(logging.WARNING, logger="asyncrl.control.parity_gate"):
        r = gate.check(learner, seqs, 0)  # type: ignore[arg-type]
    assert r is not None and r.passed and r.disagreeing == ("odd",) and r.max_abs_diff > 19
    assert "1 of 4 groups disagree on their own (odd)" in caplog.text
    gate.enforce(r)  # passes: nothing raised

    everywhere = ParityGate(load_config(None, []), "/nonexistent")
    shifted = ScriptedLearner({gid: [x - 0.1 for x in honest] for gid in ("g0", "g1", "g2", "odd")})
    r = everywhere.check(shifted, seqs[:3], 0)  # type: ignore[arg-type]
    assert r is not None and not r.passed and len(r.disagreeing) == 3
    with pytest.raises(ParityMismatch):
        everywhere.enforce(r)
