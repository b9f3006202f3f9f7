"""The metric catalogue: every name the trainer emits, its reduction, kind and meaning.

    from asyncrl.monitor import metrics as M

    M.spec("drift/rollout_kl").reduce            # 'mean'
    M.staleness_summary([0, 1, 1, 2], max_staleness=2)
    # {'staleness/mean': 1.0, 'staleness/max': 2.0, 'staleness/p50': 1.0, 'staleness/p90': 1.7,
    #  'staleness/frac_0': 0.25, 'staleness/frac_1': 0.5, 'staleness/frac_2': 0.25}
    M.as_metric_values({"drift/rollout_kl": 0.01}, count=128)   # -> {name: MetricValue}, mergeable

One flat namespace, written once here so no component re-derives how a metric combines:

* ``reduce`` says how partial values of the *same step* merge (micro-batches, DP ranks,
  generators): ``mean`` (count-weighted), ``sum``, ``max`` or ``min``; it is the ``reduce`` of
  :class:`asyncrl.types.MetricValue`.
* ``kind`` is ``gauge`` (a value at this step) or ``counter`` (cumulative since the run
  started); the dashboard's Prometheus endpoint exports it as the metric TYPE.

The alert rules over these metrics are in :mod:`asyncrl.monitor.alerts`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.config.rollout import RolloutConfig
from asyncrl.types import MetricValue

REDUCTIONS = ("mean", "sum", "max", "min")
KINDS = ("gauge", "counter")
DEFAULT_HEARTBEAT_TIMEOUT_S: float = RolloutConfig.model_fields["heartbeat_timeout_s"].default
"""rollout.heartbeat_timeout_s's default, for a run whose own setting is unknown: a generator
silent this long is one the trainer's watchdog kills, so the dashboard shows it gone from then on."""


@dataclass(frozen=True)
class MetricSpec:
    name: str
    reduce: str
    kind: str
    unit: str
    doc: str


def _m(name: str, reduce: str, doc: str, unit: str = "", kind: str = "gauge") -> MetricSpec:
    assert reduce in REDUCTIONS and kind in KINDS, name
    return MetricSpec(name, reduce, kind, unit, doc)


