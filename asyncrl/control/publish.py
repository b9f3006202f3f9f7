"""Weights from the learners to the engines, at most one publish in flight.

    pub = Publisher(rt.learner, rt.weight_sync, rt.run_state, state, deadline_s=None, stop=stop)
    seconds = pub.publish(version, overlap=True)   # export now; the engines load meanwhile
    pub.finish()                                   # wait for the one in flight, raise its error here

The policy version in Redis is raised only after every engine applied the weights (or failed
to and closed its own admission: ``PublishResult.errors``, logged here), so admission never
lets a generator start work counted against weights it lacks. With `overlap` the engines'
part runs in a background thread while the loop trains the next step (docs/design/contracts.md, "The
async learner does not wait for the engines to load").

An export that fails for want of space (``shm_dir`` full, Ray's object store full) is treated
like a Redis outage: said once with what is full and how much one export needs, retried with
backoff (one line a minute) while the engines keep their weights and admission holds the
staleness bound (the policy version does not move), and past ``sync.publish_deadline_s``
raised as WeightsUnwritable, on which the loop checkpoints and prints the resume command.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncrl.sync.weight_sync import PublishResult, WeightSync
from asyncrl.types import WeightLocation, WeightsFile, WeightsObject

if TYPE_CHECKING:
    from asyncrl.control.state import LoopState, StopFlag
    from asyncrl.learner import LearnerGroup
    from asyncrl.queue import RunState

log = logging.getLogger(__name__)

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0
RETRY_LOG_S = 60.0
JOIN_POLL_S = 1.0
"""While waiting for space, how often that is said again."""
_NO_SPACE = ("no space left on device", "disk quota exceeded", "objectstorefullerror", "outofdiskerror")


class WeightsUnwritable(OSError):
    """The weights could not be written within sync.publish_deadline_s (a full shm_dir or object store)."""


def no_space(error: BaseException) -> bool:
    """Whether ``error`` (or what it wraps: a learner rank's error comes through Ray) is a full
    filesystem or object store, which waiting can fix, rather than a bug."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = f"{type(e).__name__}: {e}".lower()
        if any(k in text for k in _NO_SPACE):
            return True
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    return False


def space_report(location: WeightLocation, need: int | None) -> str:
    """'/dev/shm has 3.1 MB free of 300.0 MB; one export needs 45.2 MB' (what can be known)."""
    if isinstance(location, WeightsObject):
        where_text = "Ray's object store"
        usage = ""
    else:
        where_text = os.path.dirname(location.path) or "."
        try:
            du = shutil.disk_usage(where_text)
            usage = f" has {du.free / 1e6:.1f} MB free of {du.total / 1e6:.1f} MB"
        except OSError:
            usage = ""
    needed = f"; one export needs {need / 1e6:.1f} MB" if need else ""
    return f"{where_text}{usage}{needed}"


class Publisher:
    def __init__(
        self,
        learner: LearnerGroup,
        weight_sync: WeightSync,
        run_state: RunState,
        state: LoopState,
        *,
        deadline_s: float | None = None,
        stop: StopFlag | None = None,
        while_waiting: Callable[[], object] | None = None,
        on_result: Callable[[PublishResult], object] | None = None,
    ):
        self.learner = learner
        self.weight_sync = weight_sync
        self.run_state = run_state
        self.state = state
        self.deadline_s = deadline_s
        """sync.publish_deadline_s: how long an unwritable export is retried (None: for ever)."""
        self.stop = stop
        self.last_apply_s = 0.0
        """How long the engines took to apply the last publish (pause, load, resume)."""
        self.last_result: PublishResult | None = None
        self.export_bytes: int | None = None
        """Size of the last file this publisher exported (what the next one needs); None before
        the first, and for the object store, whose exports have no file to measure."""
        self.while_waiting = while_waiting
        """Run while waiting for a publish in flight (the loop's generator watchdog)."""
        self.on_result = on_result
        """Handed every publish's result (the loop's LoadWatch: failed loads counted and followed)."""
        self._inflight: threading.Thread | None = None
        self._error: BaseException | None = None

    def publish(self, version: int, overlap: bool) -> float:
        """Export the weights as `version`, have the engines apply them, then raise the policy
        version in Redis; with `overlap` the engines' part runs while the caller goes on.
        Returns the seconds the caller spent."""
        t0 = time.perf_counter()
        self.finish()
        location = self.weight_sync.location_for(version)
        self._export(location, version)
        self.state.published_version = version
        if overlap:
            self._inflight = threading.Thread(
                target=self._apply_and_announce, args=(location, version), name=f"publish-v{version}", daemon=True
            )
            self._inflight.start()
        else:
            self._apply_and_announce(location, version)
            self._raise_error()
        return time.perf_counter() - t0

    def _export_once(self, location: WeightLocation) -> None:
        if isinstance(location, WeightsObject):
            self.learner.export_to_object(location)
        else:
            self.learner.export_to_file(location.path)

    def _export(self, location: WeightLocation, version: int) -> None:
        """The learner's export to ``location``, waiting out a full filesystem or object store
        (see the module doc)."""
        t0 = time.monotonic()
        wait, next_say, failures = RETRY_FIRST_S, 0.0, 0
        while True:
            try:
                self._export_once(location)
                break
            except Exception as e:
                if not no_space(e):
                    raise
                failures += 1
                now = time.monotonic()
                waited = now - t0
                where = space_report(location, self.export_bytes)
                if self.deadline_s is not None and waited >= self.deadline_s:
                    raise WeightsUnwritable(
                        errno.ENOSPC,
                        f"weights v{version} could not be written to {location} for {waited:.0f}s "
                        f"({failures} attempts, sync.publish_deadline_s={self.deadline_s:g}): {where}",
                    ) from e
                if now >= next_say:
                    limit = "none" if self.deadline_s is None else f"{self.deadline_s:g}s"
                    log.error(
                        "weights v%d cannot be written to %s: %s (%s). Retrying with backoff; the engines keep "
                        "v%s and admission holds the staleness bound (sync.publish_deadline_s=%s)",
                        version,
                        location,
                        where,
                        _first_line(e),
                        self.state.published_version,
                        limit,
                    )
                    next_say = now + RETRY_LOG_S
                if self.stop is not None and self.stop.is_set:
                    raise WeightsUnwritable(
                        errno.ENOSPC, f"stopped while waiting to write weights v{version}: {where}"
                    ) from e
                time.sleep(wait if self.deadline_s is None else max(0.0, min(wait, self.deadline_s - waited)))
                wait = min(wait * 2, RETRY_MAX_S)
        if failures:
            log.warning(
                "weights v%d written to %s after %.0fs of waiting for space", version, location, time.monotonic() - t0
            )
        if isinstance(location, WeightsFile):
            with contextlib.suppress(OSError):
                self.export_bytes = os.path.getsize(location.path)

    def _apply_and_announce(self, location: WeightLocation, version: int) -> None:
        try:
            result = self.weight_sync.publish_file(location, version)
            if result.errors:
                # Each failed generator closed its own admission until it loads this version.
                log.error(
                    "weights v%d: %d of %d generator(s) could not apply them and admit nothing until they do: %s",
                    version,
                    len(result.errors),
                    result.engines,
                    "; ".join(result.errors),
                )
            self.last_result = result
            self.last_apply_s = result.apply_s
            if self.on_result is not None:
                self.on_result(result)
            self.run_state.set_policy_version(version)
        except BaseException as e:  # handed to the loop's thread by finish()
            self._error = e

    def finish(self) -> None:
        """Wait for the publish in flight (if any); its failure is raised here, in the caller,
        as is a failing watchdog check (Redis gone: the loop's outage handling takes it)."""
        self._wait(tear_down=False)
        self._raise_error()

    def join(self) -> None:
        """Wait for the publish in flight without raising (tear-down: engines must not go mid-load).
        A watchdog check that fails here is logged and not run again: the tear-down is often
        for the very reason it fails (Redis gone), and must still reach its checkpoint."""
        self._wait(tear_down=True)

    def _wait(self, *, tear_down: bool) -> None:
        """The wait runs `while_waiting` every second: a generator that hangs mid-load holds the
        publish, and only the watchdog, killing it, lets that publish end."""
        if self._inflight is None:
            return
        check = self.while_waiting
        while True:
            self._inflight.join(timeout=JOIN_POLL_S)
            if not self._inflight.is_alive():
                break
            if check is None:
                continue
            try:
                check()
            except Exception as e:
                if not tear_down:
                    raise
                log.warning("waiting for the publish in flight without the generator watchdog: %s", _first_line(e))
                check = None
        self._inflight = None

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"
