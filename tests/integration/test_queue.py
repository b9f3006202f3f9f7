"""RolloutQueue against a real redis-server (the session `redis_server` fixture).

    .venv/bin/python -m pytest tests/integration/test_queue.py -q

Round trips, two producer processes, the staleness filter, dead-lettering (named cases, a
pickle trap and a 1,200-record fuzz), backpressure, admission under racing threads, and the
run-level state. Crash/restart/password cases are in test_queue_faults.py.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import random
import threading
import time

import msgpack
import numpy as np
import pytest
import redis

from asyncrl.data.codec import RecordError, decode_group, encode_group
from asyncrl.queue import QueueFull, RolloutQueue, RunState, keys
from asyncrl.types import RolloutGroup, Sample, WeightsFile, WeightsObject
from tests.support.waiting import wait_for


def random_group(rng: np.random.Generator, group_id: str, version: int | None = None) -> RolloutGroup:
    """A group exercising every field: optional arrays present or absent, odd lengths, metadata."""
    samples = []
    for i in range(int(rng.integers(1, 5))):
        t = int(rng.integers(0, 40))
        samples.append(
            Sample(
                response_ids=rng.integers(0, 2**31 - 1, t),
                rollout_logprobs=-rng.random(t, dtype=np.float32) * 5,
                loss_mask=rng.integers(0, 2, t),
                reward=float(rng.normal()),
                behavior_version=int(rng.integers(0, 9)) if version is None else version,
                stop_reason=str(rng.choice(["stop", "length", "abort"])),
                token_versions=rng.integers(0, 9, t) if rng.random() < 0.5 else None,
                token_rewards=rng.random(t).astype(np.float32) if rng.random() < 0.5 else None,
                generator_id=f"gen-{i}",
                timings={"gen_s": float(rng.random())},
                error="boom" if rng.random() < 0.1 else None,
                prompt_ids=rng.integers(0, 64, 3) if rng.random() < 0.3 else None,
                trajectory_id=int(rng.integers(0, 3)),
                step_index=int(rng.integers(0, 3)),
            )
        )
    return RolloutGroup(
        group_id=group_id,
        prompt_id=f"p{rng.integers(1000)}",
        prompt_ids=rng.integers(0, 64, int(rng.integers(1, 20))),
        samples=samples,
        env="arith",
        metadata={"answer": str(rng.integers(100)), "k": [1, None]},
    )


def assert_same_group(a: RolloutGroup, b: RolloutGroup) -> None:
    assert (a.group_id, a.prompt_id, a.env, a.metadata, a.schema_version) == (
        b.group_id,
        b.prompt_id,
        b.env,
        b.metadata,
        b.schema_version,
    )
    assert a.prompt_ids.dtype == b.prompt_ids.dtype and np.array_equal(a.prompt_ids, b.prompt_ids)
    assert len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples, strict=True):
        for name in ("response_ids", "rollout_logprobs", "loss_mask", "token_versions", "token_rewards", "prompt_ids"):
            u, v = getattr(x, name), getattr(y, name)
            assert (u is None) == (v is None), name
            if u is not None:
                assert u.dtype == v.dtype and u.tobytes() == v.tobytes(), name
        for name in (
            "reward",
            "behavior_version",
            "stop_reason",
            "generator_id",
            "timings",
            "error",
            "trajectory_id",
            "step_index",
        ):
            assert getattr(x, name) == getattr(y, name), name


def small_group(group_id: str, version: int = 0) -> RolloutGroup:
    return RolloutGroup(group_id, "p", [1, 2], [Sample([3, 4], [-0.5, -0.25], [1, 1], 1.0, version)])


def drain(q: RolloutQueue, n: int, min_version: int = 0, timeout: float = 10.0) -> list[tuple[str, RolloutGroup]]:
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += q.get_batch(n - len(out), min_version, timeout=0.5)
    return out


def test_1000_groups_round_trip_exactly(redis_url):
    rng = np.random.default_rng(0)
    groups = [random_group(rng, f"g{i}") for i in range(1000)]
    q = RolloutQueue.connect(redis_url, "rt")
    rs = RunState.of(q)
    ids = [q.put(g) for g in groups]
    assert q.depth() == 1000 and q.pending() == 0 and rs.counters()["groups_produced"] == 1000
    got = drain(q, 1000)
    assert [entry_id for entry_id, _ in got] == ids  # stream order
    for g, (_, back) in zip(groups, got, strict=True):
        assert_same_group(g, back)
    assert q.depth() == 0 and q.pending() == 1000
    assert q.get_batch(1, 0, timeout=0.05) == []  # nothing delivered twice
    assert q.ack(ids) == 1000
    assert q.pending() == 0 and redis.Redis.from_url(redis_url).xlen(keys.rollouts("rt")) == 0
    assert "rt" in {m.decode() for m in redis.Redis.from_url(redis_url).smembers(keys.RUNS)}
    q.close()


def _produce(url: str, prefix: str, n: int) -> None:
    q = RolloutQueue.connect(url, "mp", maxlen=40)
    for i in range(n):
        q.put(small_group(f"{prefix}-{i}"), timeout=60)
    q.close()


def test_two_producer_processes_one_consumer_no_loss_no_duplicate(redis_url):
    n = 300
    q = RolloutQueue.connect(redis_url, "mp", maxlen=40)
    rs = RunState.of(q)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_produce, args=(redis_url, p, n)) for p in ("a", "b")]
    for p in procs:
        p.start()
    seen: dict[str, int] = {}
    deadline = time.monotonic() + 60
    while sum(seen.values()) < 2 * n and time.monotonic() < deadline:
        batch = q.get_batch(16, 0, timeout=0.5)
        for _, g in batch:
            seen[g.group_id] = seen.get(g.group_id, 0) + 1
        q.ack([entry_id for entry_id, _ in batch])  # acks make room: producers hit maxlen=40
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert set(seen) == {f"{p}-{i}" for p in "ab" for i in range(n)}
    assert max(seen.values()) == 1
    assert rs.counters()["groups_produced"] == 2 * n and q.depth() == 0 and q.pending() == 0
    q.close()


def test_stale_groups_are_dropped_counted_and_never_returned(redis_url):
    q = RolloutQueue.connect(redis_url, "stale")
    rs = RunState.of(q)
    for i, v in enumerate([0, 3, 1, 5, 2, 4]):
        q.put(small_group(f"g{i}-v{v}", version=v))
    # a group's version is its oldest sample's: 7 and 2 -> 2, stale at min_version 3
    mixed = small_group("mixed")
    mixed.samples.append(Sample([1], [-1.0], [1], 0.0, 7))
    mixed.samples[0].behavior_version = 2
    q.put(mixed)
    got = drain(q, 3, min_version=3, timeout=2.0)
    assert [g.group_id for _, g in got] == ["g1-v3", "g3-v5", "g5-v4"]
    assert q.get_batch(5, 3, timeout=0.1) == []
    assert q.dropped_ids() == {"g0-v0", "g2-v1", "g4-v2", "mixed"}
    assert rs.counters()["dropped_stale"] == 4
    assert q.pending() == 3 and q.depth() == 0  # dropped ones are acked, only returned ones pend
    q.close()


class _Trap:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_malformed_records_are_dead_lettered_and_good_ones_still_served(redis_url, tmp_path):
    q = RolloutQueue.connect(redis_url, "dl", max_record_bytes=4096)
    rs = RunState.of(q)
    raw = redis.Redis.from_url(redis_url)
    stream = keys.rollouts("dl")
    good = encode_group(small_group("x"))
    rec = msgpack.unpackb(good, raw=False)
    bad_len = {**rec, "samples": [{**rec["samples"][0], "loss_mask": {"dtype": "|u1", "shape": [1], "data": b"\1"}}]}
    nan_lp = {
        **rec,
        "samples": [
            {
                **rec["samples"][0],
                "rollout_logprobs": {"dtype": "<f4", "shape": [2], "data": np.array([np.nan, 0], "<f4").tobytes()},
            }
        ],
    }
    marker = tmp_path / "unpickled"
    cases = {
        "truncated": (good[:-5], "bad_msgpack"),
        "wrong lengths": (msgpack.packb(bad_len), "length_mismatch"),
        "NaN logprob": (msgpack.packb(nan_lp), "nonfinite_logprob"),
        "oversize": (encode_group(random_group(np.random.default_rng(1), "big")) + b"\0" * 5000, "oversize"),
        "unknown schema": (msgpack.packb({**rec, "schema": 99}), "unknown_schema"),
        "random bytes": (bytes(random.Random(3).randrange(256) for _ in range(200)), None),
        "pickle": (pickle.dumps(_Trap(str(marker))), None),
    }
    raw.xadd(stream, {b"other": b"no d field"})
    expected_good = []
    for i, (data, _) in enumerate(cases.values()):
        raw.xadd(stream, {keys.RECORD_FIELD: data})
        q.put(small_group(f"good-{i}"))
        expected_good.append(f"good-{i}")
    got = drain(q, len(expected_good), timeout=3.0)
    assert [g.group_id for _, g in got] == expected_good
    dead = q.deadletter_entries()
    assert len(dead) == len(cases) + 1 and rs.counters()["dead_lettered"] == len(cases) + 1
    assert dead[0]["reason"] == "missing_field" and dead[0]["d"] == b""
    for entry, (name, (data, reason)) in zip(dead[1:], cases.items(), strict=True):
        assert entry["d"] == data, name
        if reason is not None:
            assert entry["reason"] == reason, name
        else:
            assert entry["reason"] in {"bad_msgpack", "bad_type"}, name
    # the source ids point at the original entries, which are gone from the rollout stream
    assert all(raw.xrange(stream, e["source_id"], e["source_id"]) == [] for e in dead)
    assert not marker.exists()
    q.close()


def test_fuzz_1200_mutated_records_interleaved_with_good_ones(redis_url):
    """Each mutated record is dead-lettered with the reason decode_group gives it locally, or
    (a mutation that happens to stay valid) served; good records are all served, in order."""
    q = RolloutQueue.connect(redis_url, "fuzz")
    rs = RunState.of(q)
    raw = redis.Redis.from_url(redis_url)
    rng = random.Random(7)
    base = encode_group(random_group(np.random.default_rng(5), "base"))
    expected_reasons, expected_served = [], []
    pipe = raw.pipeline(transaction=False)
    for i in range(1200):
        data = bytearray(base)
        kind = i % 3
        if kind == 0:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 1:
            data = data[: rng.randrange(len(data))]
        else:
            data = bytearray(rng.randbytes(rng.randint(0, 200)))
        try:
            served = decode_group(bytes(data))
            expected_served.append(served.group_id)  # still valid (e.g. a flipped reward bit)
        except RecordError as e:
            expected_reasons.append(e.reason)
        pipe.xadd(keys.rollouts("fuzz"), {keys.RECORD_FIELD: bytes(data)})
        if i % 10 == 0:
            pipe.xadd(keys.rollouts("fuzz"), {keys.RECORD_FIELD: encode_group(small_group(f"good-{i}"))})
            expected_served.append(f"good-{i}")
    pipe.execute()
    # mutated-but-valid copies of "base" share one group id: the consumer serves it once
    unique = list(dict.fromkeys(expected_served))
    got = drain(q, len(unique), timeout=20.0)
    assert q.get_batch(1, 0, timeout=0.2) == []
    assert [g.group_id for _, g in got] == unique
    assert len(expected_reasons) > 1000
    assert [e["reason"] for e in q.deadletter_entries()] == expected_reasons
    c = rs.counters()
    assert c["dead_lettered"] == len(expected_reasons)
    assert c.get("duplicates", 0) == len(expected_served) - len(unique)
    q.close()


def _last_command(client, name: str) -> str | None:
    """The last command Redis ran for the connection named `name` (CLIENT LIST)."""
    return next((c["cmd"] for c in client.client_list() if c.get("name") == name), None)


def test_put_blocks_when_full_and_resumes_after_get_and_ack(redis_url):
    q = RolloutQueue.connect(redis_url, "bp", maxlen=4)
    rs = RunState.of(q)
    for i in range(4):
        q.put(small_group(f"g{i}"))
    with pytest.raises(QueueFull, match="maxlen=4"):
        q.put(small_group("late"), timeout=0.2)
    producer = RolloutQueue.connect(redis_url, "bp", maxlen=4)
    batch = q.get_batch(2, 0, timeout=1.0)
    with pytest.raises(QueueFull, match="maxlen=4"):  # delivered but un-acked entries still count against maxlen
        producer.put(small_group("g4"), timeout=0.3)
    # A put waiting for room resumes once entries are acked. The ack comes only after the put has
    # found the queue full (its connection ran the put script), so it resumes rather than just succeeds.
    producer.client.client_setname("bp-producer")  # the producer's one pooled connection: the put's
    done = threading.Event()
    t = threading.Thread(target=lambda: (producer.put(small_group("g4"), timeout=20), done.set()))
    t.start()
    wait_for(lambda: _last_command(q.client, "bp-producer") == "evalsha", 10, "the waiting put's first attempt")
    assert not done.is_set()
    q.ack([entry_id for entry_id, _ in batch])
    assert done.wait(5.0)
    t.join()
    assert [g.group_id for _, g in drain(q, 3)] == ["g2", "g3", "g4"]
    assert rs.counters()["groups_produced"] == 5
    q.close()
    producer.close()


def test_put_many_fills_up_to_maxlen_atomically(redis_url):
    q = RolloutQueue.connect(redis_url, "pm", maxlen=5)
    with pytest.raises(QueueFull) as info:
        q.put_many([small_group(f"g{i}") for i in range(8)], timeout=0.1)
    assert len(info.value.added_ids) == 5 and q.depth() == 5
    with pytest.raises(RecordError, match="oversize"):
        RolloutQueue.connect(redis_url, "pm", max_record_bytes=100).put(random_group(np.random.default_rng(0), "big"))
    q.close()


def test_racing_threads_never_exceed_the_admission_budget(redis_url):
    q = RolloutQueue.connect(redis_url, "adm")
    rs = RunState.of(q)
    assert rs.try_admit() is False  # not configured by the trainer yet
    rs.configure_admission(max_staleness=1, groups_per_step=4)  # budget (0 + 1 + 1) * 4 = 8
    admitted = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def generator():
        mine = RolloutQueue.connect(redis_url, "adm")
        mine_rs = RunState.of(mine)
        start.wait()
        n = sum(mine_rs.try_admit() for _ in range(40))
        with lock:
            admitted.append(n)
        mine.close()

    threads = [threading.Thread(target=generator) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(admitted) == 8 and rs.counters()["groups_started"] == 8
    assert rs.try_admit(1) is False
    rs.set_policy_version(2)  # budget (2 + 1 + 1) * 4 = 16
    assert rs.try_admit(8) is True and rs.try_admit(1) is False
    assert rs.release_admission(3) == 13
    assert [rs.try_admit() for _ in range(4)] == [True, True, True, False]
    assert rs.release_admission(100) == 0  # never below zero
    rs.reset_admission(15)
    assert rs.try_admit() is True and rs.try_admit() is False
    with pytest.raises(ValueError):
        rs.try_admit(0)
    q.close()


def test_run_state_heartbeats_and_metrics(redis_url):
    q = RolloutQueue.connect(redis_url, "st")
    rs = RunState.of(q)
    assert rs.policy_version() == 0 and rs.weights() == (None, -1)
    rs.set_policy_version(7)
    rs.set_weights(WeightsFile("/dev/shm/asyncrl/st/v7.safetensors"), 7)
    rs.set_state(status="running", lr=1.5e-5, flag=True, gone=None)
    rs.set_state(gone="x")
    rs.set_state(gone=None)
    assert rs.policy_version() == 7 and rs.weights() == (WeightsFile("/dev/shm/asyncrl/st/v7.safetensors"), 7)
    state = rs.state()
    assert state["status"] == "running" and state["lr"] == 1.5e-5 and state["flag"] == 1 and "gone" not in state
    rs.set_weights(WeightsObject("st", 8), 8)  # an object-store name is text in Redis, typed again when read
    assert rs.weights() == (WeightsObject("st", 8), 8) and rs.state()["weights_location"] == "ray-object://st/v8"
    with pytest.raises(TypeError):
        rs.set_state(bad=[1])
    assert rs.incr("groups_trained", 3) == 3 and rs.incr("groups_trained") == 4
    rs.heartbeat("gen-0", {"version": 6, "tokens_per_s": 812.5})
    rs.heartbeat("gen-1", {"version": 7})
    redis.Redis.from_url(redis_url).hset(keys.generators("st"), "gen-bad", pickle.dumps({"x": 1}))
    gens = rs.generators()
    assert set(gens) == {"gen-0", "gen-1"} and gens["gen-0"].tokens_per_s == 812.5
    assert time.time() - gens["gen-1"].heartbeat < 60
    rs.remove_generator("gen-1")
    assert set(rs.generators()) == {"gen-0"}
    first = rs.publish_metrics(1, {"loss/policy": 0.5, "queue/depth": 3})
    rs.publish_metrics(2, {"loss/policy": 0.25}, source="gen-0")
    records = rs.read_metrics()
    assert [(r["step"], r["source"], r["metrics"]) for _, r in records] == [
        (1, "trainer", {"loss/policy": 0.5, "queue/depth": 3.0}),
        (2, "gen-0", {"loss/policy": 0.25}),
    ]
    assert [r["step"] for _, r in rs.read_metrics(since_id=first)] == [2]
    with pytest.raises(TypeError):
        rs.publish_metrics(3, {"loss": "high"})
    q.close()


def test_ledger_records_every_produced_group_atomically(redis_url):
    """With ledger=True each put records its group id in the same script as the XADD, so
    produced = delivered + still queued holds exactly (the fault suite's ledger rests on it)."""
    from asyncrl.queue import RolloutQueue

    q = RolloutQueue.connect(redis_url, "ledger", ledger=True)
    groups = [_ledger_group(f"g{i}") for i in range(12)]
    q.put_many(groups[:7])
    for g in groups[7:]:
        q.put(g)
    got = q.get_batch(5, min_version=0, timeout=2.0)
    assert q.produced_ids() == {g.group_id for g in groups}
    queued = {g.group_id for g in q.queued_groups()}
    assert queued == {g.group_id for g in groups}  # the 5 taken are un-acked, so still in the stream
    q.ack([entry_id for entry_id, _ in got])
    assert {g.group_id for g in q.queued_groups()} == {g.group_id for g in groups} - {g.group_id for _, g in got}
    plain = RolloutQueue.connect(redis_url, "no-ledger")
    plain.put(_ledger_group("x"))
    assert plain.produced_ids() == set()


def _ledger_group(gid: str):
    import numpy as np

    from asyncrl.types import RolloutGroup, Sample

    s = Sample(
        response_ids=np.array([5, 6], np.int32),
        rollout_logprobs=np.array([-1.0, -2.0], np.float32),
        loss_mask=np.ones(2, np.uint8),
        reward=1.0,
        behavior_version=0,
    )
    return RolloutGroup(group_id=gid, prompt_id=gid, prompt_ids=np.array([1, 2], np.int32), samples=[s])


def test_generator_bookkeeping_is_atomic_and_a_retried_call_counts_once(redis_url):
    """A generator's admission + in-flight note, and its put + note deletion, are each one
    script; a retried admission of a noted prompt (its first reply lost) is not a new group."""
    q = RolloutQueue.connect(redis_url, "bookkeeping")
    rs = RunState.of(q)
    rs.configure_admission(max_staleness=0, groups_per_step=2)  # budget (0 + 0 + 1) * 2 = 2
    note = msgpack.packb({"text": "1+1=", "metadata": {"answer": "2"}}, use_bin_type=True)
    assert rs.admit_prompt("g0", "p1", note) is True
    assert rs.admit_prompt("g0", "p1", note) is True  # the retry
    assert rs.counters()["groups_started"] == 1
    assert rs.admit_prompt("g0", "p2", note) is True
    assert rs.admit_prompt("g0", "p3", note) is False  # over budget: refused and not noted
    assert rs.inflight_prompts("g0") == {"p1": note, "p2": note} and rs.inflight_prompts("g1") == {}

    q.put(RolloutGroup("p1", "p1", [1], [Sample([2], [-0.5], [1], 1.0, 0)]), inflight_of="g0")
    assert set(rs.inflight_prompts("g0")) == {"p2"} and q.depth() == 1
    assert rs.release_inflight("g0") == 1  # a clean stop hands p2's admission back
    assert rs.counters()["groups_started"] == 1 and rs.inflight_prompts("g0") == {}
    assert rs.release_inflight("g0") == 0 and rs.counters()["groups_started"] == 1  # its retry: nothing

    assert [rs.next_incarnation("g0") for _ in range(2)] == [1, 2] and rs.next_incarnation("g1") == 1
    assert rs.engine_record("g0") is None
    rs.set_engine_record("g0", {"host": "h", "pids": [[12, 3.5]], "segments": ["/dev/shm/psm_1"], "started": True})
    assert rs.engine_record("g0") == {"host": "h", "pids": [[12, 3.5]], "segments": ["/dev/shm/psm_1"], "started": True}
    rs.set_engine_record("g0", None)
    assert rs.engine_record("g0") is None
    q.close()


def test_admission_is_budgeted_by_the_weights_a_generator_really_holds(redis_url):
    """A generator whose engine lags the announced version (an elastic one still loading it) is
    budgeted at its own version: its groups would otherwise be trained past the bound and dropped."""
    q = RolloutQueue.connect(redis_url, "lagging")
    rs = RunState.of(q)
    rs.configure_admission(max_staleness=1, groups_per_step=2)
    rs.set_policy_version(3)  # budget (3 + 1 + 1) * 2 = 10 at the announced version
    rs.reset_admission(4)
    note = b"n"
    # Holding v0: budget (0 + 1 + 1) * 2 = 4, already spent by the other generators' 4 groups.
    assert rs.admit_prompt("elastic", "e1", note, weights_version=0) is False
    assert rs.inflight_prompts("elastic") == {} and rs.counters()["groups_started"] == 4
    # Holding v2: budget 8; the same call admits (and notes) it.
    assert rs.admit_prompt("elastic", "e1", note, weights_version=2) is True
    # A generator ahead of the announced version is still budgeted at the announced one (10).
    assert [rs.admit_prompt("gen-0", f"p{i}", note, weights_version=7) for i in range(6)] == [True] * 5 + [False]
    assert rs.counters()["groups_started"] == 10
    q.close()


def test_a_resumed_consumer_skips_the_groups_its_checkpoint_already_trained(redis_url):
    """A crash between a checkpoint and its ack leaves that checkpoint's entries pending: the
    resumed trainer (same consumer name) skips them (acked, counted as duplicates) and gets
    only the rest."""
    q = RolloutQueue.connect(redis_url, "skip")
    for i in range(6):
        q.put(small_group(f"g{i}"))
    assert [g.group_id for _, g in drain(q, 4)] == ["g0", "g1", "g2", "g3"]  # trained, checkpointed, not acked
    q.close()
    resumed = RolloutQueue.connect(redis_url, "skip")
    resumed.skip_groups(["g0", "g1", "g2"])  # what the checkpoint trained
    got = drain(resumed, 3)
    assert [g.group_id for _, g in got] == ["g3", "g4", "g5"]  # g3: trained after it, so again
    assert RunState.of(resumed).counters()["duplicates"] == 3
    resumed.ack([entry for entry, _ in got])
    assert resumed.pending() == 0 and resumed.depth() == 0 and resumed.queued_groups() == []
