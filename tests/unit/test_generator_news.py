"""The trainer's console says when a generator stops admitting work (and when it resumes),
once each: generators' own logs stay out of the console."""

from __future__ import annotations

from asyncrl.control.watchdog import GeneratorWatchdog


def test_each_change_of_a_generators_blocked_state_is_said_once():
    dog = GeneratorWatchdog([], run_state=None, timeout_s=60)
    ok = {"version": 3, "heartbeat": 1.0, "blocked": None}
    blocked = dict(ok, blocked="cannot load the announced weights v4 (ray-object://r/v4): no such object")
    assert dog.news({"gen-0": ok, "elastic-1": ok}) == []  # healthy from the start: nothing to say
    assert dog.news({"gen-0": ok, "elastic-1": blocked}) == [
        "elastic-1 stopped admitting work: cannot load the announced weights v4 (ray-object://r/v4): no such object"
    ]
    assert dog.news({"gen-0": ok, "elastic-1": blocked}) == []  # said once, not every step
    assert dog.news({"gen-0": ok, "elastic-1": ok}) == ["elastic-1 admits work again"]
    assert dog.news({"gen-0": {"version": 3}}) == []  # an old generator's heartbeat without the field
