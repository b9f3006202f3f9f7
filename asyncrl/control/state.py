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
    """What a checkpoint must restore for the loop to go on exactly where it stopped."""

    step: int = 0
    version: int = 0
    published_version: int = 0
    trained_ids: list[str] = field(default_factory=list)
    """Group ids trained into the current weights (the exactly-once ledger)."""
    unacked: list[str] = field(default_factory=list)
    """Queue entry ids consumed since the last checkpoint."""

    def to_extra(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "version": self.version,
            "published_version": self.published_version,
            "trained_ids": list(self.trained_ids),
        }

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> LoopState:
        return cls(
            step=int(extra["step"]),
            version=int(extra["version"]),
            published_version=int(extra.get("published_version", extra["version"])),
            trained_ids=list(extra.get("trained_ids", [])),
        )


class StopFlag:
    """Set by SIGINT/SIGTERM: the loop finishes its step, checkpoints and exits. A second
    signal restores the default handler, so a third press kills at once."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        log.warning("received %s: finishing this step, checkpointing and shutting down", signal.Signals(signum).name)
        self.event.set()
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    @property
    def is_set(self) -> bool:
        return self.event.is_set()