_CATALOGUE: tuple[MetricSpec, ...] = (
    # Staleness of the groups trained this step: policy_version - behavior_version.
    _m("staleness/mean", "mean", "mean staleness of trained groups", "versions"),
    _m("staleness/max", "max", "max staleness of trained groups", "versions"),
    _m(
        "staleness/p50",
        "max",
        "median staleness (linear interpolation); max across parts is an upper bound",
        "versions",
    ),
    _m("staleness/p90", "max", "90th percentile staleness (linear interpolation)", "versions"),
    _m("staleness/ahead", "sum", "groups made by weights newer than the learner's (only after a resume)", "groups"),
    # staleness/frac_{k} is matched by pattern below (k = 0 .. max_staleness).
    # Replay queue, as seen by the trainer at the end of the step.
    _m("queue/depth", "max", "rollout groups waiting in the queue (stream length)", "groups"),
    _m("queue/pending", "max", "groups delivered to the learner but not yet acked", "groups"),
    _m("queue/dropped_stale", "max", "groups dropped as older than max_staleness", "groups", "counter"),
    _m("queue/dead_lettered", "max", "malformed records moved to the dead-letter stream", "groups", "counter"),
    _m("queue/outages", "max", "Redis outages the trainer lived through (this trainer process)", "", "counter"),
    _m("queue/outage_s", "max", "seconds of those outages, all together", "s", "counter"),
    _m("generators/restarts", "max", "generator processes Ray restarted after they died", "", "counter"),
    _m("queue/stale_reissued", "max", "prompts of stale-dropped groups run again", "groups", "counter"),
    _m("queue/stale_abandoned", "max", "stale-dropped groups whose prompt was not run again", "groups", "counter"),
    _m(
        "rollout/dropped_uniform_groups",
        "max",
        "groups dropped by generators because their rewards all tied (rollout.drop_uniform_groups)",
        "groups",
        "counter",
    ),
    _m("rollout/dropped_uniform_groups_step", "sum", "groups dropped as uniform during this step", "groups"),
    _m("queue/dropped_response_len_mean", "max", "mean response length of groups dropped as stale (run)", "tokens"),
    _m("queue/trained_response_len_mean", "max", "mean response length of trained groups (run)", "tokens"),
    # Train/rollout drift: train-side logprob (old) vs the engine's rollout logprob.
    _m("drift/rollout_kl", "mean", "k3 estimate of KL(rollout || train): mean of exp(d) - 1 - d, d = old - rollout"),
    _m("drift/abs_logp_diff", "mean", "mean |old_logprob - rollout_logprob| over response tokens", "nats"),
    _m(
        "drift/logprob_abs_diff_max",
        "max",
        "max |old_logprob - rollout_logprob| over loss tokens: learner/engine parity (0 up to float error at lr 0)",
        "nats",
    ),
    _m(
        "drift/outside_kept_frac",
        "mean",
        "top-k/top-p: fraction of loss tokens outside the learner's kept set (probability 0; masked)",
    ),
    _m("drift/tis_ratio_mean", "mean", "mean TIS ratio exp(old - rollout) before the cap"),
    _m("drift/tis_ratio_max", "max", "max TIS ratio before the cap"),
    _m("drift/tis_ratio_min", "min", "min TIS ratio before the cap"),
    _m("drift/tis_capped_frac", "mean", "fraction of loss tokens whose TIS weight was capped at tis_cap"),
    _m("drift/tis_seq_capped_frac", "mean", "sequence TIS: fraction of sequences whose weight was capped at tis_cap"),
    _m("drift/masked_frac", "mean", "fraction of loss tokens masked by any correction mask"),
    _m("drift/geo_masked_frac", "mean", "fraction of loss tokens masked by the geometric-mean mask"),
    _m("drift/geo_seq_masked_frac", "mean", "fraction of sequences masked by the geometric-mean mask"),
    _m("drift/product_masked_frac", "mean", "fraction of loss tokens masked by the product mask"),
    _m("drift/product_seq_masked_frac", "mean", "fraction of sequences masked by the product mask"),
    _m("drift/outlier_masked_frac", "mean", "fraction of loss tokens masked by the outlier-token mask"),
    _m("drift/outlier_seq_masked_frac", "mean", "fraction of sequences masked by the outlier-token mask"),
    _m("drift/token_masked_frac", "mean", "fraction of loss tokens masked by the token IS mask"),
    _m("policy/clip_frac", "mean", "fraction of tokens whose ratio was clipped by the policy loss"),
    _m("policy/entropy", "mean", "mean token entropy of the trained policy", "nats"),
    _m(
        "policy/ref_outside_kept_frac",
        "mean",
        "top-k/top-p: fraction of loss tokens the reference cannot sample (left out of the KL term)",
    ),
    # Throughput (sum over generators / ranks: each part reports its own rate).
    _m("throughput/gen_tokens_per_s", "sum", "generated tokens per second, all generators", "tokens/s"),
    _m("throughput/train_tokens_per_s", "sum", "trained tokens per second, all ranks", "tokens/s"),
    _m("throughput/samples_per_s", "sum", "trained samples per second", "samples/s"),
    # Where a trainer step's wall time goes (max over ranks: the slowest rank sets the pace).
    _m("time/wait_data", "max", "seconds waiting for enough fresh rollouts", "s"),
    _m("time/train", "max", "seconds in forward/backward/optimizer", "s"),
    _m(
        "time/sync",
        "max",
        "learner seconds publishing weights (async: the export; sync mode: until the engines run them)",
        "s",
    ),
    _m("time/step", "max", "wall seconds of the whole trainer step", "s"),
    _m("sync/seconds", "max", "learner seconds of this step's weight publish (same as time/sync)", "s"),
    _m("sync/apply_s", "max", "seconds the engines took to apply the last publish (pause, load, resume)", "s"),
    _m(
        "sync/load_failures",
        "max",
        "generator weight loads that failed, so far (one per generator per publish)",
        "loads",
        "counter",
    ),
    # The parity gate (asyncrl.control.parity_gate): logged once per start, in the row of the
    # step whose batch it checked before any update.
    _m(
        "parity/gate_max_abs_diff",
        "max",
        "gate: max |learner - engine logprob| at staleness 0 before any update",
        "nats",
    ),
    _m(
        "parity/gate_mean_abs_diff", "mean", "gate: mean |learner - engine logprob| over the tokens it compared", "nats"
    ),
    _m("parity/gate_tolerance", "max", "gate: the largest max |diff| it accepts (control.parity_tolerance)", "nats"),
    _m("parity/gate_tokens", "sum", "gate: tokens compared", "tokens"),
    _m("parity/gate_passed", "min", "gate: 1 passed, 0 failed (control.parity_gate=warn trained anyway)"),
    # Rewards that failed at the generators (asyncrl.rollout.scoring): counts so far, summed
    # over the generators alive now (a restarted generator counts from 0 again).
    _m("rollout/reward_errors", "max", "reward calls that raised or returned a non-number, so far", "calls", "counter"),
    _m("rollout/reward_timeouts", "max", "reward calls that ran past their timeout, so far", "calls", "counter"),
    # Multi-turn environments' per-episode counts (rollout.env=tools), summed over a step's groups.
    _m("rollout/tool_calls", "sum", "tool calls in this step's trained trajectories", "calls"),
    _m(
        "rollout/tool_errors",
        "sum",
        "of those, calls answered with an error (unreadable, unknown, bad args, raised)",
        "calls",
    ),
    _m("rollout/tool_timeouts", "sum", "of those, calls that ran past rollout.env_kwargs.tool_timeout_s", "calls"),
    # The code environment's sandboxed test runs (rollout.env=code), summed over a step's groups.
    _m("rollout/code_tests", "sum", "test runs of the code env's programs in this step's groups", "runs"),
    _m("rollout/code_passed", "sum", "of those, tests passed", "runs"),
    _m("rollout/code_timeouts", "sum", "of those, runs killed at rollout.env_kwargs.timeout_s", "runs"),
    _m(
        "rollout/code_violations",
        "sum",
        "responses whose program broke a sandbox limit (scored violation_reward)",
        "responses",
    ),
    _m("rollout/code_sandbox_ms", "sum", "wall time of those runs, in the sandbox", "ms"),
    _m(
        "rollout/context_full",
        "sum",
        "multi-turn episodes cut by the context budget (scored on their last reply, stop reason 'length')",
        "episodes",
    ),
    # Task.
    _m("reward/mean", "mean", "mean reward of trained samples"),
    _m("reward/std", "mean", "std of rewards of trained samples (mean across parts)"),
    _m("response/length_mean", "mean", "mean response length of trained samples", "tokens"),
    # On-policy distillation (rollout.teacher): k_t = rollout logp - teacher logp per sampled token.
    _m("teacher/kl_mean", "mean", "reverse KL to the teacher per trained token (rollout logp - teacher logp)", "nats"),
    _m("teacher/kl_seq_mean", "mean", "reverse KL to the teacher summed over a sample, mean over samples", "nats"),
    _m("teacher/adv_abs_mean", "mean", "mean |teacher advantage term| per trained token"),
    _m("teacher/missing_samples", "sum", "samples left out of the loss for want of teacher log-probs", "samples"),
    # The PPO critic (algo.critic): its values V, GAE returns R = A + V, one step per mini-batch.
    _m("critic/value_loss", "sum", "the critic's clipped value loss (weighted like the policy's terms)"),
    _m("critic/value_mean", "mean", "mean value V of the trained tokens, before the critic's step"),
    _m("critic/return_mean", "mean", "mean GAE return R = A + V of the trained tokens"),
    _m("critic/advantage_mean", "mean", "mean GAE advantage before whitening"),
    _m("critic/explained_variance", "mean", "1 - Var(R - V) / Var(R) over the trained tokens, before the step"),
    _m("critic/clip_frac", "mean", "fraction of trained tokens whose value loss the value clip held back"),
    _m("critic/grad_norm", "mean", "the critic's gradient norm before clipping (learner.grad_clip)"),
    _m(
        "time/learner_critic",
        "max",
        "seconds of the critic's forward, backward and optimizer step (its value pass is in the prepass)",
        "s",
    ),
    # Evaluation (control.eval_every): the held-out set, greedy unless control.eval_temperature.
    _m("eval/reward_mean", "mean", "mean reward on the held-out prompts"),
    _m("eval/reward_std", "mean", "std of rewards on the held-out prompts"),
    _m("eval/response_length_mean", "mean", "mean sampled tokens per held-out prompt (all turns)", "tokens"),
    _m("eval/reward_errors", "sum", "held-out samples whose reward (or episode) failed"),
    _m("eval/timeouts", "sum", "held-out prompts not rolled out within control.eval_timeout_s"),
    _m("eval/failed", "sum", "held-out prompts lost to a generator that died, raised or could not sample"),
    _m("eval/prompts", "max", "held-out prompts evaluated"),
    # In the row of the step its answers came in (the run's last at the latest), not the step it was due at.
    _m("eval/step", "max", "the step the evaluation in this row was due at"),
    _m("eval/version", "max", "the weight version the evaluation measured (published at eval/step)", "versions"),
    _m("eval/measured", "max", "held-out prompts rolled out under eval/version and scored"),
    _m("eval/off_version", "sum", "held-out prompts left out: not sampled under eval/version alone"),
    _m("eval/wall_s", "max", "seconds from handing the evaluation out to its last answer", "s"),
    _m("eval/generator_s", "sum", "generator seconds the evaluation took (all generators)", "s"),
    _m("eval/skipped", "max", "evaluations due while one still ran (run total)"),
    # Loss terms (already weighted by the per-token reduction weights: parts add up).
    _m("loss/policy", "sum", "policy-gradient loss"),
    _m("loss/kl_ref", "sum", "KL-to-reference term (before kl_coef)"),
    _m("loss/rollout_kl", "sum", "rollout-KL penalty term (before rollout_kl_coef)"),
    _m("loss/entropy", "sum", "entropy term (before entropy_coef)"),
    _m("loss/total", "sum", "the optimised loss"),
    # Learner.
    _m("learner/version", "max", "policy version after the step (optimizer steps taken)", "versions"),
    _m("learner/grad_norm", "max", "gradient norm before clipping"),
    _m("learner/lr", "max", "learning rate"),
)

