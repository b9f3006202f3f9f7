"""What a consumer does with the stream entries one read returns: decide each entry's fate
(hand out, drop as stale, dead-letter, ack as a duplicate), then record every side effect of
the batch in one MULTI, so a crash leaves all of them done or none.

    intake = sort_entries(entries, min_version=3, seen=ids_handed_out, max_record_bytes=mb,
                          stale_reissues=2, contract=contract, said=reasons_logged)
    transaction(client, retry, lambda pipe: intake.record(pipe, run))
    intake.out                                  # [(entry id, group)] to hand out

Rules (see replay.py): an entry deleted while pending, or that fails validation, or whose
group id was already handed out, is acked and deleted; one older than ``min_version`` is
dropped (its group id goes to the run's dropped set and its prompt may be re-issued, see
reissue.py); a record that fails validation is also moved to the dead-letter stream.

Validation is the codec's (a well-formed record) and, given a ``contract``, the run's
(asyncrl.data.contract: token ids, lengths, log-probs, versions, group size). A dead-lettered
entry is acked with the batch, so a resume never replays it; the dead-letter stream keeps the
reason, its detail, the group id when one could be read, and the record's first
``DEADLETTER_KEEP_BYTES`` (the stream is capped at ``DEADLETTER_MAXLEN`` entries). Each
reason is logged once per consumer; the rest are counted (``dead_lettered``). Entries that
carried their prompt's in-flight note were admitted by a generator: they are also counted
``dead_lettered_admitted``, the count whose admission the trainer gives back (a record a
client wrote past the generators was never admitted, and giving back a slot for it would let
the generators overshoot the staleness budget). The prompt is not re-issued: the producer
that made a record the run cannot train would most likely make it again.
"""

from __future__ import annotations

import logging
from collections.abc import Container
from dataclasses import dataclass, field

import redis
from redis.typing import EncodableT, FieldT

from asyncrl.data.codec import RecordError, decode_group
from asyncrl.data.contract import MAX_ID_CHARS, RecordContract, check_group
from asyncrl.queue import keys
from asyncrl.queue.records import MAX_SMALL_RECORD, unpack_small
from asyncrl.queue.reissue import StaleDrops, note_of
from asyncrl.queue.scripts import INCR_MANY
from asyncrl.types import RolloutGroup

log = logging.getLogger("asyncrl.queue")

DEADLETTER_MAXLEN = 10_000
"""Dead-letter stream cap (approximate): a flood of bad records cannot fill Redis."""
DEADLETTER_KEEP_BYTES = 64 << 10
"""How much of a dead-lettered record is kept (enough to see what it was)."""
_DETAIL_CHARS = 500


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
    dead_admitted: int = 0
    """Dead-lettered entries that carried an in-flight note (a generator admitted them)."""

    def record(self, pipe: redis.client.Pipeline, run: str) -> None:
        """Queue every side effect of the batch on ``pipe`` (one MULTI)."""
        stream = keys.rollouts(run)
        for fields in self.dead:
            pipe.xadd(keys.deadletter(run), fields, maxlen=DEADLETTER_MAXLEN, approximate=True)
        if self.dropped:
            pipe.sadd(keys.dropped(run), *self.dropped)
        if self.finished:
            pipe.xack(stream, keys.CONSUMER_GROUP, *self.finished)
            pipe.xdel(stream, *self.finished)
        if self.stale.records:
            pipe.rpush(keys.reissue(run), *self.stale.records)
        counts = {
            "dead_lettered": len(self.dead),
            "dead_lettered_admitted": self.dead_admitted,
            "dropped_stale": len(self.dropped),
            "duplicates": self.duplicates,
        }
        args = [x for name, n in {**counts, **self.stale.counts}.items() if n for x in (name, n)]
        if args:  # a counter another client overwrote with text must not fail the MULTI
            pipe.register_script(INCR_MANY)(keys=[keys.counters(run)], args=args, client=pipe)


def _peek_group_id(data: bytes) -> str | None:
    """The group id of a record that failed the codec, if its top level still reads as a map."""
    if len(data) > MAX_SMALL_RECORD:
        return None
    try:
        record = unpack_small(data)
    except Exception:  # malformed by definition: no id to find is a normal outcome
        return None
    gid = record.get("group_id") if isinstance(record, dict) else None
    return gid if isinstance(gid, str) and len(gid) <= MAX_ID_CHARS else None


def _dead_letter(entry_id: str, data: bytes, error: RecordError, group_id: str | None) -> dict[FieldT, EncodableT]:
    fields: dict[FieldT, EncodableT] = {
        "reason": error.reason,
        "detail": error.detail[:_DETAIL_CHARS],
        "source_id": entry_id,
        "d": data[:DEADLETTER_KEEP_BYTES],
    }
    if group_id is not None:
        fields["group_id"] = group_id
    return fields


def sort_entries(
    entries: list,
    min_version: int,
    seen: Container[str],
    max_record_bytes: int,
    stale_reissues: int,
    contract: RecordContract | None = None,
    said: set[str] | None = None,
) -> Intake:
    """Decide the fate of each (entry id, fields) XREADGROUP returned; ``seen``: group ids
    already handed out by this consumer; ``contract``: the run's (None: the codec's checks
    only); ``said``: the dead-letter reasons already logged (updated)."""
    intake = Intake(StaleDrops(stale_reissues))
    said = set() if said is None else said
    batch_groups: set[str] = set()
    for raw_id, fields in entries:
        entry_id = text_of(raw_id)
        if fields is None:  # deleted while pending: nothing to deliver
            intake.finished.append(entry_id)
            continue
        data = fields.get(keys.RECORD_FIELD)
        group: RolloutGroup | None = None
        try:
            if data is None:
                raise RecordError("missing_field", f"stream entry has no {keys.RECORD_FIELD!r} field")
            group = decode_group(data, max_bytes=max_record_bytes)
            if contract is not None:
                check_group(group, contract)
        except RecordError as e:
            raw = data or b""
            gid = group.group_id if group is not None else _peek_group_id(raw)
            if e.reason not in said:
                said.add(e.reason)
                log.warning(
                    "rollout entry %s (group %r) dead-lettered: %s (further %r records are counted in "
                    "queue/dead_lettered, not logged)",
                    entry_id,
                    gid,
                    str(e)[:_DETAIL_CHARS],
                    e.reason,
                )
            intake.dead.append(_dead_letter(entry_id, raw, e, gid))
            intake.dead_admitted += keys.NOTE_FIELD in fields
            intake.finished.append(entry_id)
            continue
        if group.group_id in seen or group.group_id in batch_groups:
            intake.duplicates += 1
            intake.finished.append(entry_id)
        elif group.behavior_version < min_version:
            intake.dropped.append(group.group_id)
            intake.finished.append(entry_id)
            limits = contract.images if contract is not None else None
            intake.stale.add(group, note_of(entry_id, fields.get(keys.NOTE_FIELD), limits))
        else:
            intake.out.append((entry_id, group))
            batch_groups.add(group.group_id)
    return intake
