"""A Redis outage a client lives through is counted where it is lived through, the Retrier:
queue/outages and queue/outage_s (marked on the dashboard's charts). Calls that fail together
are one outage; a call that goes through at once is none. The real job's outages are counted in
tests/faults/test_faults_during_a_run.py.

    .venv/bin/python -m pytest tests/unit/test_outage_counts.py -q
"""

from __future__ import annotations

import threading

import redis

from asyncrl.queue.connection import Retrier


def flaky(fails: int, started: threading.Event | None = None, back: threading.Event | None = None):
    """A Redis call that raises ConnectionError ``fails`` times (or until ``back`` is set)."""
    left = [fails]

    def call():
        if started is not None:
            started.set()
        if left[0] > 0 or (back is not None and not back.is_set()):
            left[0] -= 1
            raise redis.ConnectionError("Connection refused")
        return "ok"

    return call


def test_a_call_that_fails_then_goes_through_is_one_outage():
    retry = Retrier("redis://127.0.0.1:1", deadline_s=30.0, first_wait=0.01, max_wait=0.01)
    assert retry(flaky(0)) == "ok" and retry.outages == 0 and retry.outage_s == 0.0
    assert retry(flaky(3)) == "ok"
    assert retry.outages == 1 and retry.outage_s > 0
    assert retry(flaky(0)) == "ok" and retry.outages == 1  # nothing new


def test_calls_failing_together_are_one_outage():
    retry = Retrier("redis://127.0.0.1:1", deadline_s=30.0, first_wait=0.01, max_wait=0.01)
    back = threading.Event()
    started = [threading.Event() for _ in range(3)]
    results: list[str] = []
    threads = [threading.Thread(target=lambda e=e: results.append(retry(flaky(1, e, back)))) for e in started]
    for t in threads:
        t.start()
    for e in started:
        e.wait(10)
    back.set()
    for t in threads:
        t.join(10)
    assert results == ["ok"] * 3
    assert retry.outages == 1, retry.outages
