"""Waiting in tests without guessing how long things take on a loaded machine.

    wait_for(lambda: job.trainer_step() >= 3, timeout=120, what="step 3")   # a positive check
    holds_for(lambda: not done.is_set(), seconds=0.5, what="put still blocked")  # a negative one

A fixed ``sleep`` before an assertion guesses a margin: too short and a busy box fails the test,
too long and the test waits for nothing. ``wait_for`` returns as soon as the condition holds,
with a deadline generous enough for a box shared by several runs. ``holds_for`` is for checks
that something does *not* happen: it polls the condition through the whole window and fails at
the first poll where it breaks, so the window is the claim being tested ("still blocked after
several retries"), not a margin. Start that window only once there is evidence the system is in
the state being checked (the component has tried and been refused), so a slow start cannot make
the check pass without testing anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `condition` until it returns something truthy and return that; TimeoutError naming
    `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        time.sleep(interval)


def holds_for(condition: Callable[[], object], seconds: float, what: str, interval: float = 0.05) -> None:
    """Poll `condition` for `seconds`; AssertionError naming `what` at the first poll where it is
    false (it is checked once more at the end of the window)."""
    t0 = time.monotonic()
    deadline = t0 + seconds
    while True:
        if not condition():
            raise AssertionError(f"{what}: broken after {time.monotonic() - t0:.2f}s of {seconds:g}s")
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)
