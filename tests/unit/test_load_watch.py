"""LoadWatch: publishes that every generator failed to load are counted, said while they last,
and end the run past sync.max_load_failures or sync.load_failure_deadline_s; a generator that
loads (a later publish, or its own retry seen in its heartbeat) ends the streak."""

from __future__ import annotations

import logging
import time

import pytest

from asyncrl.control import loads
from asyncrl.control.loads import LoadWatch, WeightsUnloadable
from asyncrl.infra import ExpectedFailure
from asyncrl.queue.readback import Heartbeat
from asyncrl.sync import PublishResult

RAY_ERROR = (
    "generator 0: RayTaskError(WeightLoadError): ray::GeneratorActor.update_weights() (pid=7, ip=127.0.0.1)\n"
    '  File "asyncrl/rollout/engine_weights.py", line 120, in load_weights\n'
    "    raise WeightLoadError(\n"
    "asyncrl.rollout.engine_weights.WeightLoadError: loading /dev/shm/r-v{v}.safetensors as version {v} failed "
    "after 2 attempts; still running version 0: There is no module or parameter named 'lm_head'"
)


class RunState:
    """What LoadWatch reads and writes of the run's Redis state."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.state: dict[str, str] = {}
        self.beats = {"gen-0": Heartbeat(heartbeat=1.0), "gen-1": Heartbeat(heartbeat=1.0)}

    def incr_many(self, counts: dict[str, int]) -> None:
        for k, n in counts.items():
            self.counters[k] = self.counters.get(k, 0) + n

    def set_state(self, **fields) -> None:
        for k, v in fields.items():
            if v is None:
                self.state.pop(k, None)
            else:
                self.state[k] = v

    def policy_version(self) -> int:
        return 4

    def generators(self) -> dict[str, Heartbeat]:
        return self.beats


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(loads.time, "monotonic", c)
    return c


def failed(version: int, engines: int = 2, failing: int = 2) -> PublishResult:
    errors = tuple(RAY_ERROR.format(v=version).replace("generator 0", f"generator {i}") for i in range(failing))
    return PublishResult(version, 0.1, 0.1, engines, errors=errors)


def test_some_generators_failing_is_counted_but_is_no_streak(clock):
    rs = RunState()
    watch = LoadWatch(rs, max_failures=1, deadline_s=1.0)
    watch.note(failed(1, failing=1))
    clock.now += 100
    watch.check()  # the other generator loaded v1: nothing to end
    assert watch.failing is None and rs.counters == {"weight_load_failures": 1}


def test_publishes_no_generator_loads_end_the_run_at_the_count(clock, caplog):
    rs = RunState()
    watch = LoadWatch(rs, max_failures=3, deadline_s=None)
    with caplog.at_level(logging.ERROR, logger="asyncrl.control.loads"):
        for v in (1, 2):
            watch.note(failed(v))
            clock.now += 5
            watch.check()
    assert rs.counters["weight_load_failures"] == 4
    said = caplog.records[-1].getMessage()
    assert said.startswith("no generator can load the weights (v2: 2 of 2 failed; 2 publish(es) in a row over 10 s): ")
    # The cause is what the generator raised, not Ray's frames.
    assert "generator 0: asyncrl.rollout.engine_weights.WeightLoadError: loading" in said and "File " not in said
    assert "There is no module or parameter named 'lm_head'" in said
    assert said.endswith("The run checkpoints and ends after 1 more failed publish(es).")
    assert "no generator can load the weights (v2" in rs.state[loads.STATE_FIELD]  # the dashboard's alert
    watch.note(failed(3))
    with pytest.raises(WeightsUnloadable) as ended:
        watch.check()
    assert isinstance(ended.value, ExpectedFailure)
    assert str(ended.value).endswith("(reached sync.max_load_failures=3)")
    assert "3 publish(es) in a row" in str(ended.value)
    watch.check()  # said once: the tear-down's waits go on


def test_the_deadline_ends_a_wait_with_one_failed_publish_and_it_is_said_meanwhile(clock, caplog):
    rs = RunState()
    watch = LoadWatch(rs, max_failures=None, deadline_s=100.0)
    watch.note(failed(1))
    with caplog.at_level(logging.ERROR, logger="asyncrl.control.loads"):
        for _ in range(19):  # every 5 s, as the trainer checks while it waits for data
            clock.now += 5
            watch.check()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 4, said  # at 5, 35, 65 and 95 s: never silent, never every check
    assert said[-1].endswith("The run checkpoints and ends after 5 s.")
    clock.now += 5
    with pytest.raises(WeightsUnloadable, match=r"over 100 s\).*\(reached sync.load_failure_deadline_s=100\)"):
        watch.check()


def test_a_generator_that_loads_the_version_on_its_own_ends_the_streak(clock, caplog):
    rs = RunState()
    watch = LoadWatch(rs, max_failures=2, deadline_s=10.0)
    watch.note(failed(4))
    rs.beats["gen-0"] = Heartbeat(heartbeat=time.time() - 3600, version=4)  # stale: no proof
    rs.beats["gen-1"] = Heartbeat(heartbeat=time.time(), version=99)  # never announced: no proof
    watch.check()
    assert watch.failing is not None
    rs.beats["gen-1"] = Heartbeat(heartbeat=time.time(), version=4)  # its retry loaded v4
    with caplog.at_level(logging.WARNING, logger="asyncrl.control.loads"):
        clock.now += 50
        watch.check()
    assert watch.failing is None and loads.STATE_FIELD not in rs.state
    assert "the generators load weights again (a generator runs v4)" in caplog.text
    watch.note(failed(5))  # a new streak starts from one
    assert watch.failing is not None and watch.failing.attempts == 1
    watch.note(PublishResult(6, 0.1, 0.1, 2))  # a publish that loaded
    assert watch.failing is None


def test_no_own_generator_is_no_failure(clock):
    watch = LoadWatch(RunState(), max_failures=1, deadline_s=1.0)
    watch.note(PublishResult(1, 0.1, 0.1, 0))
    clock.now += 10
    watch.check()
    assert watch.failing is None
