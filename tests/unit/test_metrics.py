"""The metric catalogue, staleness summary, mergeable reductions and alert rules (pure, no servers)."""

from __future__ import annotations

import math
import re

import pytest

from asyncrl.monitor import alerts as A
from asyncrl.monitor import metrics as M
from asyncrl.types import merge_metrics


def test_staleness_summary_hand_computed():
    # n = 4, sorted [0, 1, 1, 2]: p50 at pos 1.5 -> 1 + .5*(1-1) = 1; p90 at pos 2.7 -> 1 + .7*(2-1) = 1.7
    out = M.staleness_summary([1, 0, 2, 1], max_staleness=2)
    assert out == pytest.approx(
        {
            "staleness/mean": 1.0,
            "staleness/max": 2.0,
            "staleness/p50": 1.0,
            "staleness/p90": 1.7,
            "staleness/frac_0": 0.25,
            "staleness/frac_1": 0.5,
            "staleness/frac_2": 0.25,
        }
    )


def test_staleness_summary_reports_empty_bins_and_sums_to_one():
    # [0, 0, 0, 3]: p50 at pos 1.5 -> 0; p90 at pos 2.7 -> 0 + .7*(3-0) = 2.1; bins 1 and 2 present but 0
    out = M.staleness_summary([0, 3, 0, 0], max_staleness=3)
    assert out["staleness/mean"] == pytest.approx(0.75)
    assert out["staleness/p50"] == 0.0
    assert out["staleness/p90"] == pytest.approx(2.1)
    assert [out[M.frac_name(k)] for k in range(4)] == [0.75, 0.0, 0.0, 0.25]
    assert sum(out[M.frac_name(k)] for k in range(4)) == pytest.approx(1.0)


def test_staleness_summary_on_policy():
    assert M.staleness_summary([0, 0], max_staleness=0) == {
        "staleness/mean": 0.0,
        "staleness/max": 0.0,
        "staleness/p50": 0.0,
        "staleness/p90": 0.0,
        "staleness/frac_0": 1.0,
    }


@pytest.mark.parametrize(
    "values, bound, message",
    [
        ([], 1, "empty"),
        ([0, -1], 1, "future policy version"),
        ([0, 3], 2, "exceeds max_staleness=2"),
        ([0], -1, "max_staleness=-1"),
    ],
)
def test_staleness_summary_rejects_bad_input(values, bound, message):
    with pytest.raises(ValueError, match=message):
        M.staleness_summary(values, max_staleness=bound)


def test_percentile_matches_linear_interpolation():
    xs = [1.0, 2.0, 4.0, 8.0, 16.0]
    assert M.percentile(xs, 0.0) == 1.0
    assert M.percentile(xs, 1.0) == 16.0
    assert M.percentile(xs, 0.5) == 4.0
    assert M.percentile(xs, 0.9) == pytest.approx(8.0 + 0.6 * 8.0)  # pos 3.6
    with pytest.raises(ValueError, match=re.escape("q=1.5")):
        M.percentile(xs, 1.5)


