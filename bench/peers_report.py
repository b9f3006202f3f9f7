"""bench/peers.py's report: one trainer run's figures from its per-step record, a trainer's
runs combined, the ratios against the best TRL peer per metric, the log line and the plot."""

from __future__ import annotations

import math
import statistics
from itertools import pairwise
from pathlib import Path

from bench.peers_time import crossing, finite, record, rolling

TRAINERS = ("trl_hf", "trl_vllm", "asyncrl_async", "asyncrl_sync")
# What each workload stands for in the report: the demo's step is mostly the engine's fixed cost.
# The controlled-length case runs every completion to its budget: pure system throughput.
ROLE = {"demo": "engine overhead", "realistic": "realistic", "realistic_exact": "controlled length"}
# Headline ratios: the realistic workloads' useful tokens/s and completions/s, the demo's completions/s.
HEADLINE = {
    "realistic": ("useful_tokens_per_s", "completions_per_s"),
    "realistic_exact": ("useful_tokens_per_s", "completions_per_s"),
    "demo": ("completions_per_s",),
}


def summarize(raw: dict, threshold: float, window: int = 10, budget_s: float | None = None) -> dict:
    """One run's figures; its time to the threshold is bench/peers_time's (a full window, at or
    before the budget: a step past it is not within the budget)."""
    steps, rewards = raw["steps"], raw["rewards"]
    out: dict = {
        "error": raw["error"],
        "seed": raw.get("seed"),
        "steps": len(steps),
        "wall_s": raw["wall_s"],
        "startup_s": None,
        "steps_per_s": None,
        "steps_per_s_median": None,
        "completions_per_s": None,
        "tokens_per_s": None,
        "useful_tokens_per_s": None,
        "reward_first": None,
        "reward_last": None,
        "time_to_threshold_s": None,
        "learner_padding": None,
        "threshold": threshold,
        "reward_curve": rewards,
        "step_times_s": [t - raw["t0"] for t in steps],
        "log": raw["log"],
    }
    if steps:
        out["startup_s"] = steps[0] - raw["t0"]
        # A missing reward (NaN or null in the child's record) is left out, never a crash here.
        first, last = [r for r in rewards[:window] if finite(r)], [r for r in rewards[-window:] if finite(r)]
        out["reward_first"] = statistics.fmean(first) if first else None
        out["reward_last"] = statistics.fmean(last) if last else None
    if len(steps) >= 2:  # steady: from the end of step 1 to the end of the last
        span = steps[-1] - steps[0]
        out["steps_per_s"] = (len(steps) - 1) / span
        out["completions_per_s"] = sum(raw["completions"][1:]) / span
        out["tokens_per_s"] = sum(raw["tokens"][1:]) / span
        if len(raw.get("useful_tokens", [])) == len(raw["tokens"]):
            out["useful_tokens_per_s"] = sum(raw["useful_tokens"][1:]) / span
        # Robust to a few slow steps (another process on the box): 1 / the median step time.
        out["steps_per_s_median"] = 1 / max(statistics.median(b - a for a, b in pairwise(steps)), 1e-9)
    steady = raw.get("profile", [])[1:]
    out["profile"] = profile(steady)
    # Per step as well: bench/simulate.py --from-peers draws a step's generation time from them.
    out["profile_steps"] = {k: [st.get(k) for st in steady] for k in out["profile"]}
    padding = [p for p in raw.get("padding", []) if p is not None]  # asyncrl's learner/padding_frac
    if padding:
        out["learner_padding"] = statistics.fmean(padding)
    out["time_to_threshold_s"] = crossing(*record(out), threshold, budget_s or float("inf"))
    return out


def profile(steps: list[dict]) -> dict:
    """asyncrl's per-step timings (bench/peers_run.PROFILE), steady steps: each one's mean and
    its median (one slow step on a shared box skews a mean)."""
    keys = sorted({k for st in steps for k in st})
    return {
        k: {"mean": statistics.fmean(v), "median": statistics.median(v)}
        for k in keys
        if (v := [st[k] for st in steps if isinstance(st.get(k), (int, float))])
    }


def rnd(x):
    return round(x, 3) if isinstance(x, float) else x


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def line(wl: str, trainer: str, s: dict) -> str:
    head = f"{wl:>9} {trainer:<13}"
    if s["error"] and s["completions_per_s"] is None:
        return f"{head} FAILED: {s['error']}"
    txt = (
        f"{head} start-up {fmt(s['startup_s'], '.1f')}s  {fmt(s['steps_per_s'])} steps/s  "
        f"{fmt(s['completions_per_s'], '.1f')} completions/s  {fmt(s['useful_tokens_per_s'], '.0f')} useful "
        f"of {fmt(s['tokens_per_s'], '.0f')} tokens/s  "
        f"reward {fmt(s['reward_first'], '.3f')} -> {fmt(s['reward_last'], '.3f')}  "
        f"to {s['threshold']}: {fmt(s['time_to_threshold_s'], '.1f')}s"
    )
    if s.get("learner_padding") is not None:
        txt += f"  padding {s['learner_padding']:.0%}"
    return txt + (f"  [{s['error']}]" if s["error"] else "")


