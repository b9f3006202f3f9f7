"""Typed reads of the run's small records: every value read back from Redis is checked here.

    beat = parse_heartbeat(unpack_small(raw))        # Heartbeat, or ValueError naming the field
    pids = parse_engine_pids(unpack_small(raw))      # EnginePids, or ValueError
    note = parse_note(unpack_note(raw))              # PromptNote, or ValueError
    say = LogOnce(log); say(("heartbeat", gid), "...%s", why)   # a warning said once per key

Anyone holding the queue's password can write any key of the run: a generator with a bug, an
older version, or a hostile client. A value is therefore checked where it is read, into a
frozen dataclass, so the code that uses it does arithmetic on numbers, never on what Redis
said; a bad one is logged once (per key and reason) and skipped, never raised into the
trainer, the watchdog, a generator's start or the dashboard.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import asdict, dataclass
from typing import Any

MAX_TEXT = 4096
"""Longest text kept from a small record (a reason shown on the console, a host name)."""
MAX_COUNT = 1 << 53
"""Counts and versions above this are not counts (and floats could not hold them exactly)."""
SHM_SEGMENT = re.compile(r"/dev/shm/psm_[0-9a-f]{1,32}")
"""The only segment names an engine record may carry (vLLM's shared-memory segments)."""


class LogOnce:
    """A warning said once per key: a bad value read every second is one line, not a flood."""

    def __init__(self, logger: logging.Logger, limit: int = 1000):
        self.logger, self.limit = logger, limit
        self._said: set[Any] = set()

    def __call__(self, key: Any, msg: str, *args: Any) -> None:
        if key in self._said or len(self._said) >= self.limit:
            return
        self._said.add(key)
        self.logger.warning(msg, *args)


def count(value: Any, where: str) -> int:
    """An int in [0, MAX_COUNT) (bool is not a count)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_COUNT:
        raise ValueError(f"{where}: {value!r:.60} is not a count")
    return value


def number(value: Any, where: str, *, low: float = 0.0) -> float:
    """A finite float >= low (ints accepted, bool not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{where}: {type(value).__name__} is not a number")
    f = float(value)
    if not math.isfinite(f) or f < low:
        raise ValueError(f"{where}: {f} is not a finite number >= {low}")
    return f


def text(value: Any, where: str, limit: int = MAX_TEXT) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"{where}: not a string of at most {limit} characters")
    return value


def int_text(raw: bytes | str | None, where: str) -> int | None:
    """A count stored as text (a state hash or counters field); None when absent."""
    if raw is None:
        return None
    s = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    try:
        return count(int(s), where)
    except ValueError:
        raise ValueError(f"{where}: {s[:60]!r} is not a count") from None


@dataclass(frozen=True)
class Heartbeat:
    """A generator's last heartbeat (asyncrl.rollout.stats.GeneratorStats.heartbeat + its time)."""

    heartbeat: float
    """When it was written (time.time())."""
    version: int = 0
    """The weight version its engine runs."""
    tokens_per_s: float = 0.0
    groups: int = 0
    inflight: int = 0
    blocked: str | None = None
    """Why it admits nothing, if so."""
    reward_errors: int = 0
    reward_timeouts: int = 0
    reward_failure_rate: float | None = None
    """Failed share of its latest reward scorings, in [0, 1]; None until it has enough."""
    reward_last_failure: str = ""
    """The last failed scoring's message, naming the reward."""


_HEARTBEAT_COUNTS = ("version", "groups", "inflight", "reward_errors", "reward_timeouts")


def parse_heartbeat(record: Any) -> Heartbeat:
    """A decoded heartbeat, checked field by field; fields it does not know are ignored (a newer
    generator), a known one of the wrong type or range is a ValueError."""
    if not isinstance(record, dict):
        raise ValueError(f"heartbeat is a {type(record).__name__}, not a map")
    fields: dict[str, Any] = {"heartbeat": number(record.get("heartbeat"), "heartbeat")}
    for name in _HEARTBEAT_COUNTS:
        if record.get(name) is not None:
            fields[name] = count(record[name], name)
    if record.get("tokens_per_s") is not None:
        fields["tokens_per_s"] = number(record["tokens_per_s"], "tokens_per_s")
    if record.get("blocked") is not None:
        fields["blocked"] = text(record["blocked"], "blocked")
    if record.get("reward_failure_rate") is not None:
        rate = number(record["reward_failure_rate"], "reward_failure_rate")
        if rate > 1:
            raise ValueError(f"reward_failure_rate: {rate} is not a share in [0, 1]")
        fields["reward_failure_rate"] = rate
    if record.get("reward_last_failure") is not None:
        fields["reward_last_failure"] = text(record["reward_last_failure"], "reward_last_failure")
    return Heartbeat(**fields)


@dataclass(frozen=True)
class EnginePids:
    """A generator's engine record (keys.engine_pids): its engine's [pid, create time] pairs
    and shared-memory segments, on `host`, and whether it was generating."""

    host: str
    pids: list[list]
    """[[pid, create_time], ...]."""
    segments: list[str]
    started: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_engine_pids(record: Any) -> EnginePids:
    """A decoded engine record, checked: pids are [int > 1, finite float] pairs, segments are
    /dev/shm/psm_<hex> names (SHM_SEGMENT), started a bool."""
    if not isinstance(record, dict):
        raise ValueError(f"engine record is a {type(record).__name__}, not a map")
    pids = record.get("pids", [])
    if not isinstance(pids, list) or len(pids) > 4096:
        raise ValueError("pids: not a list of at most 4096 entries")
    pairs = []
    for i, pair in enumerate(pids):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"pids[{i}]: not a [pid, create_time] pair")
        pid = count(pair[0], f"pids[{i}].pid")
        if pid <= 1:
            raise ValueError(f"pids[{i}].pid: {pid} is not an engine process")
        pairs.append([pid, number(pair[1], f"pids[{i}].create_time")])
    segments = record.get("segments", [])
    if not isinstance(segments, list) or len(segments) > 4096:
        raise ValueError("segments: not a list of at most 4096 entries")
    for i, seg in enumerate(segments):
        if not isinstance(seg, str) or not SHM_SEGMENT.fullmatch(seg):
            raise ValueError(f"segments[{i}]: not a /dev/shm/psm_<hex> segment")
    started = record.get("started", False)
    if not isinstance(started, bool):
        raise ValueError("started: not a bool")
    return EnginePids(text(record.get("host"), "host", 255), pairs, list(segments), started)


@dataclass(frozen=True)
class PromptNote:
    """An admitted prompt's in-flight note (keys.inflight): what a successor runs again."""

    text: str
    metadata: dict[str, Any]


def parse_note(record: Any) -> PromptNote:
    if not isinstance(record, dict):
        raise ValueError(f"note is a {type(record).__name__}, not a map")
    prompt, metadata = record.get("text"), record.get("metadata")
    if not isinstance(prompt, str) or not isinstance(metadata, dict):
        raise ValueError("note: needs text (a string) and metadata (a map)")
    return PromptNote(prompt, metadata)
