"""The alert badges a run shows (dashboard, run directory): rules over the latest metrics and
the generators' heartbeats (:func:`evaluate_alerts`), and over what the trainer keeps in the run's
state (:func:`state_alerts`). Pure functions over values read as untrusted, so each rule is
unit-testable."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncrl.monitor.metrics import DEFAULT_HEARTBEAT_TIMEOUT_S


@dataclass(frozen=True)
class Thresholds:
    """Mirrors MonitorConfig.alert_*; the trainer copies them into the run's state hash."""

    rollout_kl: float = 0.05
    masked_frac: float = 0.2
    staleness_frac: float = 1.0
    logprob_diff_max: float = 0.5
    reward_failure_rate: float = 0.5


def staleness_bound(value: Any) -> int | None:
    """A max_staleness read from a run's files or state: a non-negative int, else None (unknown).
    A string, a list or a negative number from a hand-edited summary.json is no bound to judge by."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def evaluate_alerts(
    latest: Mapping[str, float],
    *,
    thresholds: Thresholds,
    max_staleness: int | None,
    policy_version: int | None,
    generators: Mapping[str, Mapping[str, Any]],
    now: float,
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> list[dict[str, Any]]:
    """The alert badges of a run. Each alert: {"kind", "message", "value", "threshold", "subject"}.

    rollout_kl:   drift/rollout_kl > thresholds.rollout_kl
    masked_frac:  drift/masked_frac > thresholds.masked_frac
    logprob_diff_max: drift/logprob_abs_diff_max > thresholds.logprob_diff_max on a step that trained only
                  fresh data (staleness/max = 0: the learner's weights are the ones that sampled, so
                  any gap is a mismatch; with stale tokens the policy's own updates show up here too)
    staleness:    staleness/mean >= thresholds.staleness_frac * max_staleness (only if max_staleness > 0:
                  with 0 every sample is on-policy). The mean, not the max: an async run trains some
                  groups at the bound as a matter of course; a mean at the bound means nearly all are
    generator_lag: policy_version - generator version > max_staleness (its groups would all be dropped)
    generator_heartbeat: now - heartbeat > heartbeat_timeout_s (crashed, hung, or removed): the
                  run's rollout.heartbeat_timeout_s, after which the trainer's watchdog kills it
    reward_failures: a generator's reward_failure_rate > thresholds.reward_failure_rate (the
                  message names the reward through its last failure)
    """
    alerts: list[dict[str, Any]] = []
    max_staleness = staleness_bound(max_staleness)

    def add(kind: str, value: float, threshold: float, message: str, subject: str = "") -> None:
        alerts.append({"kind": kind, "value": value, "threshold": threshold, "message": message, "subject": subject})

    kl = latest.get("drift/rollout_kl")
    if kl is not None and kl > thresholds.rollout_kl:
        add(
            "rollout_kl",
            kl,
            thresholds.rollout_kl,
            f"rollout KL {kl:.4g} > {thresholds.rollout_kl:.4g}: train and rollout policies disagree",
        )
    worst = latest.get("drift/logprob_abs_diff_max")
    fresh = not latest.get("staleness/max")
    if worst is not None and fresh and worst > thresholds.logprob_diff_max:
        add(
            "logprob_diff_max",
            worst,
            thresholds.logprob_diff_max,
            f"max |learner - engine logprob| {worst:.4g} > {thresholds.logprob_diff_max:.4g} nats: "
            f"the learner's policy is not the one that sampled (sampling settings, masks or weights differ)",
        )
    masked = latest.get("drift/masked_frac")
    if masked is not None and masked > thresholds.masked_frac:
        add(
            "masked_frac",
            masked,
            thresholds.masked_frac,
            f"{masked:.1%} of tokens masked > {thresholds.masked_frac:.1%}: correction is discarding data",
        )
    smean = latest.get("staleness/mean")
    if smean is not None and max_staleness:
        bound = thresholds.staleness_frac * max_staleness
        if smean >= bound:
            add(
                "staleness",
                smean,
                bound,
                f"mean staleness {smean:.3g} reached {bound:g} (max_staleness={max_staleness}): nearly every "
                f"trained group is as old as the bound allows; the generators lag the learner",
            )
    for gid, gen in sorted(generators.items()):
        version = gen.get("version")
        if policy_version is not None and max_staleness is not None and version is not None:
            lag = policy_version - int(version)
            if lag > max_staleness:
                add(
                    "generator_lag",
                    float(lag),
                    float(max_staleness),
                    f"generator {gid} is {lag} versions behind (v{version} < v{policy_version}); "
                    f"its rollouts exceed max_staleness={max_staleness}",
                    gid,
                )
        heartbeat = gen.get("heartbeat")
        if heartbeat is not None and now - float(heartbeat) > heartbeat_timeout_s:
            age = now - float(heartbeat)
            add("generator_heartbeat", age, heartbeat_timeout_s, f"generator {gid}: no heartbeat for {age:.0f} s", gid)
        rate = gen.get("reward_failure_rate")
        if isinstance(rate, (int, float)) and rate > thresholds.reward_failure_rate:
            last = str(gen.get("reward_last_failure") or "")[:300]
            add(
                "reward_failures",
                float(rate),
                thresholds.reward_failure_rate,
                f"generator {gid}: {rate:.0%} of its latest reward scorings failed; the last: {last}",
                gid,
            )
    return alerts


def state_alerts(parity_gate: Any = None, weights_unloadable: Any = None) -> list[dict[str, Any]]:
    """Alerts from what the trainer keeps in the run's state hash (or summary.json), read as
    untrusted: a parity gate that failed (its record, asyncrl.control.parity_gate.GateResult),
    and the reason no generator can load the announced weights (asyncrl.control.loads)."""
    alerts: list[dict[str, Any]] = []
    if isinstance(parity_gate, Mapping) and parity_gate.get("passed") is False:
        # Numbers as floats first: a JSON integer too large for a float is not a number here.
        worst, tol = _float(parity_gate.get("max_abs_diff")), _float(parity_gate.get("tolerance"))
        # A NaN gap reaches the dashboard as null (JSON has no NaN): still a failed gate.
        number = worst is not None and math.isfinite(worst)
        if (number or parity_gate.get("max_abs_diff") is None) and tol is not None and math.isfinite(tol):
            version = parity_gate.get("version")
            then = "stopped before any update" if parity_gate.get("mode") == "stop" else "trained anyway"
            gap = f"{worst:.3g}" if number else "not a number"
            alerts.append(
                {
                    "kind": "parity_gate",
                    "value": worst if number else None,
                    "threshold": tol,
                    "message": f"parity gate failed at v{version if isinstance(version, int) else '?'}: max "
                    f"|learner - engine logprob| {gap} > {tol:.3g} nats at staleness 0 ({then})",
                    "subject": "",
                }
            )
    if isinstance(weights_unloadable, str) and weights_unloadable:
        alerts.append(
            {
                "kind": "weights_unloadable",
                "value": None,
                "threshold": None,
                "message": weights_unloadable[:400],
                "subject": "",
            }
        )
    return alerts


def _float(value: Any) -> float | None:
    """``value`` as a float if it is a non-NaN number a float can hold, else None."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return None if math.isnan(f) else f


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
