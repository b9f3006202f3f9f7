"""A publish held by a generator that hangs mid-load must not hold the training loop for ever:
while the loop waits for it, the generator watchdog runs, and killing the hung generator (Ray
then fails the engine call) is what lets the publish end."""

from __future__ import annotations

import threading

from asyncrl.control.publish import Publisher
from asyncrl.control.state import LoopState
from asyncrl.sync import PublishResult
from asyncrl.types import WeightsFile


class Learner:
    def export_to_file(self, path: str) -> None:
        pass


class HeldSync:
    """The engine call of a publish returns only once the hung generator is killed."""

    def __init__(self) -> None:
        self.killed = threading.Event()

    def location_for(self, version: int) -> WeightsFile:
        return WeightsFile(f"/nonexistent/v{version}")

    def publish_file(self, location, version: int) -> PublishResult:
        if version == 1:
            assert self.killed.wait(30), "the publish was never released"
            return PublishResult(version, 0.0, 0.0, 1, errors=("gen-0: actor died",))
        return PublishResult(version, 0.0, 0.0, 1)


class RunState:
    def __init__(self) -> None:
        self.versions: list[int] = []

    def set_policy_version(self, version: int) -> None:
        self.versions.append(version)


def test_waiting_for_a_held_publish_runs_the_watchdog_until_it_ends():
    sync, run_state, checks = HeldSync(), RunState(), []

    def watchdog_check() -> list[str]:
        checks.append(1)
        sync.killed.set()  # the hung generator's heartbeat is too old: killed
        return ["gen-0"]

    pub = Publisher(Learner(), sync, run_state, LoopState(), while_waiting=watchdog_check)
    pub.publish(1, overlap=True)
    pub.publish(2, overlap=True)  # waits for v1 first: without the watchdog, for ever
    pub.finish()
    assert checks and run_state.versions == [1, 2]
    assert pub.last_result is not None and pub.last_result.version == 2


def test_a_tear_down_wait_outlives_a_failing_watchdog_and_a_step_wait_raises_it():
    """Redis gone: the watchdog's check fails. The step's wait raises it (the loop's outage
    handling takes it); the tear-down's wait must not, or the outage checkpoint never happens."""
    sync, run_state, checks = HeldSync(), RunState(), []

    def watchdog_check() -> list[str]:
        checks.append(1)
        if len(checks) >= 2:
            sync.killed.set()
        raise ConnectionError("Redis unreachable")

    pub = Publisher(Learner(), sync, run_state, LoopState(), while_waiting=watchdog_check)
    pub.publish(1, overlap=True)
    try:
        pub.finish()
    except ConnectionError:
        pass
    else:
        raise AssertionError("the step's wait swallowed the watchdog's failure")
    pub.join()  # the publish ends on its own (the second check lets it); nothing raised
    assert len(checks) == 2 and run_state.versions == [1]
