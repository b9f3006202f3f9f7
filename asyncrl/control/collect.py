"""Waiting for one step's groups: the queue read, and what the trainer checks while it waits.

    collector = BatchCollector(cfg, queue, run_state, learner, watchdog, stop)
    collector.start_counting()                        # after admission is configured
    items = collector.collect(min_version)            # [(entry id, group)] or fewer on stop

A long wait is not an error while some generator can still produce (alive, or being restarted
by Ray); only with none left does it end the run (NoGenerators). Groups the queue drops as
stale or dead-letters never reach the learner: their admission slots are given back here, so
generators can replace them (of the dead-lettered, only those a generator admitted:
asyncrl.queue.intake). Every record is checked against the run's contract on the way in
(`record_contract`: the model's vocabulary and length, the group size, the learner's version).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncrl.config import Config
from asyncrl.control.state import StopFlag
from asyncrl.data.contract import RecordContract
from asyncrl.data.images import ImageLimits

if TYPE_CHECKING:
    from asyncrl.control.watchdog import GeneratorWatchdog
    from asyncrl.learner import LearnerGroup
    from asyncrl.queue import RolloutQueue, RunState
    from asyncrl.types import RolloutGroup

log = logging.getLogger(__name__)

LEARNER_CHECK_S = 5.0
"""While waiting for data, how often the learner ranks' liveness and the generators'
heartbeats are checked."""
WAIT_LOG_S = 60.0
"""Past control.batch_timeout_s, a trainer still waiting for its generators says so this often."""


class NoGenerators(TimeoutError):
    """No full batch within control.batch_timeout_s, and no generator left that could make one."""


def record_contract(cfg: Config, learner: LearnerGroup) -> RecordContract:
    """What a record must fit to be trained now: ids the model has, sequences both the engine
    (rollout.engine_max_model_len) and the learner (its positions) hold, the run's group size,
    no version newer than the learner's."""
    return RecordContract(
        vocab_size=learner.vocab_size,
        max_len=min(cfg.rollout.engine_max_model_len, learner.max_positions),
        group_size=cfg.rollout.n_samples,
        stepwise=cfg.algo.stepwise,
        max_version=learner.version,
        teacher=cfg.rollout.teacher is not None,
        # A vision-language learner: each group's images are checked (limits, decoding) at intake.
        images=ImageLimits.of(cfg.rollout.images) if learner.pixels is not None else None,
    )


class BatchCollector:
    """Reads a step's worth of groups from the queue; see the module docstring."""

    def __init__(
        self,
        cfg: Config,
        queue: RolloutQueue,
        run_state: RunState,
        learner: LearnerGroup,
        watchdog: GeneratorWatchdog,
        stop: StopFlag,
        also_check: Callable[[], object] | None = None,
    ):
        self.cfg = cfg
        self.queue = queue
        self.run_state = run_state
        self.learner = learner
        self.watchdog = watchdog
        self.stop = stop
        self.also_check = also_check
        """Run with the watchdog while waiting (the loop's LoadWatch: weights no generator can load)."""
        self._counters_seen: dict[str, int] = {}
        self.dropped_uniform = 0
        """Groups the generators dropped as uniform (rollout.drop_uniform_groups) since the
        previous collect: the step's rollout/dropped_uniform_groups_step."""

    def start_counting(self) -> None:
        """Count lost groups from now on (what was lost before is not this trainer's to release)."""
        self._counters_seen = self.run_state.counters()

    def collect(self, min_version: int) -> list[tuple[str, RolloutGroup]]:
        """Block until a full step's groups no older than `min_version` are here (or stop was asked for)."""
        want = self.cfg.control.groups_per_step
        self.dropped_uniform = 0
        items: list[tuple[str, RolloutGroup]] = []
        t0 = time.monotonic()
        deadline = t0 + self.cfg.control.batch_timeout_s
        next_check = t0 + LEARNER_CHECK_S
        while len(items) < want and not self.stop.is_set:
            if time.monotonic() > next_check:
                self.learner.check_alive()  # a rank lost meanwhile (its node died) ends the wait
                self.watchdog.check()  # a hung generator is killed, and Ray restarts it
                for news in self.watchdog.news(self.run_state.generators()):  # e.g. a reward outage
                    log.warning(news)
                if self.also_check is not None:
                    self.also_check()
                self.run_state.reassert_owned()  # a state field another client overwrote is ours again
                next_check = time.monotonic() + LEARNER_CHECK_S
            if time.monotonic() > deadline:
                # Wait on while any generator can still produce (alive, or being restarted by
                # Ray); a multi-day run must not die of one slow restart.
                runnable = self.watchdog.runnable()
                if not runnable:
                    raise NoGenerators(
                        f"no full batch for {time.monotonic() - t0:.0f} s ({len(items)}/{want} groups) and no "
                        f"generator can run (own ones dead, no elastic heartbeat within "
                        f"rollout.heartbeat_timeout_s={self.cfg.rollout.heartbeat_timeout_s:g}); "
                        f"counters={self.run_state.counters()}"
                    )
                log.warning(
                    "no full batch for %.0f s (%d/%d groups); waiting for %s%s",
                    time.monotonic() - t0,
                    len(items),
                    want,
                    ", ".join(runnable),
                    # all-tie groups starve the step by design (failed rewards never make a tie): say so
                    f"; {self.dropped_uniform} groups dropped meanwhile as uniform (rollout.drop_uniform_groups)"
                    if self.dropped_uniform
                    else "",
                )
                deadline = time.monotonic() + WAIT_LOG_S
            contract = record_contract(self.cfg, self.learner)
            items += self.queue.get_batch(want - len(items), min_version, timeout=1.0, contract=contract)
            self._release_lost_admissions()
        return items

    def _release_lost_admissions(self) -> None:
        """Dropped-stale and dead-lettered groups will never be trained: free their slots (a
        dead-lettered record that no generator admitted holds none)."""
        now = self.run_state.counters()
        lost = sum(now.get(k, 0) - self._counters_seen.get(k, 0) for k in ("dropped_stale", "dead_lettered_admitted"))
        if lost > 0:
            self.run_state.release_admission(lost)
        # The generators give a uniform group's admission back themselves: only counted here.
        self.dropped_uniform += now.get("dropped_uniform", 0) - self._counters_seen.get("dropped_uniform", 0)
        self._counters_seen = now
