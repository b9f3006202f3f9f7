"""The staleness study's report: per-cell curves into a summary (final reward over seeds, drift
and masking over the last quarter of training, modeled seconds per step), its markdown tables
and its plot. bench/staleness.py runs the cells; see its docstring for what they are."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.staleness import Cell, Mode

SAMPLES_PER_GROUP = 8
"""rollout.n_samples of every cell (bench/staleness.py's config)."""


PUBLISH_S = 0.05
"""Modeled cost of a weight publish, learner side and generator side each (bench/simulate.py's
default): not measured here (the harness hands weights over in memory)."""


def modeled_step_s(gen_s: float, train_s: float, staleness: int, groups: int) -> float:
    """Seconds per trainer step of a real pipeline with these phase costs (bench/simulate.py:
    one generator running a step's groups together, the learner on its own device), plus
    PUBLISH_S per publish on each side. Every group takes exactly `gen_s`: the measured time is
    already the whole step's (the harness samples a step's groups in one batch, to its longest
    response), so a per-group spread on top of it would count the slowest group twice."""
    from bench.simulate import Scenario, simulate

    scenario = Scenario(
        generators=1,
        slots=groups,
        parallel=float(groups),
        gen_mean=gen_s,
        gen_cv=0.0,
        train_step=train_s,
        sync=PUBLISH_S,
        sync_pause=PUBLISH_S,
        groups_per_step=groups,
        max_staleness=staleness,
        steps=200,
    )
    return 1.0 / simulate(scenario).steps_per_s


def _stats(values: list[float]) -> dict:
    import numpy as np

    a = np.asarray(values, dtype=float)
    return {
        "mean": float(a.mean()),
        "std": float(a.std(ddof=1)) if a.size > 1 else 0.0,
        "min": float(a.min()),
        "max": float(a.max()),
        "n": int(a.size),
    }


def summarise(cells: list[Cell], mode: Mode) -> dict:
    """Per task, per correction, per staleness: final reward over seeds, drift and masking;
    the k = 0 run of a seed is every correction's k = 0."""
    import numpy as np

    out: dict = {}
    for task in dict.fromkeys(c.task for c in cells):
        mine = [c for c in cells if c.task == task]
        gen = float(np.median([s for c in mine for s in c.gen_s]))
        train = float(np.median([s for c in mine for s in c.train_s]))
        step_s = {k: modeled_step_s(gen, train, k, mode.groups) for k in mode.staleness}
        rows: dict = {}
        for corr in mode.corrections:
            row = {}
            for k in mode.staleness:
                runs = [c for c in mine if c.staleness == k and (k == 0 or c.correction == corr)]
                if not runs:
                    continue
                tail = max(1, mode.steps // 4)  # drift and masking over the last quarter of training
                row[str(k)] = {
                    "final_reward": _stats([c.final_reward for c in runs]),
                    "abs_logp_diff": float(np.mean([np.nanmean(c.abs_logp_diff[-tail:]) for c in runs])),
                    "rollout_kl": float(np.mean([np.nanmean(c.rollout_kl[-tail:]) for c in runs])),
                    "masked_frac": float(np.mean([np.mean(c.masked_frac[-tail:]) for c in runs])),
                    "modeled_wall_s": step_s[k] * mode.steps,
                }
            rows[corr] = row
        out[task] = {
            "gen_s_per_step": gen,
            "train_s_per_step": train,
            "modeled_step_s": {str(k): v for k, v in step_s.items()},
            "corrections": rows,
        }
    return out


def markdown(summary: dict, mode: Mode, label: str) -> str:
    ks = [str(k) for k in mode.staleness]
    lines = [f"Final reward (mean ± std over seeds, n per cell in brackets), {label}:", ""]
    for task, t in summary.items():
        lines += [
            f"**{task}**",
            "",
            "| correction | " + " | ".join(f"k={k}" for k in ks) + " |",
            "|---|" + "---|" * len(ks),
        ]
        for corr, row in t["corrections"].items():
            cells = []
            for k in ks:
                r = row.get(k)
                s = r["final_reward"] if r else None
                cells.append(f"{s['mean']:.3f} ± {s['std']:.3f} ({s['n']})" if s else "")
            lines.append(f"| {corr} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "|Δlogp| per token / masked fraction (last quarter of training):",
            "",
            "| correction | " + " | ".join(f"k={k}" for k in ks) + " |",
            "|---|" + "---|" * len(ks),
        ]
        for corr, row in t["corrections"].items():
            cells = [f"{row[k]['abs_logp_diff']:.3f} / {row[k]['masked_frac']:.2f}" if k in row else "" for k in ks]
            lines.append(f"| {corr} | " + " | ".join(cells) + " |")
        walls = ", ".join(f"k={k}: {float(v):.2f} s" for k, v in t["modeled_step_s"].items())
        lines += [
            "",
            f"Modeled seconds per step ({walls}) from the per-step times measured here: generation "
            f"{t['gen_s_per_step']:.3f} s, training {t['train_s_per_step']:.3f} s, and a modeled "
            f"{PUBLISH_S} s per weight publish on each side.",
            "",
        ]
    return "\n".join(lines)


def plot(cells: list[Cell], summary: dict, mode: Mode, path: Path) -> None:
    """Per task a row: eval reward against samples and against modeled wall-clock (the default
    correction, each k), final reward against k per correction (seed spread as error bars),
    and the masked fraction against k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = list(summary)
    fig, axes = plt.subplots(len(tasks), 4, figsize=(20, 4.2 * len(tasks)), squeeze=False)
    colours = plt.get_cmap("viridis")(np.linspace(0, 0.9, len(mode.staleness)))
    shown = "tis" if "tis" in mode.corrections else mode.corrections[0]
    for row, task in zip(axes, tasks, strict=True):
        step_s = summary[task]["modeled_step_s"]
        for k, colour in zip(mode.staleness, colours, strict=True):
            runs = [c for c in cells if c.task == task and c.staleness == k and (k == 0 or c.correction == shown)]
            if not runs:
                continue
            x = np.asarray(runs[0].samples)
            y = np.mean([c.eval_reward for c in runs], axis=0)
            label = "k=0 (sync)" if k == 0 else f"k={k}"
            row[0].plot(x, y, color=colour, label=label)
            steps = x / (mode.groups * SAMPLES_PER_GROUP)
            row[1].plot(steps * step_s[str(k)], y, color=colour, label=label)
        row[0].set(title=f"{task}: eval reward, correction={shown}", xlabel="samples trained", ylabel="reward")
        row[1].set(title=f"{task}: against modeled wall-clock", xlabel="seconds (modeled)", ylabel="reward")
        ks = np.asarray(mode.staleness)
        for i, (corr, data) in enumerate(summary[task]["corrections"].items()):
            have = [k for k in ks if str(k) in data]
            mean = [data[str(k)]["final_reward"]["mean"] for k in have]
            std = [data[str(k)]["final_reward"]["std"] for k in have]
            off = (i - 1.5) * 0.08
            row[2].errorbar(np.asarray(have) + off, mean, yerr=std, marker="o", capsize=3, label=corr)
            row[3].plot(have, [data[str(k)]["masked_frac"] for k in have], marker="o", label=corr)
        row[2].set(title=f"{task}: final reward by staleness", xlabel="staleness k", ylabel="reward", xticks=ks)
        row[3].set(title=f"{task}: masked / dropped fraction", xlabel="staleness k", ylabel="fraction", xticks=ks)
        for ax in row:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