def test_catalogue_covers_the_data_contract():
    contract = [
        "staleness/mean",
        "staleness/max",
        "staleness/p50",
        "staleness/p90",
        "staleness/ahead",
        "queue/depth",
        "queue/pending",
        "queue/dropped_stale",
        "queue/dead_lettered",
        "drift/rollout_kl",
        "drift/abs_logp_diff",
        "drift/tis_ratio_mean",
        "drift/tis_ratio_max",
        "drift/tis_ratio_min",
        "drift/tis_capped_frac",
        "drift/masked_frac",
        "drift/geo_masked_frac",
        "drift/product_masked_frac",
        "drift/outlier_masked_frac",
        "drift/tis_seq_capped_frac",
        "drift/geo_seq_masked_frac",
        "drift/product_seq_masked_frac",
        "drift/outlier_seq_masked_frac",
        "drift/token_masked_frac",
        "policy/clip_frac",
        "policy/entropy",
        "throughput/gen_tokens_per_s",
        "throughput/train_tokens_per_s",
        "throughput/samples_per_s",
        "time/wait_data",
        "time/train",
        "time/sync",
        "time/step",
        "sync/seconds",
        "sync/apply_s",
        "reward/mean",
        "reward/std",
        "response/length_mean",
        "eval/reward_mean",
        "eval/reward_std",
        "eval/response_length_mean",
        "eval/reward_errors",
        "eval/prompts",
        "loss/policy",
        "loss/kl_ref",
        "loss/rollout_kl",
        "loss/entropy",
        "loss/total",
        "learner/version",
        "learner/grad_norm",
        "learner/lr",
        "drift/logprob_abs_diff_max",
        "drift/outside_kept_frac",
        "policy/ref_outside_kept_frac",
    ]
    contract += ["queue/stale_reissued", "queue/stale_abandoned", "queue/dropped_response_len_mean"]
    contract += ["queue/trained_response_len_mean"]
    contract += ["rollout/dropped_uniform_groups", "rollout/dropped_uniform_groups_step"]
    contract += ["rollout/reward_errors", "rollout/reward_timeouts"]
    contract += ["rollout/tool_calls", "rollout/tool_errors", "rollout/tool_timeouts", "rollout/context_full"]
    contract += [f"rollout/code_{k}" for k in ("tests", "passed", "timeouts", "violations", "sandbox_ms")]
    contract += ["sync/load_failures"]
    contract += [f"parity/gate_{k}" for k in ("max_abs_diff", "mean_abs_diff", "tolerance", "tokens", "passed")]
    contract += ["eval/timeouts", "eval/failed"]
    contract += ["teacher/kl_mean", "teacher/kl_seq_mean", "teacher/adv_abs_mean", "teacher/missing_samples"]
    contract += ["eval/step", "eval/version", "eval/measured", "eval/off_version", "eval/wall_s", "eval/generator_s"]
    contract += ["eval/skipped"]
    contract += [
        f"critic/{k}"
        for k in ("value_loss", "value_mean", "return_mean", "advantage_mean", "explained_variance", "clip_frac")
    ]
    contract += ["critic/grad_norm", "time/learner_critic"]
    contract += ["queue/outages", "queue/outage_s", "generators/restarts"]
    assert set(contract) == set(M.CATALOGUE)
    assert M.spec("drift/rollout_kl").reduce == "mean"
    assert M.spec("staleness/max").reduce == "max"
    assert M.spec("throughput/gen_tokens_per_s").reduce == "sum"
    assert M.spec("queue/dropped_stale").kind == "counter"
    assert M.spec("staleness/frac_12").reduce == "mean"
    assert M.is_known("staleness/frac_3") and not M.is_known("staleness/frac_x")
    with pytest.raises(KeyError, match="unknown metric 'reward/meen'"):
        M.spec("reward/meen")


def test_parts_merge_by_their_catalogue_reduction():
    # Two micro-batches of 100 and 300 tokens: mean is token-weighted, max is max, sum adds up.
    a = M.as_metric_values(
        {"drift/rollout_kl": 0.02, "drift/tis_ratio_max": 1.5, "throughput/train_tokens_per_s": 100.0}, count=100
    )
    b = M.as_metric_values(
        {"drift/rollout_kl": 0.05, "drift/tis_ratio_max": 3.0, "throughput/train_tokens_per_s": 250.0}, count=300
    )
    out = M.finish(merge_metrics([a, b]))
    assert out["drift/rollout_kl"] == pytest.approx((0.02 * 100 + 0.05 * 300) / 400)  # 0.0425
    assert out["drift/tis_ratio_max"] == 3.0
    assert out["throughput/train_tokens_per_s"] == 350.0


def test_clean_keeps_numbers_only():
    import numpy as np

    out = M.clean({"a": 1, "b": 2.5, "c": True, "d": None, "e": "x", "f": np.int64(7), "g": float("nan")})
    assert out["a"] == 1.0 and out["b"] == 2.5 and out["f"] == 7.0 and math.isnan(out["g"])
    assert set(out) == {"a", "b", "f", "g"}


def _alerts(latest, **kw):
    args = dict(
        thresholds=A.Thresholds(rollout_kl=0.05, masked_frac=0.2, staleness_frac=1.0),
        max_staleness=2,
        policy_version=10,
        generators={},
        now=1000.0,
    )
    args.update(kw)
    return {a["kind"]: a for a in A.evaluate_alerts(latest, **args)}


