"""A client holding the run's Redis credentials writes bad values into the run's keys; against a
real redis-server, every reader either uses a checked value or skips it (logged), never raises:

- records that break the run's contract (another tokenizer's ids, a future version, the wrong
  group size) are dead-lettered with their reason through the real consumer, acked (a
  restarted consumer never sees them) and only the admitted ones give their admission back;
- garbage heartbeats (a string version, version=inf, not msgpack) are skipped by the trainer's
  per-step metrics, its watchdog and the dashboard, which still answers with JSON;
- garbage counters, announced weights, policy version, incarnation, engine record and
  in-flight notes are read as absent; admission refuses instead of failing, and the trainer's
  own state fields come back with `reassert_owned`.
"""

from __future__ import annotations

import json
import math
import time

import msgpack
import numpy as np
import redis

from asyncrl.control.step_metrics import StepTimes, step_metrics
from asyncrl.control.watchdog import GeneratorWatchdog
from asyncrl.data.codec import encode_group
from asyncrl.data.contract import RecordContract
from asyncrl.data.images import ImageLimits
from asyncrl.monitor.dashboard.data import list_runs, run_snapshot
from asyncrl.queue import RolloutQueue, RunState, keys
from asyncrl.rollout.recovery import predecessor_prompts, reap_predecessor
from asyncrl.rollout.vision_prompts import VisionModel, with_images
from asyncrl.types import RolloutGroup, Sample

RUN = "hostile"
CONTRACT = RecordContract(vocab_size=32, max_len=16, group_size=2, stepwise=False, max_version=4)


def _group(gid: str, version: int = 2) -> RolloutGroup:
    samples = [Sample([5, 6, 7], [-0.5, -0.1, -1.0], [1, 1, 1], 1.0, version, generator_id="gen-0") for _ in range(2)]
    return RolloutGroup(gid, gid, [1, 2, 3], samples, env="copy")


def test_records_breaking_the_run_are_dead_lettered_and_never_replayed(redis_url):
    q = RolloutQueue.connect(redis_url, RUN, consumer="learner-0", ledger=True)
    rs = RunState.of(q)
    raw = redis.Redis.from_url(redis_url)
    oov = _group("oov")
    oov.samples[0].response_ids[1] = 10**6  # another tokenizer's id: used to end the run at the next step
    future = _group("future", version=9)
    three = _group("three")
    three.samples.append(three.samples[0])
    bad = {"oov": oov, "future": future, "three": three}
    for name, g in bad.items():
        fields = {keys.RECORD_FIELD: encode_group(g)}
        if name == "oov":  # as a generator's put leaves it: with the prompt's in-flight note
            fields[keys.NOTE_FIELD] = msgpack.packb({"text": "abc=", "metadata": {}})
        raw.xadd(keys.rollouts(RUN), fields)
    q.put(_group("good"))
    got = q.get_batch(4, min_version=0, timeout=1.0, contract=CONTRACT)
    assert [g.group_id for _, g in got] == ["good"]
    dead = {e["group_id"]: e for e in q.deadletter_entries()}
    assert {k: e["reason"] for k, e in dead.items()} == {
        "oov": "token_out_of_range",
        "future": "future_version",
        "three": "group_size",
    }
    assert "1000000" in dead["oov"]["detail"] and dead["future"]["source_id"]
    c = rs.counters()
    assert c["dead_lettered"] == 3 and c["dead_lettered_admitted"] == 1
    assert q.pending() == 1  # the good one, until its checkpoint acks it; the bad ones are acked
    # A restarted trainer (same consumer name) re-reads its pending entries: never the bad ones.
    q2 = RolloutQueue.connect(redis_url, RUN, consumer="learner-0", ledger=True)
    again = q2.get_batch(4, min_version=0, timeout=0.5, contract=CONTRACT)
    assert [g.group_id for _, g in again] == ["good"]
    assert rs.counters()["dead_lettered"] == 3
    q.close()
    q2.close()


