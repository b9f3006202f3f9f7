"""The block a run prints when it ends: what it did, where its time went, where its results are.

    print(run_summary(rows, startup_s=31.0, wall_s=95.2, counters=run_state.counters(), ...))

`rows` are the run's metrics.jsonl objects (one per step: the catalogue's names), so the
summary says exactly what the file says; numbers a step did not log are left out rather
than shown as 0. The facts the file does not hold (status, wall time, queue counters) also
go to run_dir/summary.json (`write_summary_file`), which `asyncrl dashboard RUN_DIR` shows
once the run and its Redis are gone.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncrl.rundir import SUMMARY_FILE
from asyncrl.rundir.store import RunPath, run_path, write_atomic

WINDOW = 10
"""Steps averaged for the "first -> last" reward and response length."""


def _mean(rows: Sequence[Mapping], name: str) -> float | None:
    values = [r[name] for r in rows if isinstance(r.get(name), (int, float))]
    return statistics.fmean(values) if values else None


def _sum(rows: Sequence[Mapping], name: str) -> float:
    return sum(r[name] for r in rows if isinstance(r.get(name), (int, float)))


def _f(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def run_summary(
    rows: Sequence[Mapping],
    *,
    startup_s: float,
    wall_s: float,
    counters: Mapping[str, int],
    max_staleness: int,
    status: str,
    metrics: RunPath,
    checkpoint: RunPath | None,
    hf_dir: RunPath | None,
    resume_cmd: str,
    dashboard_cmd: str | None = None,
    target_length: float | None = None,
) -> str:
    """``target_length``: characters of a correct answer, when the task knows it (the response
    length, in tokens, includes the EOS)."""
    steps = int(rows[-1]["step"]) if rows else 0
    wait, train, sync = (_sum(rows, f"time/{k}") for k in ("wait_data", "train", "sync"))
    first, last = rows[:WINDOW], rows[-WINDOW:]
    stale_max = max(
        (r["staleness/max"] for r in rows if isinstance(r.get("staleness/max"), (int, float))), default=None
    )
    lines = [
        f"run {status}: {steps} steps in {wall_s:.1f} s "
        f"(start-up {startup_s:.1f} s, waiting for data {wait:.1f} s, training {train:.1f} s, "
        f"weight sync {sync:.1f} s)",
        f"  reward          {_f(_mean(first, 'reward/mean'))} (first {len(first)} steps) -> "
        f"{_f(_mean(last, 'reward/mean'))} (last {len(last)})",
        f"  response length {_f(_mean(first, 'response/length_mean'), '.1f')} -> "
        f"{_f(_mean(last, 'response/length_mean'), '.1f')} tokens"
        + (f" (a correct answer: {target_length:.3g} characters + EOS)" if target_length is not None else ""),
        f"  staleness       mean {_f(_mean(rows, 'staleness/mean'), '.2f')}, max {_f(stale_max, '.0f')} "
        f"(bound {max_staleness})",
        "  groups          produced {}, trained {}, dropped as stale {}, dead-lettered {}".format(
            *(counters.get(k, 0) for k in ("groups_produced", "groups_trained", "dropped_stale", "dead_lettered"))
        ),
        *_stale_lines(counters),
        *(
            [f"  uniform groups  {counters['dropped_uniform']} dropped by the generators (rewards all tied)"]
            if counters.get("dropped_uniform", 0)
            else []
        ),
        f"  checkpoint      {checkpoint or '-'}",
        f"  model (HF)      {hf_dir or '-'}",
        f"  metrics         {metrics}",
    ]
    # The live dashboard stops with this process, which is about to exit: only the command
    # that serves the finished run from its directory is worth printing.
    if dashboard_cmd:
        lines.append(f"  dashboard       {dashboard_cmd}   (this finished run's charts, from the run dir)")
    lines.append(f"  resume          {resume_cmd}")
    return "\n".join(lines)


def _stale_lines(counters: Mapping[str, int]) -> list[str]:
    """What became of the stale-dropped groups: re-issued or given up, and whether they were
    the long ones (mean response length, dropped against trained)."""
    if not counters.get("dropped_stale", 0):
        return []

    def mean(kind: str) -> str:
        n = counters.get(f"{kind}_samples", 0)
        return f"{counters.get(f'{kind}_response_tokens', 0) / n:.1f}" if n else "-"

    return [
        f"  stale prompts   re-issued {counters.get('stale_reissued', 0)}, given up "
        f"{counters.get('stale_abandoned', 0)}; response length dropped {mean('dropped')} vs "
        f"trained {mean('trained')} tokens"
    ]


def write_summary_file(run_dir: str | Path | RunPath, record: Mapping[str, Any]) -> RunPath:
    """run_dir/summary.json, replaced whole (a reader never sees half a file); a resumed run
    rewrites it with its own session's facts."""
    path = run_path(run_dir) / SUMMARY_FILE
    write_atomic(path, (json.dumps(dict(record), indent=1, sort_keys=True) + "\n").encode())
    return path
