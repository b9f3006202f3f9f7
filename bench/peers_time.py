"""bench/peers.py's headline: learning against wall-clock time, as a user feels it.

Per run, from its per-step record (each step's end, in seconds from the trainer's process
launch, and the step's mean reward):

  rolling reward   at each step, the mean reward of the last ROLL steps (fewer at the start);
  time to threshold  the end of the first step at which a full window's rolling mean (ROLL
                   steps) reaches the threshold, within the horizon; a run that never does is
                   *censored* at the horizon or at its own last step if that came first: its
                   time is only known to be longer. Never a shorter window: a run that ended
                   normally has one past the horizon, so a short window would only ever count
                   for a run that crashed early (or one too short for the window at all);
  reward at t      the rolling reward at the last step that ended at or before t (no
                   interpolation: a step's reward is known when it ends, not before; a run that
                   ended before t keeps its last); None while the run has no step yet (still
                   starting up).

A run's record pairs each step's end with its reward up to the last step that has both (a
reward whose step never ended is left out); a reward that is not a finite number is missing.

The horizon is the workload's wall-clock budget (every trainer stopped at its first step past
it) or, without one (a fixed step count), the last run's last step.

Per trainer, over its seeds (runs that failed without a step are left out): the time to the
threshold is the mean over runs with a censored run counted at its censoring time, so if any run
never reached it the mean is a lower bound (`lower_bound: true`). Reward at t: mean, min and
max over the runs that had a step by t.

The ratio is the best TRL peer's time over asyncrl async's (> 1: asyncrl is faster). The best
peer has the shortest time (a censored time counts as its bound; ties go to the peer with
the higher reward at the horizon). When only the peer's time is a bound the ratio is a lower
bound; when only asyncrl's is, an upper bound; when both are (each missed the threshold in at
least one seed: kind "neither_reached"), there is none. `vs_sync` is the
same ratio against asyncrl sync.
"""

from __future__ import annotations

import math
import statistics

ROLL = 5
# Reward at equal wall-clock: these fractions of the horizon.
FRACTIONS = (0.25, 0.5, 0.75, 1.0)
OURS = "asyncrl_async"


def finite(x: object) -> bool:
    """A reward to count: a finite number (a child's record is JSON: null, NaN or a string is missing)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def record(run: dict) -> tuple[list[float], list[float]]:
    """A run's step ends and rewards, paired up to the last step that has both: a TRL run that
    died after scoring a step's completions has a reward whose step never ended."""
    n = min(len(run["step_times_s"]), len(run["reward_curve"]))
    return run["step_times_s"][:n], run["reward_curve"][:n]


def rolling(rewards: list[float], n: int = ROLL) -> list[float | None]:
    """The mean of the last n finite rewards up to each step (None where there is none)."""
    out: list[float | None] = []
    for i in range(len(rewards)):
        window = [r for r in rewards[max(0, i - n + 1) : i + 1] if finite(r)]
        out.append(statistics.fmean(window) if window else None)
    return out


def crossing(times: list[float], rewards: list[float], threshold: float, horizon: float, n: int = ROLL) -> float | None:
    """The end of the first step (at or before the horizon) whose full window's mean reaches
    the threshold; None when no step does."""
    roll = rolling(rewards, n)
    for i, (t, r) in enumerate(zip(times, roll, strict=True)):
        if t > horizon:
            break
        if i + 1 >= n and r is not None and r >= threshold:
            return t
    return None


def reward_at(times: list[float], rewards: list[float], t: float, n: int = ROLL) -> float | None:
    """The rolling reward at the last step that ended at or before t; None before the first step."""
    roll = rolling(rewards, n)
    last = None
    for ts, r in zip(times, roll, strict=True):
        if ts > t:
            break
        last = r
    return last


def spread(vals: list[float | None]) -> dict:
    got = [v for v in vals if v is not None]
    return {
        "mean": statistics.fmean(got) if got else None,
        "min": min(got) if got else None,
        "max": max(got) if got else None,
        "n": len(got),
        "runs": vals,
    }


def horizon_of(trainers: dict[str, list[dict]], budget_s: float | None) -> float | None:
    if budget_s:
        return float(budget_s)
    ends = [t[-1] for runs in trainers.values() for r in runs if (t := record(r)[0])]
    return max(ends) if ends else None


def trainer_figures(runs: list[dict], threshold: float, horizon: float, times: list[float]) -> dict:
    """One trainer's seeds: time to threshold (a lower bound if any seed never reached it) and
    the reward at each of `times` (seconds; keyed by `label`)."""
    good = [rec for r in runs if (rec := record(r))[0]]
    seeds = [r.get("seed") for r in runs if record(r)[0]]
    per_run = [crossing(ts, rs, threshold, horizon) for ts, rs in good]
    reached = sum(t is not None for t in per_run)
    counted = [min(horizon, ts[-1]) if t is None else t for t, (ts, _) in zip(per_run, good, strict=True)]
    return {
        "seeds": seeds,
        "time_to_threshold_s": statistics.fmean(counted) if counted else None,
        "lower_bound": reached < len(per_run),
        "reached_runs": reached,
        "runs": len(good),
        "time_to_threshold_runs": per_run,
        "reward_at": {label(t): spread([reward_at(ts, rs, t) for ts, rs in good]) for t in times},
    }