def test_garbage_read_back_from_redis_is_skipped_by_every_reader(redis_url):
    q = RolloutQueue.connect(redis_url, RUN)
    rs = RunState.of(q)
    raw = redis.Redis.from_url(redis_url)
    rs.configure_admission(max_staleness=1, groups_per_step=2)
    rs.set_policy_version(3)
    rs.set_state(status="running", started_at=time.time())
    rs.heartbeat("gen-0", {"version": 3, "tokens_per_s": 10.0, "reward_errors": 2})
    gens = keys.generators(RUN)
    now = time.time()
    raw.hset(gens, "strver", msgpack.packb({"version": "three", "heartbeat": now}))
    raw.hset(gens, "infver", msgpack.packb({"version": math.inf, "heartbeat": now}))
    raw.hset(gens, "strbeat", msgpack.packb({"version": 1, "heartbeat": "now"}))
    raw.hset(gens, "notmsgpack", b"\xc1\xc1")
    raw.hset(gens, "alist", msgpack.packb([1, 2]))
    raw.hset(keys.counters(RUN), mapping={"dropped_stale": "lots", "dead_lettered": "inf"})

    beats = rs.generators()
    assert set(beats) == {"gen-0"} and beats["gen-0"].version == 3 and beats["gen-0"].reward_errors == 2
    # Not a count: read as 0, as every writer restarts it (never the text, never an error).
    assert rs.counters()["dropped_stale"] == 0 and rs.counters()["dead_lettered"] == 0
    dog = GeneratorWatchdog([], rs, timeout_s=60.0)
    assert dog.runnable() == ["gen-0 (heartbeat 0 s ago)"]
    metrics = step_metrics(
        [_group("x")],
        [1],
        StepTimes(0.1, 0.1, 0.0, 0.0, 0.2),
        version=4,
        max_staleness=1,
        queue=q,
        run_state=rs,
        watchdog=dog,
    )
    assert metrics["generator/gen-0/lag"] == 1.0 and metrics["rollout/reward_errors"] == 2.0
    assert not any("strver" in k or "infver" in k for k in metrics)
    raw.sadd(keys.RUNS, "bad:run", "")
    assert list_runs(raw) == [RUN]
    snap = run_snapshot(raw, RUN)
    json.dumps(snap, allow_nan=False)  # what the dashboard serves: no 500, no NaN
    assert [g["id"] for g in snap["generators"]] == ["gen-0"]

    # The state hash rewritten: readers see "absent", admission refuses instead of failing ...
    state = keys.state(RUN)
    raw.hset(state, mapping={"policy_version": "x", "weights_location": "/x", "weights_version": "1e999"})
    assert rs.policy_version() == 0 and rs.weights() == (None, -1)
    assert rs.try_admit() is False
    # A counter rewritten with text (or past 64 bits) restarts at 0 for every writer: no
    # generator's admission and no trainer's count fails on it.
    raw.hset(keys.counters(RUN), "groups_started", "many")
    raw.hset(state, "policy_version", 3)
    assert rs.try_admit() is True and rs.counters()["groups_started"] == 1  # text counted as 0
    raw.hset(keys.counters(RUN), mapping={"dropped_stale": "lots", "dead_lettered": "99999999999999999999"})
    rs.incr_many({"dropped_stale": 2, "dead_lettered": 1})
    assert rs.incr("duplicates") == 1
    raw.hset(keys.counters(RUN), "duplicates", "x")
    assert rs.incr("duplicates", 3) == 3
    c = rs.counters()
    assert c["dropped_stale"] == 2 and c["dead_lettered"] == 1 and c["groups_started"] == 1
    raw.hset(keys.counters(RUN), "groups_started", 0)
    json.dumps(run_snapshot(raw, RUN), allow_nan=False)
    # ... until the trainer writes its own fields again.
    raw.hset(state, mapping={"policy_version": "x", "max_staleness": "y"})
    rs.reassert_owned()
    assert rs.policy_version() == 3 and rs.try_admit() is True

    # A generator's start: incarnation, engine record and in-flight notes of its predecessor.
    raw.set(keys.incarnation(RUN, "gen-0"), "garbage")
    first = rs.next_incarnation("gen-0")
    assert first > 1_000_000 and rs.next_incarnation("gen-0") == first + 1  # never an earlier number
    for record in (b"\xc1", msgpack.packb({"host": "h", "pids": [[1, 0.0]], "segments": [], "started": True})):
        raw.hset(keys.engine_pids(RUN), "gen-0", record)
        assert rs.engine_record("gen-0") is None and reap_predecessor(rs, "gen-0") is False
    traversal = {"host": "h", "pids": [], "segments": ["/etc/passwd"], "started": True}
    raw.hset(keys.engine_pids(RUN), "gen-0", msgpack.packb(traversal))
    assert rs.engine_record("gen-0") is None
    assert rs.admit_prompt("gen-0", "p-good", msgpack.packb({"text": "abc=", "metadata": {"target": "abc"}}))
    started = rs.counters()["groups_started"]
    # a note's images are read back too: a forged one is dropped like an unreadable note
    forged = msgpack.packb({"text": "x", "metadata": {"images": [b"\x89PNG\r\n\x1a\nforged"]}})
    raw.hset(keys.inflight(RUN, "gen-0"), mapping={"p-bad": b"\xc1", "p-list": msgpack.packb([1]), "p-img": forged})
    raw.hincrby(keys.counters(RUN), "groups_started", 3)  # as a resume counts every note
    vision = VisionModel("idefics3", image_token_id=60, tokens_per_image=4)
    encode = with_images(lambda text, meta: [60] if "images" in meta else [1, 2], vision, ImageLimits())
    items = predecessor_prompts(rs, "gen-0", encode)
    assert [i.prompt_id for i in items] == ["p-good"]
    c = rs.counters()
    assert c["groups_started"] == started and c["notes_unreadable"] == 3  # their admission given back

    # A trainer starting on this run renumbers past what was announced: text is not a version.
    raw.hset(state, mapping={"policy_version": 3, "weights_version": "1e999", "versions_retired_upto": "inf"})
    assert rs.retire_weights() == 3
    q.close()
    raw.close()


def test_numpy_free_heartbeat_fields_round_trip(redis_url):
    """What a real generator writes passes the check (GeneratorStats.heartbeat's fields)."""
    rs = RunState.connect(redis_url, RUN)
    info = {"version": 2, "groups": 5, "tokens_per_s": 1.5, "inflight": 3, "blocked": None}
    rs.heartbeat("g", {**info, "reward_errors": 0, "reward_timeouts": 1, "newer_field": [1]})
    beat = rs.generators()["g"]
    assert (beat.version, beat.groups, beat.inflight, beat.reward_timeouts) == (2, 5, 3, 1)
    assert np.isclose(beat.tokens_per_s, 1.5) and beat.blocked is None
    rs.close()