CATALOGUE: dict[str, MetricSpec] = {s.name: s for s in _CATALOGUE}
_FRAC = re.compile(r"^staleness/frac_(\d+)$")


def spec(name: str) -> MetricSpec:
    """The catalogue entry of `name`; `staleness/frac_{k}` is matched for any k >= 0."""
    found = CATALOGUE.get(name)
    if found is not None:
        return found
    match = _FRAC.match(name)
    if match:
        k = int(match.group(1))
        return MetricSpec(name, "mean", "gauge", "", f"fraction of trained groups with staleness {k}")
    raise KeyError(f"unknown metric {name!r}; see asyncrl.monitor.metrics.CATALOGUE")


def is_known(name: str) -> bool:
    return name in CATALOGUE or _FRAC.match(name) is not None


def frac_name(k: int) -> str:
    return f"staleness/frac_{k}"


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default, Hyndman & Fan type 7).

    pos = q * (n - 1);  value = x[floor(pos)] + (pos - floor(pos)) * (x[ceil(pos)] - x[floor(pos)])
    """
    if not sorted_values:
        raise ValueError("percentile of an empty list")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"percentile q={q!r}: must be in [0, 1]")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return float(sorted_values[lo] + (pos - lo) * (sorted_values[hi] - sorted_values[lo]))


def staleness_summary(staleness: Iterable[int], max_staleness: int) -> dict[str, float]:
    """Staleness metrics of the groups trained in one step.

    staleness_i = policy_version - behavior_version_i (one value per trained group).
    Returns mean, max, p50, p90 and frac_k = #{i : staleness_i = k} / n for k = 0..max_staleness,
    so the fractions sum to 1. A value outside [0, max_staleness] means the staleness filter
    let a record through that it should have dropped: that raises, it is never clipped.
    """
    values = sorted(int(s) for s in staleness)
    if max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
    if not values:
        raise ValueError("staleness_summary: no trained groups (empty staleness list)")
    if values[0] < 0:
        raise ValueError(f"staleness {values[0]} < 0: a rollout cannot come from a future policy version")
    if values[-1] > max_staleness:
        raise ValueError(
            f"staleness {values[-1]} exceeds max_staleness={max_staleness}: the staleness filter should have dropped it"
        )
    n = len(values)
    out = {
        "staleness/mean": sum(values) / n,
        "staleness/max": float(values[-1]),
        "staleness/p50": percentile(values, 0.5),
        "staleness/p90": percentile(values, 0.9),
    }
    for k in range(max_staleness + 1):
        out[frac_name(k)] = values.count(k) / n
    return out


def as_metric_values(metrics: Mapping[str, float], count: float = 1.0) -> dict[str, MetricValue]:
    """Wrap one part's plain values (e.g. one micro-batch of `count` tokens) as mergeable values.

    A `mean` metric keeps total = value * count so that merged parts give the count-weighted mean.
    """
    out: dict[str, MetricValue] = {}
    for name, value in metrics.items():
        reduce = spec(name).reduce
        v = float(value)
        out[name] = MetricValue(reduce, v * count, count) if reduce == "mean" else MetricValue(reduce, v, 1.0)
    return out


def finish(merged: Mapping[str, MetricValue]) -> dict[str, float]:
    """Merged MetricValues -> the plain floats a sink logs."""
    return {name: float(m.value) for name, m in merged.items()}


def clean(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Keep the entries a sink can log: str names with real-number values (bool/None/str dropped)."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(name, str) and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
        elif hasattr(value, "item") and callable(value.item):  # 0-d numpy / torch scalars
            try:
                out[str(name)] = float(value.item())
            except (TypeError, ValueError):
                continue
    return out


# ----------------------------------------------------------------------------- prometheus


_PROM_BAD = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(name: str, prefix: str = "asyncrl_") -> str:
    """'staleness/frac_0' -> 'asyncrl_staleness_frac_0' (Prometheus allows [a-zA-Z0-9_:])."""
    return prefix + _PROM_BAD.sub("_", name)
