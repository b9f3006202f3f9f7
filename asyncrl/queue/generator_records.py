"""The per-generator records of a run in Redis: heartbeats, incarnations, the prompts each
generator has in flight and its engine's processes. `RunState` (runstate.py) carries them; they
live apart because they are the generators' side of the run state, read back by the trainer's
watchdog and by a restarted generator's recovery.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgpack
import redis

from asyncrl.queue import keys
from asyncrl.queue.connection import Retrier
from asyncrl.queue.readback import EnginePids, Heartbeat, LogOnce, parse_engine_pids, parse_heartbeat
from asyncrl.queue.records import unpack_small

log = logging.getLogger("asyncrl.queue")


class GeneratorRecords:
    """RunState's generator records; RunState's constructor sets what these methods use."""

    _r: redis.Redis
    run: str
    _retry: Retrier
    _say: LogOnce
    _k_state: str
    _k_counters: str
    _k_generators: str
    _try_admit: Any
    _release_inflight: Any
    _drop_admitted: Any
    _next_incarnation: Any

    def heartbeat(self, generator_id: str, info: dict[str, Any]) -> None:
        """Record that a generator is alive; `info` is plain msgpack data (version, tokens_per_s, ...)."""
        record = {**info, "heartbeat": time.time()}
        self._retry(self._r.hset, self._k_generators, generator_id, msgpack.packb(record, use_bin_type=True))

    def generators(self) -> dict[str, Heartbeat]:
        """Each generator's last heartbeat; an unreadable one is skipped (logged once per
        generator and reason): it must not take the trainer, its watchdog or a resume down."""
        raw = self._retry(self._r.hgetall, self._k_generators)
        out: dict[str, Heartbeat] = {}
        for k, v in raw.items():
            gid = k.decode("utf-8", "replace")
            try:
                out[gid] = parse_heartbeat(unpack_small(v))
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
                self._say(("heartbeat", gid[:200], why[:80]), "generator %r: bad heartbeat (%s); skipped", gid, why)
        return out

    def remove_generator(self, generator_id: str) -> None:
        self._retry(self._r.hdel, self._k_generators, generator_id)

    # A generator's crash-recovery records. Every call goes through the retrier like the rest
    # of the queue: a generator must ride out a Redis restart, not lose its loop to it.

    def next_incarnation(self, generator_id: str) -> int:
        """How many times `generator_id` has started in this run, counting this start (a count
        some other client overwrote restarts from a number no earlier start used: NEXT_INCARNATION)."""
        n, repaired = self._retry(self._next_incarnation, keys=[keys.incarnation(self.run, generator_id)])
        if repaired:
            log.warning("%s: its incarnation count in Redis was not a count; went on from %d", generator_id, n)
        return int(n)

    def admit_prompt(self, generator_id: str, prompt_id: str, note: bytes, weights_version: int | None = None) -> bool:
        """try_admit(1) and, if admitted, note the prompt in the generator's in-flight hash, as
        one atomic step. Idempotent per prompt id: a retry after a lost reply counts nothing twice.

        ``weights_version``: the version the generator's engine holds. The budget is then taken
        at min(policy version, weights_version): a generator behind the announced weights is
        admitted only to groups that will still be within the staleness bound when trained.
        """
        args = [1, prompt_id, note] + ([int(weights_version)] if weights_version is not None else [])
        return (
            self._retry(
                self._try_admit,
                keys=[self._k_state, self._k_counters, keys.inflight(self.run, generator_id)],
                args=args,
            )
            == 1
        )

    def inflight_prompts(self, generator_id: str) -> dict[str, bytes]:
        """The generator's admitted prompts whose groups are not in the stream yet: id -> note."""
        raw = self._retry(self._r.hgetall, keys.inflight(self.run, generator_id))
        return {k.decode(): v for k, v in raw.items()}

    def release_inflight(self, generator_id: str) -> int:
        """Hand back the admission of every prompt the generator still has noted, and forget
        them (a clean stop). Returns how many."""
        return int(self._retry(self._release_inflight, keys=[self._k_counters, keys.inflight(self.run, generator_id)]))

    def drop_admitted(self, generator_id: str, prompt_id: str, counter: str = "dropped_uniform") -> bool:
        """A finished group of an admitted prompt will not be put: forget its note, hand its
        admission back and count it under ``counter``, in one step. False (nothing done) if the
        note was already gone (a retry, or a stop that released it)."""
        return (
            self._retry(
                self._drop_admitted,
                keys=[self._k_counters, keys.inflight(self.run, generator_id)],
                args=[prompt_id, counter],
            )
            == 1
        )

    def engine_record(self, generator_id: str) -> dict[str, Any] | None:
        """What the generator's last incarnation left for a successor (see set_engine_record),
        checked (readback.parse_engine_pids); None when absent or unreadable (logged)."""
        record = self.engine_pids(generator_id)
        return None if record is None else record.as_dict()

    def engine_pids(self, generator_id: str) -> EnginePids | None:
        """The typed engine record of `generator_id`; None when absent or unreadable (logged)."""
        raw = self._retry(self._r.hget, keys.engine_pids(self.run), generator_id)
        if raw is None:
            return None
        try:
            return parse_engine_pids(unpack_small(raw))
        except Exception as e:
            why = str(e)[:200]
            self._say((generator_id, "engine", why), "%s: ignoring its engine record in Redis: %s", generator_id, why)
            return None

    def set_engine_record(self, generator_id: str, record: dict[str, Any] | None) -> None:
        """{"host", "pids", "segments", "started"} of the generator's engine; None deletes it."""
        if record is None:
            self._retry(self._r.hdel, keys.engine_pids(self.run), generator_id)
        else:
            self._retry(
                self._r.hset, keys.engine_pids(self.run), generator_id, msgpack.packb(record, use_bin_type=True)
            )