def ratio(ours: dict | None, peer: dict | None) -> tuple[float | None, str | None]:
    """(peer's time / ours, kind): kind is "exact", "lower_bound", "upper_bound" or None."""
    if not ours or not peer or not ours["runs"] or not peer["runs"]:
        return None, None
    a, b = ours["time_to_threshold_s"], peer["time_to_threshold_s"]
    if not (finite(a) and finite(b) and a > 0):  # no launch-relative time is 0: a broken record
        return None, None
    if ours["lower_bound"] and peer["lower_bound"]:
        return None, "neither_reached"
    kind = "lower_bound" if peer["lower_bound"] else "upper_bound" if ours["lower_bound"] else "exact"
    return b / a, kind


def time_figures(runs: dict[str, list[dict]], threshold: float, budget_s: float | None) -> dict:
    """A workload's wall-clock figures: per trainer, and asyncrl async against the best TRL peer."""
    horizon = horizon_of(runs, budget_s)
    out: dict = {"threshold": threshold, "budget_s": budget_s, "horizon_s": horizon, "roll": ROLL}
    if horizon is None:
        return {
            **out,
            "times_s": [],
            "trainers": {},
            "best_peer": None,
            "ratio": None,
            "ratio_kind": None,
            "vs_sync": {"ratio": None, "kind": None},
            "reward_at_horizon": {},
            "reward_at_horizon_seeds": {},
        }
    # Evaluated at the exact fractions (the last is the horizon itself, so the step that ends a
    # horizon without a budget counts), labelled to 0.1 s.
    times = [f * horizon for f in FRACTIONS]
    trainers = {tr: trainer_figures(rs, threshold, horizon, times) for tr, rs in runs.items()}
    end = label(times[-1])
    peers = [tr for tr, v in trainers.items() if tr.startswith("trl") and v["runs"]]
    best = min(
        peers,
        key=lambda tr: (
            trainers[tr]["time_to_threshold_s"],
            trainers[tr]["lower_bound"],
            -(m if (m := trainers[tr]["reward_at"][end]["mean"]) is not None else -math.inf),
        ),
        default=None,
    )
    value, kind = ratio(trainers.get(OURS), trainers.get(best) if best else None)
    return {
        **out,
        "times_s": [round(t, 1) for t in times],
        "trainers": trainers,
        "best_peer": best,
        "ratio": value,
        "ratio_kind": kind,
        # asyncrl's own baseline: sync's time over async's, the same bounds.
        "vs_sync": dict(zip(("ratio", "kind"), ratio(trainers.get(OURS), trainers.get("asyncrl_sync")), strict=True)),
        "reward_at_horizon": {tr: v["reward_at"][end]["mean"] for tr, v in trainers.items()},
        # How many seeds each of those means is over: a seed with no step by the horizon has none.
        "reward_at_horizon_seeds": {tr: v["reward_at"][end]["n"] for tr, v in trainers.items()},
    }


def label(t: float) -> str:
    """A time's key in `reward_at`: seconds to 0.1."""
    return f"{round(t, 1):g}"


def fmt_time(v: dict) -> str:
    if v["time_to_threshold_s"] is None:
        return "-"
    bound = ">= " if v["lower_bound"] else ""
    return f"{bound}{v['time_to_threshold_s']:.0f} s ({v['reached_runs']}/{v['runs']} reached)"


def fmt_ratio(value: float | None, kind: str | None) -> str:
    if value is None:
        return "none (neither reached the threshold)" if kind == "neither_reached" else "-"
    sign = {"lower_bound": ">= ", "upper_bound": "<= "}.get(kind or "", "")
    return f"{sign}{value:.2f}x" + (f" ({kind.replace('_', ' ')})" if kind != "exact" else "")


def lines(wl: str, fig: dict) -> list[str]:
    """The log's summary of a workload's wall-clock figures."""
    if not fig["trainers"]:
        return [f"{wl:>9} wall-clock: no run had a step"]
    head = f"{wl:>9} to reward {fig['threshold']} (rolling {fig['roll']}), horizon {fig['horizon_s']:.0f} s:"
    out = [head]
    for tr, v in fig["trainers"].items():
        at = "  ".join(
            f"@{t}s {'-' if s['mean'] is None else format(s['mean'], '.3f')}"
            + (f" [{s['n']} of {v['runs']}]" if s["mean"] is not None and s["n"] < v["runs"] else "")
            for t, s in v["reward_at"].items()
        )
        out.append(f"{'':>9} {tr:<13} {fmt_time(v):<28} reward {at}  seeds {v['seeds']}")
    out.append(f"{'':>9} asyncrl_async vs {fig['best_peer']}: {fmt_ratio(fig['ratio'], fig['ratio_kind'])} faster")
    vs = fig["vs_sync"]
    out.append(f"{'':>9} asyncrl_async vs asyncrl_sync: {fmt_ratio(vs['ratio'], vs['kind'])} faster")
    return out
