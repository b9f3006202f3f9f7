"""What a consumer does with the stream entries one read returns: decide each entry's fate
(hand out, drop as stale, dead-letter, ack as a duplicate), then record every side effect of
the batch in one MULTI, so a crash leaves all of them done or none.

    intake = sort_entries(entries, min_version=3, seen=ids_handed_out, max_record_bytes=mb, stale_reissues=2)
    transaction(client, retry, lambda pipe: intake.record(pipe, run))
    intake.out                                  # [(entry id, group)] to hand out

Rules (see replay.py): an entry deleted while pending, or that fails validation, or whose
group id was already handed out, is acked and deleted; one older than ``min_version`` is
dropped (its group id goes to the run's dropped set and its prompt may be re-issued, see
reissue.py); a record that fails validation is also moved to the dead-letter stream.
"""

from __future__ import annotations

import logging
from collections.abc import Container
from dataclasses import dataclass, field

import redis
from redis.typing import EncodableT, FieldT

from asyncrl.data.codec import RecordError, decode_group
from asyncrl.queue import keys
from asyncrl.queue.reissue import StaleDrops, note_of
from asyncrl.types import RolloutGroup

log = logging.getLogger("asyncrl.queue")


def text_of(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


@dataclass
class Intake:
    """One read's entries, sorted by fate."""

    stale: StaleDrops
    out: list[tuple[str, RolloutGroup]] = field(default_factory=list)
    """(entry id, group) to hand out."""
    finished: list[str] = field(default_factory=list)
    """Entries acked and deleted here, never handed out."""
    dead: list[dict[FieldT, EncodableT]] = field(default_factory=list)
    """Dead-letter records: reason, raw bytes, source entry id."""
    dropped: list[str] = field(default_factory=list)
    """Group ids dropped as stale."""
    duplicates: int = 0

    def record(self, pipe: redis.client.Pipeline, run: str) -> None:
        """Queue every side effect of the batch on ``pipe`` (one MULTI)."""
        stream = keys.rollouts(run)
        for fields in self.dead:
            pipe.xadd(keys.deadletter(run), fields, maxlen=100_000, approximate=True)
        if self.dropped:
            pipe.sadd(keys.dropped(run), *self.dropped)
        if self.finished:
            pipe.xack(stream, keys.CONSUMER_GROUP, *self.finished)
            pipe.xdel(stream, *self.finished)
        if self.stale.records:
            pipe.rpush(keys.reissue(run), *self.stale.records)
        counts = {"dead_lettered": len(self.dead), "dropped_stale": len(self.dropped), "duplicates": self.duplicates}
        for name, n in {**counts, **self.stale.counts}.items():
            if n:
                pipe.hincrby(keys.counters(run), name, n)


def sort_entries(
    entries: list, min_version: int, seen: Container[str], max_record_bytes: int, stale_reissues: int
) -> Intake:
    """Decide the fate of each (entry id, fields) XREADGROUP returned; ``seen``: group ids
    already handed out by this consumer."""
    intake = Intake(StaleDrops(stale_reissues))
    batch_groups: set[str] = set()
    for raw_id, fields in entries:
        entry_id = text_of(raw_id)
        if fields is None:  # deleted while pending: nothing to deliver
            intake.finished.append(entry_id)
            continue
        data = fields.get(keys.RECORD_FIELD)
        try:
            if data is None:
                raise RecordError("missing_field", f"stream entry has no {keys.RECORD_FIELD!r} field")
            group = decode_group(data, max_bytes=max_record_bytes)
        except RecordError as e:
            log.warning("rollout entry %s dead-lettered: %s", entry_id, e)
            intake.dead.append({"reason": e.reason, "d": data or b"", "source_id": entry_id})
            intake.finished.append(entry_id)
            continue
        if group.group_id in seen or group.group_id in batch_groups:
            intake.duplicates += 1
            intake.finished.append(entry_id)
        elif group.behavior_version < min_version:
            intake.dropped.append(group.group_id)
            intake.finished.append(entry_id)
            intake.stale.add(group, note_of(entry_id, fields.get(keys.NOTE_FIELD)))
        else:
            intake.out.append((entry_id, group))
            batch_groups.add(group.group_id)
    return intake
