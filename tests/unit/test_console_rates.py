"""What the console shows: a recent generation rate (not an average since start) and no live
bar when stdout is not a terminal."""

from __future__ import annotations

import io

from rich.console import Console

from asyncrl.control.progress import StepProgress
from asyncrl.rollout import stats as stats_mod
from asyncrl.rollout.stats import TokenRate


def test_generation_rate_is_over_the_last_window(monkeypatch):
    clock = {"t": 1000.0}
    monkeypatch.setattr(stats_mod.time, "time", lambda: clock["t"])
    rate, tokens = TokenRate(started_at=1000.0), 0
    # A slow start-up minute (100 tok/s), then 1,000 tok/s: the rate shows 1,000 after one window,
    # where the average since start would still say 325.
    for _ in range(60):
        clock["t"] += 1.0
        tokens += 100
        rate.update(tokens)
    for _ in range(20):
        clock["t"] += 1.0
        tokens += 1000
        recent = rate.update(tokens)
    assert recent == 1000.0
    assert tokens / (clock["t"] - 1000.0) == 325.0
    assert len(rate.samples) <= stats_mod.RATE_WINDOW_S + 2  # bounded, however long it runs


def test_first_calls_report_the_rate_since_start(monkeypatch):
    clock = {"t": 50.0}
    monkeypatch.setattr(stats_mod.time, "time", lambda: clock["t"])
    assert TokenRate(started_at=48.0).update(400) == 200.0  # 400 tokens in the 2 s since start


def test_no_live_bar_when_not_a_terminal():
    out = io.StringIO()
    with StepProgress(100, console=Console(file=out, force_terminal=False)) as p:
        for step in range(1, 6):
            p.update(step, {"reward/mean": 0.5, "staleness/mean": 1.0, "staleness/max": 2.0})
    assert not p.live and out.getvalue() == ""
    tty = io.StringIO()
    with StepProgress(100, console=Console(file=tty, force_terminal=True, width=120)) as p:
        p.update(3, {"reward/mean": 0.5})
    assert p.live and "3/100" in tty.getvalue()