def test_alerts_fire_only_past_their_thresholds():
    # An async run's max at the bound is routine: only a mean at the bound alerts.
    quiet = {"drift/rollout_kl": 0.05, "drift/masked_frac": 0.2, "staleness/mean": 1.4, "staleness/max": 2.0}
    assert _alerts(quiet) == {}  # equal to a strict threshold is not an alert
    loud = {"drift/rollout_kl": 0.07, "drift/masked_frac": 0.25, "staleness/mean": 2.0, "staleness/max": 2.0}
    got = _alerts(loud)
    assert set(got) == {"rollout_kl", "masked_frac", "staleness"}
    assert got["rollout_kl"]["value"] == 0.07 and got["rollout_kl"]["threshold"] == 0.05
    assert got["staleness"]["threshold"] == 2.0
    # staleness_frac 0.5 of max_staleness 2 -> alert from mean staleness 1 on
    assert "staleness" in _alerts({"staleness/mean": 1.0}, thresholds=A.Thresholds(staleness_frac=0.5))
    # On-policy (max_staleness 0): staleness 0 is the normal state, never an alert.
    assert _alerts({"staleness/mean": 0.0, "staleness/max": 0.0}, max_staleness=0) == {}


def test_a_hostile_staleness_bound_is_no_bound(tmp_path):
    """max_staleness read from a run's summary.json or config.yaml is untrusted: a string, a list,
    a bool or a negative number is no bound (no staleness or lag alert), never a crash."""
    latest = {"staleness/mean": 4.0, "staleness/max": 4.0}
    gens = {"g": {"version": 1, "heartbeat": 1000.0}}
    for bad in ("4", [1], True, -1, 4.5, None):
        assert _alerts(latest, max_staleness=bad, generators=gens) == {}, bad
    assert set(_alerts(latest, max_staleness=4, generators=gens)) == {"staleness", "generator_lag"}

    from asyncrl.monitor.dashboard.rundir import RunDirSource

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time": 1.0, "staleness/mean": 4.0}\n')
    (tmp_path / "config.yaml").write_text('control:\n  max_staleness: "4"\n')
    src = RunDirSource(tmp_path)
    for bad in ('"4"', "[1]", "-1"):
        (tmp_path / "summary.json").write_text(f'{{"max_staleness": {bad}}}')
        snap = src.snapshot(src.run)
        assert snap["summary"]["max_staleness"] is None and snap["alerts"] == [], bad
    (tmp_path / "summary.json").unlink()  # no summary: config.yaml's string is no bound either
    assert src.snapshot(src.run)["summary"]["max_staleness"] is None
    (tmp_path / "summary.json").write_text('{"max_staleness": 4}')
    assert [a["kind"] for a in src.snapshot(src.run)["alerts"]] == ["staleness"]


def test_generator_alerts_lag_and_heartbeat():
    gens = {
        "g-ok": {"version": 8, "heartbeat": 995.0},  # lag 2 = max_staleness: fine
        "g-old": {"version": 7, "heartbeat": 999.0},  # lag 3 > 2
        "g-dead": {"version": 10, "heartbeat": 980.0},  # 20 s without heartbeat
    }
    args = dict(thresholds=A.Thresholds(), max_staleness=2, policy_version=10, generators=gens, now=1000.0)
    alerts = A.evaluate_alerts({}, **args, heartbeat_timeout_s=10.0)
    by = {(a["kind"], a["subject"]): a for a in alerts}
    assert set(by) == {("generator_lag", "g-old"), ("generator_heartbeat", "g-dead")}
    assert by[("generator_lag", "g-old")]["value"] == 3.0
    assert by[("generator_heartbeat", "g-dead")]["value"] == pytest.approx(20.0)
    assert by[("generator_heartbeat", "g-dead")]["threshold"] == 10.0
    # Unless told otherwise the timeout is rollout.heartbeat_timeout_s's default (60 s): 20 s is not dead.
    assert M.DEFAULT_HEARTBEAT_TIMEOUT_S == 60.0
    assert {a["kind"] for a in A.evaluate_alerts({}, **args)} == {"generator_lag"}


def test_prometheus_name():
    assert M.prometheus_name("staleness/frac_0") == "asyncrl_staleness_frac_0"
    assert M.prometheus_name("drift/tis-ratio.max") == "asyncrl_drift_tis_ratio_max"


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@given(bound=st.integers(0, 6), data=st.data())
def test_staleness_summary_invariants(bound, data):
    values = data.draw(st.lists(st.integers(0, bound), min_size=1, max_size=64))
    out = M.staleness_summary(values, max_staleness=bound)
    fracs = [out[M.frac_name(k)] for k in range(bound + 1)]
    assert sum(fracs) == pytest.approx(1.0)
    assert out["staleness/mean"] == pytest.approx(sum(k * f for k, f in enumerate(fracs)))
    assert min(values) <= out["staleness/p50"] <= out["staleness/p90"] <= out["staleness/max"] == max(values)