# Per-run figures a trainer's combined entry averages (over the runs that finished).
FIGURES = (
    "startup_s",
    "steps_per_s",
    "steps_per_s_median",
    "completions_per_s",
    "tokens_per_s",
    "useful_tokens_per_s",
    "reward_first",
    "reward_last",
    "time_to_threshold_s",
    "learner_padding",
)
# The throughput figures a ratio is taken on; useful tokens/s is the realistic workload's headline.
METRICS = ("useful_tokens_per_s", "completions_per_s", "tokens_per_s")


def combine(runs: list[dict]) -> dict:
    """One trainer's repetitions: each figure's mean over the runs that finished, every run kept.
    A run that failed is left out of the means; the trainer fails only when every run did."""
    good = [r for r in runs if not r["error"] and r["completions_per_s"]]
    out: dict = {
        "error": None if good else "; ".join(r["error"] or "no steady steps" for r in runs),
        "failed_runs": len(runs) - len(good),
        "threshold": runs[0]["threshold"],
        "runs": runs,
    }
    for k in FIGURES:
        vals = [r[k] for r in good if r[k] is not None]
        out[k] = statistics.fmean(vals) if vals else None
    # A mean over the runs that reached the threshold alone would hide the ones that did not
    # (bench/peers_time has the bounded figure): only when every finished run reached it.
    if any(r["time_to_threshold_s"] is None for r in good):
        out["time_to_threshold_s"] = None
    keys = {k for r in good for k in r.get("profile", {})}
    out["profile"] = {
        k: {s: statistics.fmean(r["profile"][k][s] for r in good if k in r["profile"]) for s in ("mean", "median")}
        for k in sorted(keys)
    }
    return out


def add_ratios(report: dict) -> None:
    """Per workload and metric: the best TRL peer (failed ones left out), `ratio` = asyncrl_async's figure
    over the best peer's (means over the runs) and `runs` = the same ratio within each repetition.
    Completions/s and useful tokens/s differ where TRL cannot apply per-prompt budgets: it generates
    every prompt to the long budget, and the reward reads only each prompt's own budget."""
    for entry in report["workloads"].values():
        tr = entry["trainers"]
        ours = tr.get("asyncrl_async")
        entry["ratios"] = {}
        for m in METRICS:
            ok = {k: v for k, v in tr.items() if k.startswith("trl") and not v["error"] and v[m]}
            best = max(ok, key=lambda k: ok[k][m]) if ok else None
            good = best is not None and ours is not None and not ours["error"] and ours[m]
            per_run = []
            if good:
                for a, b in zip(ours["runs"], tr[best]["runs"], strict=False):
                    fine = not a["error"] and not b["error"] and a[m] and b[m]
                    per_run.append(a[m] / b[m] if fine else None)
            entry["ratios"][m] = {
                "best_peer": best,
                "ratio": ours[m] / ok[best][m] if good else None,
                "runs": per_run,
            }
    wls = report["workloads"]
    report["headline"] = {
        f"{wl}_{m}_ratio": wls[wl]["ratios"][m]["ratio"] for wl, ms in HEADLINE.items() if wl in wls for m in ms
    }


def plot(report: dict, paths: list[Path]) -> None:
    """Top: each trainer's rolling reward against wall-clock from launch, every seed, with the
    threshold and the budget (the headline); bottom: steady throughput (secondary)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = list(report["workloads"])
    fig, axes = plt.subplots(2, len(wls), figsize=(6 * len(wls), 8), squeeze=False)
    for i, wl in enumerate(wls):
        entry = report["workloads"][wl]
        trainers = entry["trainers"]
        names = [tr for tr in TRAINERS if tr in trainers]
        ax = axes[0][i]
        for tr in names:
            for k, s in enumerate(trainers[tr]["runs"]):
                times, rewards = record(s)  # paired: a reward whose step never ended is not plotted
                if times:
                    ax.plot(
                        times,
                        [math.nan if r is None else r for r in rolling(rewards)],
                        linestyle=("-", "--", ":", "-.")[k % 4],
                        color=f"C{TRAINERS.index(tr)}",
                        label=f"{tr} seed {s.get('seed')}",
                    )
        t = entry.get("time", {})
        ax.axhline(t.get("threshold", entry["spec"]["threshold"]), color="grey", linewidth=0.8, label="threshold")
        if t.get("budget_s"):
            ax.axvline(t["budget_s"], color="black", linewidth=0.8, linestyle=":", label="budget")
        ax.set_title(f"{wl}: reward (rolling mean of 5 steps) vs wall-clock from launch", fontsize=9)
        ax.set_xlabel("s from launch")
        ax.legend(fontsize=7)
        # The realistic workload's throughput is useful tokens/s; the demo's (engine overhead) completions/s.
        metric, unit = (
            ("useful_tokens_per_s", "useful tokens / s")
            if wl.startswith("realistic")
            else ("completions_per_s", "completions / s")
        )
        vals = [trainers[tr].get(metric) or 0.0 for tr in names]
        bars = axes[1][i].bar(names, vals, color=[f"C{TRAINERS.index(tr)}" for tr in names])
        axes[1][i].bar_label(
            bars,
            [("failed" if trainers[tr]["error"] and not v else f"{v:.1f}") for tr, v in zip(names, vals, strict=True)],
            fontsize=8,
        )
        role = f" ({ROLE[wl]})" if ROLE[wl] != wl else ""
        axes[1][i].set_title(f"{wl}{role}: {unit} (steady, mean of runs)", fontsize=9)
        axes[1][i].tick_params(axis="x", labelsize=8)
    fig.suptitle(report["machine"], fontsize=9)
    fig.tight_layout()
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=110)
