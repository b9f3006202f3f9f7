"""Weights no generator can load: said while it lasts, and the end of the run when it keeps on.

    watch = LoadWatch(run_state, max_failures=3, deadline_s=300.0)
    watch.note(result)          # after each publish (the Publisher's thread): a PublishResult
    watch.check()               # while the trainer waits: logs, or raises WeightsUnloadable

A publish that some generators fail to apply is their own business: each closes its own
admission until it loads the announced version (rollout/watcher.py) and the others go on. A
publish that *every* generator fails leaves nothing that can generate for the new version:
admission budgets by the weights each engine holds, so the run makes no fresh data, trains at
most the backlog the staleness bound still allows, and then waits. What is failing then is
said every LOG_EVERY_S, with the cause, until a generator loads the announced weights (its
heartbeat reports the version; they retry on their own) or a later publish loads somewhere.
Past ``sync.max_load_failures`` such publishes in a row, or ``sync.load_failure_deadline_s``
after the first, the trainer raises WeightsUnloadable: the loop checkpoints and prints the
resume command, as for a Redis outage past its deadline. Every failed load (one generator,
one publish) is counted in the run's ``weight_load_failures`` counter, which the dashboard
shows, and ``weights_unloadable`` in the run's state hash says why while it lasts.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.infra import ExpectedFailure

if TYPE_CHECKING:
    from asyncrl.queue import RunState
    from asyncrl.sync.weight_sync import PublishResult

log = logging.getLogger(__name__)

LOG_EVERY_S = 30.0
"""While no generator can load the announced weights, how often the trainer says so."""
COUNTER = "weight_load_failures"
STATE_FIELD = "weights_unloadable"


class WeightsUnloadable(RuntimeError, ExpectedFailure):
    """No generator could load the announced weights within sync.max_load_failures publishes or
    sync.load_failure_deadline_s."""


@dataclass
class FailingLoad:
    version: int
    """The newest version no generator could load."""
    since: float
    """time.monotonic() of the first publish of the streak."""
    attempts: int
    """Publishes in a row that every generator failed to apply."""
    engines: int
    cause: str
    """The first generator's error for the newest version."""

    def describe(self, now: float) -> str:
        return (
            f"no generator can load the weights (v{self.version}: {self.engines} of {self.engines} failed; "
            f"{self.attempts} publish(es) in a row over {now - self.since:.0f} s): {self.cause}"
        )


class LoadWatch:
    """Follows publishes that every generator failed; see the module docstring."""

    def __init__(
        self,
        run_state: RunState,
        *,
        max_failures: int | None,
        deadline_s: float | None,
        heartbeat_timeout_s: float = 60.0,
    ):
        self.run_state = run_state
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_failures = max_failures
        self.deadline_s = deadline_s
        self.failing: FailingLoad | None = None
        self.ended = False
        """Raised once: the tear-down that follows (waiting for a publish in flight) must not raise again."""
        self._next_say = 0.0

    def note(self, result: PublishResult) -> None:
        """Count the publish's failed loads and follow a streak of publishes no generator applied."""
        failed = len(result.errors)
        if failed:
            self.run_state.incr_many({COUNTER: failed})
        if result.engines == 0 or failed < result.engines:
            if failed < result.engines:
                self._clear(f"weights v{result.version} loaded")
            return
        now = time.monotonic()
        cause = _short(result.errors[0])
        prev = self.failing
        self.failing = FailingLoad(
            result.version,
            now if prev is None else prev.since,
            1 if prev is None else prev.attempts + 1,
            result.engines,
            cause,
        )
        self.run_state.set_state(weights_unloadable=self.failing.describe(now))  # STATE_FIELD
        self._next_say = 0.0  # said at the next check

    def _clear(self, why: str) -> None:
        if self.failing is None:
            return
        log.warning("the generators load weights again (%s): training goes on", why)
        self.failing = None
        self.run_state.set_state(weights_unloadable=None)  # STATE_FIELD

    def _recovered(self, failing: FailingLoad) -> bool:
        """A generator (own or elastic) reports, in a fresh heartbeat, the failing version or a
        newer one the trainer announced (a version past that is no proof: anyone can write it)."""
        fresh_since, announced = time.time() - self.heartbeat_timeout_s, self.run_state.policy_version()
        return any(
            failing.version <= beat.version <= announced and beat.heartbeat >= fresh_since
            for beat in self.run_state.generators().values()
        )

    def check(self) -> None:
        """Say what is failing (every LOG_EVERY_S); raise WeightsUnloadable past the limits."""
        failing = self.failing
        if failing is None or self.ended:
            return
        if self._recovered(failing):
            self._clear(f"a generator runs v{failing.version}")
            return
        now = time.monotonic()
        waited = now - failing.since
        over = []
        if self.max_failures is not None and failing.attempts >= self.max_failures:
            over.append(f"sync.max_load_failures={self.max_failures}")
        if self.deadline_s is not None and waited >= self.deadline_s:
            over.append(f"sync.load_failure_deadline_s={self.deadline_s:g}")
        if over:
            self.ended = True
            raise WeightsUnloadable(f"{failing.describe(now)} (reached {' and '.join(over)})")
        if now >= self._next_say:
            limits = [
                f"{self.max_failures - failing.attempts} more failed publish(es)" if self.max_failures else "",
                f"{self.deadline_s - waited:.0f} s" if self.deadline_s is not None else "",
            ]
            ends = " or ".join(x for x in limits if x)
            log.error(
                "%s; nothing new can be generated or trained until one loads them (each generator retries). %s",
                failing.describe(now),
                f"The run checkpoints and ends after {ends}." if ends else "Waiting for ever (no limit set).",
            )
            self._next_say = now + LOG_EVERY_S


_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failure)\b[^:]*:")


def _short(text: str, most: int = 400) -> str:
    """A generator's error on one line: its name, and the exception that ended a Ray traceback
    (what the generator raised, not the frames), cut to ``most`` characters."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    who = lines[0].split(":", 1)[0] if lines[0].startswith("generator ") else ""
    raised = [i for i, line in enumerate(lines) if i > 0 and _RAISED.match(line)]
    line = " ".join(lines[raised[-1] :] if raised else lines)
    line = f"{who}: {line}" if who and raised else line
    return line if len(line) <= most else line[: most - 3] + "..."
