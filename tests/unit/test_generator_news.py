"""The trainer's console says when a generator stops admitting work (and when it resumes),
once each: generators' own logs stay out of the console."""

from __future__ import annotations

from dataclasses import replace

from asyncrl.control.watchdog import GeneratorWatchdog
from asyncrl.queue.readback import Heartbeat, parse_heartbeat


def test_each_change_of_a_generators_blocked_state_is_said_once():
    dog = GeneratorWatchdog([], run_state=None, timeout_s=60)
    ok = Heartbeat(heartbeat=1.0, version=3)
    blocked = replace(ok, blocked="cannot load the announced weights v4 (ray-object://r/v4): no such object")
    assert dog.news({"gen-0": ok, "elastic-1": ok}) == []  # healthy from the start: nothing to say
    assert dog.news({"gen-0": ok, "elastic-1": blocked}) == [
        "elastic-1 stopped admitting work: cannot load the announced weights v4 (ray-object://r/v4): no such object"
    ]
    assert dog.news({"gen-0": ok, "elastic-1": blocked}) == []  # said once, not every step
    assert dog.news({"gen-0": ok, "elastic-1": ok}) == ["elastic-1 admits work again"]
    old = parse_heartbeat({"version": 3, "heartbeat": 1.0})  # an old generator's heartbeat without the field
    assert dog.news({"gen-0": old}) == []
