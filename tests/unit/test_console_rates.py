"""What the console shows: a recent generation rate (not an average since start) and no live
bar when stdout is not a terminal."""

from __future__ import annotations

import io
from collections import deque

from rich.console import Console

from asyncrl.control.progress import StepProgress
from asyncrl.rollout import generator as gen_mod
from asyncrl.rollout.generator import GeneratorActor


def test_generation_rate_is_over_the_last_window(monkeypatch):
    clock = {"t": 1000.0}
    monkeypatch.setattr(gen_mod.time, "time", lambda: clock["t"])
    g = GeneratorActor.__new__(GeneratorActor)  # the rate needs no engine
    g.counts, g._rate_samples, g._started_at = {"tokens": 0}, deque(), 1000.0
    # A slow start-up minute (100 tok/s), then 1,000 tok/s: the rate shows 1,000 after one window,
    # where the average since start would still say 325.
    for _ in range(60):
        clock["t"] += 1.0
        g.counts["tokens"] += 100
        g._recent_tokens_per_s()
    for _ in range(20):
        clock["t"] += 1.0
        g.counts["tokens"] += 1000
        rate = g._recent_tokens_per_s()
    assert rate == 1000.0
    assert g.counts["tokens"] / (clock["t"] - 1000.0) == 325.0
    assert len(g._rate_samples) <= gen_mod.RATE_WINDOW_S + 2  # bounded, however long it runs


def test_first_calls_report_the_rate_since_start(monkeypatch):
    clock = {"t": 50.0}
    monkeypatch.setattr(gen_mod.time, "time", lambda: clock["t"])
    g = GeneratorActor.__new__(GeneratorActor)
    g.counts, g._rate_samples, g._started_at = {"tokens": 0}, deque(), 48.0
    g.counts["tokens"] = 400
    assert g._recent_tokens_per_s() == 200.0  # 400 tokens in the 2 s since start


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
