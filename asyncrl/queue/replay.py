"""The Redis-backed replay queue: one stream per run, one consumer group of learners.

    from asyncrl.queue import RolloutQueue
    q = RolloutQueue.connect("redis://127.0.0.1:6379/0", run="demo")   # run-level state: RunState.of(q)
    q.put(group)                                           # generator, any process
    items = q.get_batch(8, min_version=3, timeout=10.0)    # trainer: [(entry_id, group)]
    ...train, checkpoint...
    q.ack([entry_id for entry_id, _ in items])             # once the checkpoint is durable

Delivery (docs/design/contracts.md, "Ack" and "Ledger"): XREADGROUP hands each entry to one consumer; it stays
in the consumer group's pending list until `ack`, which the trainer calls only when a
checkpoint covering it is durable, so a crash before that redelivers it. On its first
`get_batch` a consumer re-reads its own pending entries (same consumer name after a restart);
entries another consumer has held for longer than `claim_idle_s` are claimed with XAUTOCLAIM
(a dead consumer's). Entries this instance already handed out are never handed out twice,
and a group id seen twice (a producer retry whose reply was lost) is acked and counted as
`duplicates`.

Ack policy: XACK and XDEL together. The stream then holds exactly the entries not yet acked
(undelivered + pending), so its length is the backpressure measure and memory stays bounded.

Backpressure policy: `put` never drops data. When the stream holds `maxlen` entries
(undelivered + un-acked), `put` waits, polling with backoff, until acks make room, and
raises `QueueFull` after `timeout`. The check and the XADD are one Lua script, so several
producers cannot overshoot. Note the trainer keeps entries un-acked until its checkpoint:
maxlen must exceed groups_per_step * checkpoint_every, or producers and trainer wait on
each other.

Filtering on the way out (intake.py): records older than `min_version` are acked, their group
ids added to the run's dropped set and counted `dropped_stale`, and their prompts re-issued up
to `stale_reissues` times (asyncrl.queue.reissue); records that fail validation are moved
to the dead-letter stream (reason, raw bytes, source entry id) and counted `dead_lettered`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import redis

from asyncrl.data.codec import DEFAULT_MAX_BYTES, RecordError, decode_group, encode_group
from asyncrl.data.contract import RecordContract
from asyncrl.queue import keys
from asyncrl.queue.connection import Retrier, open_client, redact_url, transaction
from asyncrl.queue.intake import sort_entries, text_of
from asyncrl.queue.scripts import PUT_BOUNDED
from asyncrl.types import RolloutGroup

log = logging.getLogger("asyncrl.queue")

_MAX_BLOCK_S = 5.0
"""Longest single XREADGROUP BLOCK: well under the socket timeout, so a hung server is noticed."""
_PUT_CHUNK_BYTES = 8 << 20
"""Records per put-script call are capped by size so one call never stalls Redis for long."""


class QueueFull(TimeoutError):
    """put() waited `timeout` seconds and the queue stayed at maxlen."""

    def __init__(self, message: str, added_ids: list[str]):
        super().__init__(message)
        self.added_ids = added_ids


class RolloutQueue:
    """Producer and consumer side of one run's rollout stream. Run-level state (versions,
    admission, heartbeats, metrics) is RunState's: `RunState.of(queue)` shares this connection."""

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        retry: Retrier,
        *,
        consumer: str,
        maxlen: int,
        max_record_bytes: int,
        claim_idle_s: float,
        seen_capacity: int = 100_000,
        ledger: bool = False,
        stale_reissues: int = 0,
    ):
        self._r = client
        self.run = run
        self._retry = retry
        self._k_counters = keys.counters(run)
        self.consumer = consumer
        self.maxlen = maxlen
        self.max_record_bytes = max_record_bytes
        self.claim_idle_s = claim_idle_s
        self._k_stream = keys.rollouts(run)
        self._k_deadletter = keys.deadletter(run)
        self._k_dropped = keys.dropped(run)
        self._k_produced = keys.produced(run)
        self.ledger = ledger
        self.stale_reissues = stale_reissues
        self._put = client.register_script(PUT_BOUNDED)
        self._own_cursor: str | None = "0"  # own pending entries still to re-read; None when done
        self._next_claim = 0.0
        self._held: set[str] = set()  # handed out by this instance, not acked yet
        self._seen: OrderedDict[str, None] = OrderedDict()  # group ids handed out (bounded)
        self._seen_capacity = seen_capacity
        self._dead_reasons_logged: set[str] = set()  # each dead-letter reason is logged once

    @classmethod
    def connect(
        cls,
        url: str,
        run: str,
        *,
        password: str | None = None,
        consumer: str = "learner-0",
        maxlen: int = 4096,
        max_record_bytes: int = DEFAULT_MAX_BYTES,
        claim_idle_s: float = 300.0,
        retry_deadline_s: float = 30.0,
        outage_deadline_s: float | None = 0.0,
        ledger: bool = False,
        stale_reissues: int = 0,
    ) -> RolloutQueue:
        """Connect, create the consumer group (and stream) if missing, register the run.

        claim_idle_s: another consumer's pending entry idle this long is presumed orphaned
        (its consumer died) and claimed. Keep it above the trainer's checkpoint interval.
        retry_deadline_s, outage_deadline_s: see Retrier (the default gives up at the first).
        stale_reissues: how often a prompt whose group this consumer drops as stale is re-issued.
        """
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        client = open_client(url, password=password)
        retry = Retrier(redact_url(url), deadline_s=retry_deadline_s, outage_deadline_s=outage_deadline_s)
        q = cls(
            client,
            run,
            retry,
            consumer=consumer,
            maxlen=maxlen,
            max_record_bytes=max_record_bytes,
            claim_idle_s=claim_idle_s,
            ledger=ledger,
            stale_reissues=stale_reissues,
        )
        retry(client.ping)
        try:
            retry(client.xgroup_create, q._k_stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        retry(client.sadd, keys.RUNS, run)
        return q

    @property
    def client(self) -> redis.Redis:
        return self._r

    @property
    def retry(self) -> Retrier:
        return self._retry

    def close(self) -> None:
        self._r.close()

    def _transaction(self, build: Callable[[redis.client.Pipeline], Any]) -> list:
        return transaction(self._r, self._retry, build)

    # ------------------------------------------------------------------ producer

    def put(self, group: RolloutGroup, timeout: float = 60.0, *, inflight_of: str | None = None) -> str:
        """Append one group; waits while the queue is full (see module docstring). Returns the entry id."""
        return self.put_many([group], timeout=timeout, inflight_of=inflight_of)[0]

    def put_many(
        self, groups: list[RolloutGroup], timeout: float = 60.0, *, inflight_of: str | None = None
    ) -> list[str]:
        """Append groups in as few round trips as room allows; same waiting policy as put().

        inflight_of: the generator that admitted these groups' prompts (RunState.admit_prompt);
        each prompt's in-flight note is deleted in the same script that adds its group.
        """
        records = [encode_group(g) for g in groups]
        for g, rec in zip(groups, records, strict=True):
            if len(rec) > self.max_record_bytes:
                raise RecordError("oversize", f"group {g.group_id!r}: {len(rec)} bytes > {self.max_record_bytes}")
        ids: list[str] = []
        deadline = time.monotonic() + timeout
        wait = 0.002
        while len(ids) < len(records):
            chunk: list[bytes] = []
            size = 0
            for rec in records[len(ids) :]:
                if chunk and size + len(rec) > _PUT_CHUNK_BYTES:
                    break
                chunk.append(rec)
                size += len(rec)
            batch = groups[len(ids) : len(ids) + len(chunk)]
            script_keys = [self._k_stream, self._k_counters, self._k_produced]
            args = [self.maxlen, "1" if self.ledger else "0", len(chunk), *chunk, *[g.group_id for g in batch]]
            if inflight_of is not None:
                script_keys.append(keys.inflight(self.run, inflight_of))
                args += [g.prompt_id for g in batch]
            added = self._retry(self._put, keys=script_keys, args=args)
            ids += [text_of(i) for i in added]
            if added:
                wait = 0.002
                continue
            if time.monotonic() + wait > deadline:
                raise QueueFull(
                    f"queue {self._k_stream} stayed full (maxlen={self.maxlen} un-acked entries) for "
                    f"{timeout}s; {len(ids)}/{len(records)} groups added",
                    ids,
                )
            time.sleep(wait)
            wait = min(wait * 2, 0.25)
        return ids

    # ------------------------------------------------------------------ consumer

    def get_batch(
        self, n_groups: int, min_version: int, timeout: float, contract: RecordContract | None = None
    ) -> list[tuple[str, RolloutGroup]]:
        """Up to n_groups (entry id, group) with behavior_version >= min_version, each fitting
        `contract` (the run's: asyncrl.data.contract; None checks the codec's rules only).

        Returns fewer only when `timeout` seconds pass. Own pending entries (after a restart)
        and orphaned entries of dead consumers come first, then new ones.
        """
        if n_groups < 1:
            raise ValueError(f"n_groups must be >= 1, got {n_groups}")
        deadline = time.monotonic() + max(timeout, 0.0)
        out: list[tuple[str, RolloutGroup]] = []
        while True:
            want = n_groups - len(out)
            entries = self._read_own_pending(want) or self._claim_orphans(want)
            if not entries:
                left = deadline - time.monotonic()
                # block=None is a non-blocking read; redis-py treats block=0 as "forever".
                block = int(min(left, _MAX_BLOCK_S) * 1000) if left >= 0.001 else None
                entries = self._read(">", want, block)
            out += self._accept(entries, min_version, contract)
            if len(out) >= n_groups or time.monotonic() >= deadline:
                return out

    def _read(self, start: str, count: int, block_ms: int | None) -> list:
        def rewind() -> None:
            # A read whose reply was lost still moved entries into our pending list: re-scan it.
            self._own_cursor = "0"

        resp = self._retry(
            self._r.xreadgroup,
            keys.CONSUMER_GROUP,
            self.consumer,
            {self._k_stream: start},
            count=count,
            block=block_ms,
            on_retry=rewind,
        )
        return resp[0][1] if resp else []

    def _read_own_pending(self, want: int) -> list:
        while self._own_cursor is not None:
            entries = self._read(self._own_cursor, want, None)
            if not entries:
                self._own_cursor = None
                return []
            self._own_cursor = text_of(entries[-1][0])
            fresh = [e for e in entries if text_of(e[0]) not in self._held]
            if fresh:
                return fresh
        return []

    def _claim_orphans(self, want: int) -> list:
        now = time.monotonic()
        if now < self._next_claim:
            return []
        self._next_claim = now + max(self.claim_idle_s / 2, 0.05)
        cursor = "0-0"
        out: list = []
        while len(out) < want:
            resp = self._retry(
                self._r.xautoclaim,
                self._k_stream,
                keys.CONSUMER_GROUP,
                self.consumer,
                int(self.claim_idle_s * 1000),
                start_id=cursor,
                count=want,
            )
            cursor, entries = text_of(resp[0]), resp[1]
            out += [e for e in entries if e and text_of(e[0]) not in self._held]
            if cursor == "0-0":
                break
        return out

    def _accept(
        self, entries: list, min_version: int, contract: RecordContract | None
    ) -> list[tuple[str, RolloutGroup]]:
        """Decode, filter and route entries (intake.py); every side effect of the batch in one MULTI."""
        intake = sort_entries(
            entries,
            min_version,
            self._seen,
            self.max_record_bytes,
            self.stale_reissues,
            contract=contract,
            said=self._dead_reasons_logged,
        )
        self._transaction(lambda pipe: intake.record(pipe, self.run))
        for entry_id, group in intake.out:
            self._held.add(entry_id)
            self._remember(group.group_id)
        return intake.out

    def skip_groups(self, group_ids: list[str]) -> None:
        """Group ids already trained into the weights a resume starts from. A crash between a
        checkpoint and its ack leaves their entries pending: delivered again, they are acked and
        counted as `duplicates`, never handed out."""
        for gid in group_ids:
            self._remember(gid)

    def _remember(self, group_id: str) -> None:
        self._seen[group_id] = None
        if len(self._seen) > self._seen_capacity:
            self._seen.popitem(last=False)

    def ack(self, ids: list[str]) -> int:
        """XACK + XDEL: the trainer calls this once a checkpoint covering these entries is durable."""
        if not ids:
            return 0
        acked, _ = self._transaction(
            lambda pipe: (pipe.xack(self._k_stream, keys.CONSUMER_GROUP, *ids), pipe.xdel(self._k_stream, *ids))
        )
        self._held.difference_update(ids)
        return int(acked)

    # ------------------------------------------------------------------ sizes and ledgers

    def pending(self) -> int:
        """Entries delivered to some consumer and not acked yet."""
        return int(self._retry(self._r.xpending, self._k_stream, keys.CONSUMER_GROUP)["pending"])

    def depth(self) -> int:
        """Entries queued and not yet delivered (acked entries are deleted, so XLEN - pending)."""
        length, pend = self._transaction(
            lambda pipe: (pipe.xlen(self._k_stream), pipe.xpending(self._k_stream, keys.CONSUMER_GROUP))
        )
        return int(length) - int(pend["pending"])

    def produced_ids(self) -> set[str]:
        """Every group id ever put (only recorded when connected with ledger=True)."""
        return {text_of(x) for x in self._retry(self._r.smembers, self._k_produced)}

    def queued_groups(self) -> list[RolloutGroup]:
        """Groups still in the stream (undelivered or un-acked), decoded; for ledgers and tests."""
        out = []
        for _, fields in self._retry(self._r.xrange, self._k_stream):
            try:
                out.append(decode_group(fields[keys.RECORD_FIELD], max_bytes=self.max_record_bytes))
            except RecordError:
                continue  # malformed entries are accounted for by the dead-letter stream once read
        return out

    def dropped_ids(self) -> set[str]:
        return {m.decode() for m in self._retry(self._r.smembers, self._k_dropped)}

    def deadletter_entries(self, count: int | None = None) -> list[dict]:
        """Dead-lettered records, oldest first: {"id", "reason", "detail", "source_id", "group_id"
        (None when unreadable), "d" (the record's first bytes)}. Fields anyone but the intake
        wrote are read as text, missing ones as ""."""

        def text(f: dict, name: bytes) -> str:
            return f[name].decode("utf-8", "replace") if name in f else ""

        entries = self._retry(self._r.xrange, self._k_deadletter, count=count)
        return [
            {
                "id": text_of(i),
                "reason": text(f, b"reason"),
                "detail": text(f, b"detail"),
                "source_id": text(f, b"source_id"),
                "group_id": text(f, b"group_id") or None,
                "d": f.get(b"d", b""),
            }
            for i, f in entries
        ]
