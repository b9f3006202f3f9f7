"""Run-level state kept in Redis next to the rollout stream: versions, counters, admission,
the metrics stream, and each generator's records (generator_records.py). The stream itself is
`RolloutQueue` (replay.py); the two are separate objects that may share one connection.

    rs = RunState.connect(url, run="demo")       # or RunState.of(queue): the queue's connection
    rs.configure_admission(max_staleness=1, groups_per_step=8, mini_batches_per_step=1)  # trainer
    if rs.try_admit():                           # generator, before starting a group
        ...
    rs.set_policy_version(3); rs.policy_version()            # -> 3
    rs.heartbeat("gen-0", {"version": 3, "tokens_per_s": 812.0}); rs.generators()
    rs.publish_metrics(step=3, metrics={"loss/policy": 0.12}); rs.read_metrics()

State hash values are stored as text (so the admission Lua script can read them) and parsed
back by `state()`: text that reads as an int becomes an int, then float, else it stays str.
Heartbeats and metrics records are msgpack (decoded with ext types refused, never pickle);
both codecs are in records.py. The announced weights' location is a typed WeightLocation
here and text only inside Redis. The job a trainer publishes for `asyncrl generate` (config
and model path) is signed as it is written: by the trainer's key and under the queue
password (signing.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import redis
from redis.typing import EncodableT, FieldT

from asyncrl.data.images import ImageLimits
from asyncrl.queue import keys
from asyncrl.queue.connection import Retrier, open_client, redact_url, transaction
from asyncrl.queue.generator_records import GeneratorRecords
from asyncrl.queue.readback import (
    LogOnce,
    int_text,
)
from asyncrl.queue.records import from_text, to_text, unpack_note, unpack_small
from asyncrl.queue.reissue import ReissuedPrompt, parse_reissued
from asyncrl.queue.scripts import (
    DROP_ADMITTED,
    INCR_MANY,
    NEXT_INCARNATION,
    RELEASE_ADMISSION,
    RELEASE_INFLIGHT,
    RESTART_ADMISSION,
    RETIRE_WEIGHTS,
    TRY_ADMIT,
)
from asyncrl.queue.signing import JOB_FIELDS, SIGNATURE_FIELDS, JobSigner, PublishedJob, signature_fields
from asyncrl.types import WeightLocation, format_location, parse_location

log = logging.getLogger("asyncrl.queue")


RUN_COUNTERS = (
    "groups_started",
    "groups_produced",
    "groups_trained",
    "dropped_stale",
    "dead_lettered",
    "dropped_uniform",
    "weight_load_failures",
    "generator_restarts",
)
"""The counters every run reports: one never incremented is 0 (not absent) in counters(), in
summary.json and on the dashboard."""


class RunState(GeneratorRecords):
    """State of one run in Redis: `RunState.connect(url, run)`, or `RunState.of(queue)`."""

    def __init__(self, client: redis.Redis, run: str, retry: Retrier, *, metrics_maxlen: int = 100_000):
        self._r = client
        self.run = run
        self._retry = retry
        self.metrics_maxlen = metrics_maxlen
        self._k_state = keys.state(run)
        self._k_counters = keys.counters(run)
        self._k_generators = keys.generators(run)
        self._k_metrics = keys.metrics(run)
        self._try_admit = client.register_script(TRY_ADMIT)
        self._release = client.register_script(RELEASE_ADMISSION)
        self._release_inflight = client.register_script(RELEASE_INFLIGHT)
        self._drop_admitted = client.register_script(DROP_ADMITTED)
        self._retire_weights = client.register_script(RETIRE_WEIGHTS)
        self._restart_admission = client.register_script(RESTART_ADMISSION)
        self._next_incarnation = client.register_script(NEXT_INCARNATION)
        self._incr_many = client.register_script(INCR_MANY)
        self._say = LogOnce(log)
        self._owned: dict[FieldT, EncodableT] = {}  # state fields this process wrote last (reassert_owned)
        self._owned_lock = threading.Lock()

    @classmethod
    def connect(
        cls,
        url: str,
        run: str,
        *,
        password: str | None = None,
        retry_deadline_s: float = 30.0,
        outage_deadline_s: float | None = 0.0,
    ) -> RunState:
        """Its own connection; see Retrier for the two deadlines."""
        client = open_client(url, password=password)
        retry = Retrier(redact_url(url), deadline_s=retry_deadline_s, outage_deadline_s=outage_deadline_s)
        rs = cls(client, run, retry)
        retry(client.ping)
        retry(client.sadd, keys.RUNS, run)
        return rs

    @classmethod
    def of(cls, queue) -> RunState:
        """The run state of `queue`'s run, over the queue's connection and retry policy."""
        return cls(queue.client, queue.run, queue.retry)

    @property
    def retry(self) -> Retrier:
        return self._retry

    def close(self) -> None:
        self._r.close()

    def _transaction(self, build: Callable[[redis.client.Pipeline], None]) -> list:
        return transaction(self._r, self._retry, build)

    # ------------------------------------------------------------------ state hash

    @property
    def password(self) -> str | None:
        """The password this connection authenticates with (from the URL or the argument)."""
        return self._r.connection_pool.connection_kwargs.get("password")

    def set_state(self, *, signer: JobSigner | None = None, **fields: Any) -> None:
        """Set fields of the run's state hash; a None value deletes the field.

        `config` and `model_path` (the published job) go together, and with them their
        signatures (by `signer`, the trainer's key, and under the connection's password) in the
        same transaction: what is signed is exactly what is written."""
        if any(k in fields for k in SIGNATURE_FIELDS):
            raise ValueError("a job's signatures are written with config and model_path, never on their own")
        drop = [k for k, v in fields.items() if v is None]
        put: dict[FieldT, EncodableT] = {k: to_text(k, v) for k, v in fields.items() if v is not None}
        if "config" in fields or "model_path" in fields:
            config, model_path = put.get("config"), put.get("model_path")
            if not isinstance(config, str) or not isinstance(model_path, str):
                raise ValueError("set_state: config and model_path are published together, both set")
            signed = signature_fields(self.run, config, model_path, password=self.password, signer=signer)
            put.update(signed)
            drop += [k for k in SIGNATURE_FIELDS if k not in signed]  # an earlier trainer's must not outlive it

        def build(pipe: redis.client.Pipeline) -> None:
            if put:
                pipe.hset(self._k_state, mapping=put)
            if drop:
                pipe.hdel(self._k_state, *drop)

        with self._owned_lock:
            self._transaction(build)
            self._own(put, drop)

    def _own(self, put: dict[FieldT, EncodableT], drop: Sequence[FieldT] = ()) -> None:
        self._owned.update(put)
        for name in drop:
            self._owned.pop(name, None)

    def reassert_owned(self) -> None:
        """Write again every state field this process set (its last value): a field another
        client rewrote (the policy version, admission's bound, the published job) is back
        within one call. The trainer calls it while it waits for data; a write racing it (the
        publish thread raising the version) takes the same lock, so no field goes backwards."""
        with self._owned_lock:
            if self._owned:
                self._retry(self._r.hset, self._k_state, mapping=dict(self._owned))

    def state(self) -> dict[str, int | float | str]:
        """Every field, parsed as from_text does (never raises: a value that is no number stays text)."""
        raw = self._retry(self._r.hgetall, self._k_state)
        return {k.decode(): from_text(v.decode()) for k, v in raw.items()}

    def published_job(self) -> PublishedJob | None:
        """The job its trainer published (None before it has), unparsed and unverified."""
        values = self._retry(self._r.hmget, self._k_state, list(JOB_FIELDS))
        if values[0] is None or values[1] is None:
            return None
        return PublishedJob(*values)

    def set_policy_version(self, version: int) -> None:
        """The learner's current version v (optimizer steps taken); admission reads it."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"policy version must be an int >= 0, got {version!r}")
        with self._owned_lock:
            self._retry(self._r.hset, self._k_state, "policy_version", version)
            self._own({"policy_version": version})

    def policy_version(self) -> int:
        """0 before the first write, and while the field holds no count (logged once)."""
        try:
            return int_text(self._retry(self._r.hget, self._k_state, "policy_version"), "policy_version") or 0
        except ValueError as e:
            self._say(("state", "policy_version"), "run state: %s; read as 0", e)
            return 0

    def set_weights(self, location: WeightLocation, version: int) -> None:
        """Where the weights of `version` were published (a file or an object-store name), in one write."""
        fields: dict[FieldT, EncodableT] = {
            "weights_location": format_location(location),
            "weights_version": int(version),
        }
        with self._owned_lock:
            self._retry(self._r.hset, self._k_state, mapping=fields)
            self._own(fields)

    def weights(self) -> tuple[WeightLocation | None, int]:
        """(location, version) of the last published weights; (None, -1) before the first, and
        while either field is unreadable (logged once: nothing is loaded from it)."""
        loc, ver = self._retry(self._r.hmget, self._k_state, ["weights_location", "weights_version"])
        if loc is None or ver is None:
            return None, -1
        try:
            version = int_text(ver, "weights_version")
            location = parse_location(loc.decode("utf-8", "replace"))
        except ValueError as e:
            self._say(("state", "weights", str(e)[:80]), "run state: announced weights unreadable (%s); ignored", e)
            return None, -1
        return location, -1 if version is None else version

    # ------------------------------------------------------------------ counters

    def incr(self, name: str, n: int = 1) -> int:
        """Add to a counter; returns its new value (a field overwritten with text restarts at 0)."""
        return int(self._retry(self._incr_many, keys=[self._k_counters], args=[name, n]))

    def incr_many(self, counts: dict[str, int]) -> None:
        """Add to several counters in one step (scripts.INCR_MANY)."""
        if counts:
            args = [x for name, n in counts.items() for x in (name, n)]
            self._retry(self._incr_many, keys=[self._k_counters], args=args)

    def pop_reissued(self, limits: ImageLimits | None = None) -> ReissuedPrompt | None:
        """A prompt whose group was dropped as stale, to run again (asyncrl.queue.reissue);
        None when there is none. Each is handed to one generator only (LPOP). ``limits``: the
        run's rollout.images, which bound the note's size."""
        while True:
            raw = self._retry(self._r.lpop, keys.reissue(self.run))
            if raw is None:
                return None
            try:
                prompt = parse_reissued(unpack_note(raw, limits))
            except Exception as e:
                prompt = None
                log.warning("re-issue entry unreadable (%s); skipped", e)
            if prompt is not None:
                return prompt

    def counters(self) -> dict[str, int]:
        """Every counter that holds a count, RUN_COUNTERS at 0 until they are counted; one that
        holds something else reads as 0 if it is one of RUN_COUNTERS (every writer restarts it
        at 0), else is left out (logged once either way)."""
        out = dict.fromkeys(RUN_COUNTERS, 0)
        for k, v in self._retry(self._r.hgetall, self._k_counters).items():
            name = k.decode("utf-8", "replace")
            try:
                out[name] = int_text(v, name) or 0
            except ValueError as e:
                self._say(("counter", name), "run counters: %s; left out", e)
        return out

    # ------------------------------------------------------------------ admission

    def configure_admission(self, max_staleness: int, groups_per_step: int, mini_batches_per_step: int = 1) -> None:
        """The trainer's bound and step shape: a step takes groups_per_step groups and raises
        the policy version by mini_batches_per_step (one version per optimizer step)."""
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        if not isinstance(groups_per_step, int) or groups_per_step < 1:
            raise ValueError(f"groups_per_step must be an int >= 1, got {groups_per_step!r}")
        if not isinstance(mini_batches_per_step, int) or mini_batches_per_step < 1:
            raise ValueError(f"mini_batches_per_step must be an int >= 1, got {mini_batches_per_step!r}")
        self.set_state(
            max_staleness=max_staleness, groups_per_step=groups_per_step, mini_batches_per_step=mini_batches_per_step
        )

    def try_admit(self, n: int = 1) -> bool:
        """Start n more groups iff groups_started + n <= admission_budget(v, max_staleness,
        groups_per_step, mini_batches_per_step) = floor((v + max_staleness + 1) / m) * groups_per_step.

        Atomic (one Lua script), so racing generators never overshoot. False until the
        trainer has called configure_admission.
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"try_admit(n): n must be an int >= 1, got {n!r}")
        return self._retry(self._try_admit, keys=[self._k_state, self._k_counters], args=[n]) == 1

    def release_admission(self, n: int) -> int:
        """Give back n admitted groups that will never be trained (abandoned, dropped, dead-lettered)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"release_admission(n): n must be an int >= 0, got {n!r}")
        return int(self._retry(self._release, keys=[self._k_counters], args=[n]))

    def retire_weights(self) -> int:
        """A trainer is starting: forget the announced weights, close admission (until
        configure_admission) and return the highest version this run ever announced."""
        with self._owned_lock:
            self._own({}, ["weights_location", "weights_version", "max_staleness", "groups_per_step"])
            return int(self._retry(self._retire_weights, keys=[self._k_state]))

    def admission_open(self) -> bool:
        """Whether the trainer has configured admission (its prepare() ran) since it started."""
        ms, gps = self._retry(self._r.hmget, self._k_state, ["max_staleness", "groups_per_step"])
        return ms is not None and gps is not None

    def inflight_generators(self) -> list[str]:
        """Ids of generators with admitted prompts noted in Redis (alive, or dead and not yet replaced)."""
        prefix = keys.inflight(self.run, "")
        found = self._retry(lambda: list(self._r.scan_iter(match=f"{prefix}*", count=1000)))
        return sorted(k.decode()[len(prefix) :] for k in found)

    def restart_admission(self, base: int, reissued_by: list[str], orphaned: Sequence[str] = ()) -> int:
        """Set groups_started for a (re)starting trainer: ``base`` plus every entry in the stream
        plus the prompts noted for the generators in ``reissued_by`` (a successor re-issues them
        without a new admission, so they must be counted here); the notes of ``orphaned``
        generators (nobody will re-issue them) are deleted. One atomic step; returns the count."""
        if not isinstance(base, int):
            raise ValueError(f"base must be an int, got {base!r}")
        inflight = [keys.inflight(self.run, g) for g in (*reissued_by, *orphaned)]
        return int(
            self._retry(
                self._restart_admission,
                keys=[self._k_counters, keys.rollouts(self.run), *inflight],
                args=[base, len(reissued_by)],
            )
        )

    def reset_admission(self, groups_started: int) -> None:
        """Set groups_started outright (resume: trained + still queued or pending)."""
        if not isinstance(groups_started, int) or groups_started < 0:
            raise ValueError(f"groups_started must be an int >= 0, got {groups_started!r}")
        self._retry(self._r.hset, self._k_counters, "groups_started", groups_started)

    # ------------------------------------------------------------------ metrics

    def publish_metrics(self, step: int, metrics: dict[str, float], source: str = "trainer") -> str:
        """XADD {"step", "time", "source", "metrics"} to the run's metrics stream (approx. capped)."""
        clean: dict[str, float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"metric {name!r}={value!r}: names must be str and values numbers")
            clean[name] = float(value)
        record = {"step": int(step), "time": time.time(), "source": str(source), "metrics": clean}
        entry = self._retry(
            self._r.xadd,
            self._k_metrics,
            {keys.RECORD_FIELD: msgpack.packb(record, use_bin_type=True)},
            maxlen=self.metrics_maxlen,
            approximate=True,
        )
        return entry.decode()

    def read_metrics(self, since_id: str = "0", count: int = 1000) -> list[tuple[str, dict[str, Any]]]:
        """Metrics records after `since_id` (exclusive), oldest first, at most `count`."""
        start = "-" if since_id in ("0", "-", "0-0") else f"({since_id}"
        entries = self._retry(self._r.xrange, self._k_metrics, min=start, max="+", count=count)
        out = []
        for entry_id, fields in entries:
            try:
                record = unpack_small(fields[keys.RECORD_FIELD])
            except Exception as e:
                log.warning("metrics entry %s unreadable (%s); skipped", entry_id, e)
                continue
            if isinstance(record, dict):
                out.append((entry_id.decode(), record))
        return out
