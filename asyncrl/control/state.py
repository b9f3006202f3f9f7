"""What a run carries across a checkpoint (LoopState) and how a signal asks it to stop (StopFlag)."""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class LoopState:
    """What a checkpoint must restore for the loop to go on exactly where it stopped.

    Its size does not grow with the run: besides counters it holds only the last checkpoint
    interval's ids (at most groups_per_step * checkpoint_every of each). Every group id ever
    trained is an audit, kept apart (asyncrl.control.ledger, with queue.ledger on).
    """

    step: int = 0
    version: int = 0
    published_version: int = 0
    trained_count: int = 0
    """Groups trained into the current weights (a resume's admission budget counts them)."""
    since_checkpoint: list[str] = field(default_factory=list)
    """Group ids trained since the last checkpoint: the next one stores them as `checkpoint_ids`."""
    unacked: list[str] = field(default_factory=list)
    """Queue entry ids consumed since the last checkpoint (acked once it is durable)."""
    skip_ids: list[str] = field(default_factory=list)
    """After a resume: the restored checkpoint's own group ids. Its ack may have been lost
    with the crash, leaving their entries pending; delivered again they must not be trained."""
    version_offset: int = 0
    """Versions skipped by resumes (continue_past): `version` minus the optimizer steps that
    made the current weights. Admission's budget is counted in versions, so a resume rebases
    its count by what was skipped."""

    def trained(self, group_ids: list[str], entry_ids: list[str]) -> None:
        """Book one trained step's groups (the step and version are set by the loop)."""
        self.trained_count += len(group_ids)
        self.since_checkpoint += group_ids
        self.unacked += entry_ids

    def checkpointed(self) -> list[str]:
        """After a durable checkpoint and the ack of its entries: forget its ids (returns the
        entry ids it covered)."""
        acks, self.unacked, self.since_checkpoint = self.unacked, [], []
        return acks

    def continue_past(self, highest_used: int, max_staleness: int) -> int:
        """Renumber the restored weights past every version this run's Redis ever announced.

        A crashed trainer may have published versions beyond its last checkpoint; engines and
        queued groups still carry those labels, for weights this resume discards. Reusing the
        numbers would let an engine skip the resumed weights (it already "has" that version)
        and make a label name two different policies. The restored weights become
        ``highest_used + 1 + max_staleness``, so every label from before the resume is also
        past the staleness bound and is dropped rather than trained. Returns the jump (0 when
        nothing past the checkpoint was announced)."""
        if highest_used <= self.version:
            return 0
        jump = highest_used + 1 + max_staleness - self.version
        self.version += jump
        self.version_offset += jump
        return jump

    def to_extra(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "version": self.version,
            "published_version": self.published_version,
            "trained_count": self.trained_count,
            "checkpoint_ids": list(self.since_checkpoint),
            "version_offset": self.version_offset,
        }

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> LoopState:
        if "trained_count" in extra:
            count, skip = int(extra["trained_count"]), list(extra.get("checkpoint_ids", []))
        else:  # a checkpoint from before the state was bounded: every id ever trained
            skip = list(extra.get("trained_ids", []))
            count = len(skip)
        return cls(
            step=int(extra["step"]),
            version=int(extra["version"]),
            published_version=int(extra.get("published_version", extra["version"])),
            trained_count=count,
            skip_ids=skip,
            version_offset=int(extra.get("version_offset", 0)),
        )


PREEMPTED_EXIT = 128 + signal.SIGTERM
"""The exit status after a SIGTERM (143, as a shell reports a process SIGTERM ended): the run
stopped on a scheduler's request and resumes with `asyncrl train --resume RUN_DIR`. A clean
stop (a checkpoint at the step it was on) and a hard exit past the grace give the same status:
either way the job should be requeued; summary.json tells them apart."""


class StopFlag:
    """Set by SIGINT/SIGTERM: the loop finishes its step, checkpoints and exits.

    SIGINT (Ctrl-C): the first one also puts back the handler that was there before, so a
    second press acts as it would without us (KeyboardInterrupt). SIGTERM (a scheduler's stop:
    Slurm, Kubernetes, `kill`): the stop must be over within `grace_s`, after which the sender
    kills us; when the grace runs out, or at a second SIGTERM, the process exits at once
    (asyncrl.lifeline.hard_exit: what the run started is stopped first) with PREEMPTED_EXIT.
    `signum` is the first SIGTERM or SIGINT received (a SIGTERM counts over an earlier SIGINT).

    install() and restore() nest: train() and TrainLoop.run() both install the same flag,
    and only the outermost pair touches the handlers. Installing twice used to record our
    own handler as "the previous one", so a second signal was caught again and, after
    train() returned, SIGINT still belonged to a flag nobody read."""

    def __init__(self, grace_s: float | None = None) -> None:
        self.event = threading.Event()
        self.grace_s = grace_s
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._depth = 0
        self._deadline: threading.Timer | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._depth += 1
        if self._depth > 1:
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def reclaim(self) -> None:
        """Take SIGTERM back after a library put its own handler in (ray.init does)."""
        if self._depth > 0 and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self._depth == 0:
            return
        self._depth -= 1
        if self._depth > 0:
            return
        if self._deadline is not None:
            self._deadline.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: not set from Python
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGTERM:
            if self.signum == signal.SIGTERM:
                _hard_exit(f"a second {name}")
            self.signum = signum
            self.event.set()
            if self.grace_s is not None:
                log.warning(
                    "received %s: finishing this step, checkpointing and shutting down within %.0f s "
                    "(control.shutdown_grace_s; a second %s exits at once)",
                    name,
                    self.grace_s,
                    name,
                )
                why = f"{name}: shutdown grace of {self.grace_s:g} s passed"
                self._deadline = threading.Timer(self.grace_s, _hard_exit, [why])
                self._deadline.daemon = True
                self._deadline.start()
            else:
                log.warning("received %s: finishing this step, checkpointing and shutting down", name)
            return
        log.warning("received %s: finishing this step, checkpointing and shutting down", name)
        if self.signum is None:
            self.signum = signum
        self.event.set()
        previous = self._previous.get(signum)
        signal.signal(signum, signal.SIG_DFL if previous is None else previous)

    @property
    def is_set(self) -> bool:
        return self.event.is_set()

    @property
    def preempted(self) -> bool:
        """Stopped by SIGTERM: the process should exit with PREEMPTED_EXIT."""
        return self.signum == signal.SIGTERM


def _hard_exit(why: str) -> None:
    from asyncrl.lifeline import hard_exit

    hard_exit(PREEMPTED_EXIT, why)
