"""RolloutQueue under faults: dead consumers, a killed server, a wrong password.

    .venv/bin/python -m pytest tests/integration/test_queue_faults.py -q

Each test that kills or restarts a server starts its own EmbeddedRedis (never the session one).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import redis

from asyncrl.queue import QueueAuthError, QueueUnavailable, RolloutQueue, RunState, keys
from asyncrl.queue.runstate import RUN_COUNTERS
from asyncrl.queue.server import EmbeddedRedis
from asyncrl.types import RolloutGroup, Sample
from tests.support.waiting import wait_for

CLAIM_IDLE_S = 1.0


def group(group_id: str, version: int = 0) -> RolloutGroup:
    return RolloutGroup(group_id, "p", [1, 2, 3], [Sample([4, 5], [-0.75, -0.125], [1, 1], 0.5, version)])


def test_consumer_dropped_without_ack_same_name_gets_exactly_those_back(redis_url):
    producer = RolloutQueue.connect(redis_url, "crash1")
    for i in range(10):
        producer.put(group(f"g{i}"))
    first = RolloutQueue.connect(redis_url, "crash1", consumer="learner-0")
    taken = first.get_batch(4, 0, timeout=1.0)
    first.close()  # "dies": the client is dropped, nothing acked

    again = RolloutQueue.connect(redis_url, "crash1", consumer="learner-0")
    redelivered = again.get_batch(4, 0, timeout=1.0)
    assert [(i, g.group_id) for i, g in redelivered] == [(i, g.group_id) for i, g in taken]
    rest = again.get_batch(10, 0, timeout=0.3)
    assert [g.group_id for _, g in rest] == [f"g{i}" for i in range(4, 10)]
    assert again.get_batch(1, 0, timeout=0.1) == []  # own pending is re-read once, not each call
    assert again.pending() == 10
    producer.close()
    again.close()


_DOOMED_CONSUMER = textwrap.dedent("""
    import json, sys, time
    from asyncrl.queue import RolloutQueue
    q = RolloutQueue.connect(sys.argv[1], "crash2", consumer="learner-doomed")
    items = q.get_batch(5, 0, timeout=5.0)
    print(json.dumps([entry_id for entry_id, _ in items]), flush=True)
    time.sleep(600)  # SIGKILLed here, holding un-acked entries
""")


def test_sigkilled_consumer_entries_are_claimed_by_a_new_consumer(redis_url):
    producer = RolloutQueue.connect(redis_url, "crash2")
    ids = [producer.put(group(f"g{i}")) for i in range(8)]
    proc = subprocess.Popen([sys.executable, "-c", _DOOMED_CONSUMER, redis_url], stdout=subprocess.PIPE, text=True)
    try:
        held = json.loads(proc.stdout.readline())
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert held == ids[:5]

    # claim_idle_s is short here; in training it must exceed the checkpoint interval
    heir = RolloutQueue.connect(redis_url, "crash2", consumer="learner-1", claim_idle_s=CLAIM_IDLE_S)
    # The held entries' idle clock (Redis's) restarts now, not at the dead consumer's read, which a
    # busy machine can leave a long way behind: XCLAIM to their own consumer with IDLE 0, which
    # neither moves them nor counts a delivery.
    stream = keys.rollouts("crash2")
    t0 = time.monotonic()
    heir.client.xclaim(stream, keys.CONSUMER_GROUP, "learner-doomed", 0, held, idle=0, justid=True)
    new_first = heir.get_batch(3, 0, timeout=1.0)
    assert [i for i, _ in new_first] == ids[5:]  # nothing is idle long enough to claim yet
    idle_ms = [
        p["time_since_delivered"]
        for p in heir.client.xpending_range(stream, keys.CONSUMER_GROUP, "-", "+", 10, "learner-doomed")
    ]
    assert max(idle_ms) < CLAIM_IDLE_S * 1000, f"the check above ran after the entries were claimable: {idle_ms}"
    claimed = wait_for(lambda: heir.get_batch(5, 0, timeout=0.2), 30, "the dead consumer's entries claimed")
    assert time.monotonic() - t0 >= CLAIM_IDLE_S  # not before they were idle that long
    assert sorted(i for i, _ in claimed) == held
    assert heir.get_batch(1, 0, timeout=0.5) == []  # its own held entries are never re-claimed to itself
    assert heir.ack(ids) == 8 and heir.pending() == 0
    producer.close()
    heir.close()


def test_unacked_records_survive_sigkill_of_an_aof_server(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis", aof=True).start()
    try:
        assert "appendfsync always" in (server.dir / "redis.conf").read_text().splitlines()
        q = RolloutQueue.connect(server.url, "aof", retry_deadline_s=20.0)
        rs = RunState.of(q)
        ids = [q.put(group(f"g{i}", version=i)) for i in range(12)]
        taken = q.get_batch(5, 0, timeout=1.0)
        q.ack([taken[0][0]])  # one acked: it must stay gone
        rs.set_policy_version(3)
        old_pid, port = server.pid, server.port
        server.kill()  # SIGKILL: no shutdown, no final flush
        server.start()
        assert server.pid != old_pid and server.port == port

        # the old client reconnects through the retry wrapper; a fresh consumer gets the rest
        assert rs.policy_version() == 3 and rs.counters()["groups_produced"] == 12
        heir = RolloutQueue.connect(server.url, "aof")
        got = heir.get_batch(20, 0, timeout=1.0)
        assert [i for i, _ in got] == ids[1:]
        assert [g.behavior_version for _, g in got] == list(range(1, 12))

        server.restart()  # graceful SIGTERM + start, same port and dir
        assert RolloutQueue.connect(server.url, "aof").pending() == 11
    finally:
        server.stop()


def test_retry_gives_up_with_a_clear_error_when_the_server_is_gone(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis").start()
    q = RolloutQueue.connect(server.url, "gone", retry_deadline_s=0.5)
    server.stop()
    with pytest.raises(QueueUnavailable, match=f"127.0.0.1:{server.port}.*unreachable"):
        q.depth()


def test_wrong_or_missing_password_names_the_url_without_the_password(tmp_path):
    with EmbeddedRedis(tmp_path / "redis", password="s3cret-pw") as server:
        assert server.url == f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
        safe = f"redis://127.0.0.1:{server.port}/0"
        with pytest.raises(QueueAuthError) as info:
            RolloutQueue.connect(f"redis://:hunter2@127.0.0.1:{server.port}/0", "pw")
        assert safe in str(info.value) and "hunter2" not in str(info.value)
        with pytest.raises(QueueAuthError, match=safe.replace(".", r"\.")):
            RolloutQueue.connect(safe, "pw")
        with pytest.raises(QueueAuthError) as info:
            RolloutQueue.connect(safe, "pw", password="wrong-one")
        assert "wrong-one" not in str(info.value)
        ok = RolloutQueue.connect(safe, "pw", password="s3cret-pw")
        assert ok.depth() == 0
        ok.close()
    with pytest.raises(ValueError, match="must start with redis://"):
        RolloutQueue.connect("http://:pw@127.0.0.1:1/0", "pw")


def test_calls_ride_out_a_restart_longer_than_redis_py_own_retries(tmp_path):
    """redis-py's built-in retry is off (open_client): every call retries in our Retrier, up
    to queue.retry_deadline_s, so an outage of several seconds is ridden out by each kind of
    call, and a call whose reply was lost is repaired, not silently re-sent."""
    import threading

    from asyncrl.queue.connection import open_client

    server = EmbeddedRedis(tmp_path / "redis", aof=True).start()
    try:
        q = RolloutQueue.connect(server.url, "outage", retry_deadline_s=30.0)
        rs = RunState.of(q)
        rs.configure_admission(max_staleness=0, groups_per_step=4)
        server.kill()
        t0 = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            open_client(server.url).ping()  # a bare client fails at once: no hidden retries
        assert time.monotonic() - t0 < 1.0
        back = threading.Timer(4.0, server.start)  # longer than redis-py's ~2 s of own retries
        back.start()
        assert rs.admit_prompt("g0", "p1", b"note") is True
        assert time.monotonic() - t0 > 3.5
        q.put(RolloutGroup("p1", "p1", [1], [Sample([2], [-0.5], [1], 1.0, 0)]), inflight_of="g0")
        assert rs.counters() == {**dict.fromkeys(RUN_COUNTERS, 0), "groups_started": 1, "groups_produced": 1}
        assert rs.inflight_prompts("g0") == {} and rs.next_incarnation("g0") == 1
        back.join()
    finally:
        server.stop()


def test_an_outage_past_the_retry_deadline_is_waited_out_and_only_an_outage_deadline_ends_it(tmp_path, caplog):
    """Past queue.retry_deadline_s a call no longer fails: it waits (one line a minute, the
    first at the retry deadline) and returns once Redis is back. With an outage deadline it
    raises QueueUnavailable naming that field."""
    import logging
    import threading

    caplog.set_level(logging.WARNING, logger="asyncrl.queue")
    server = EmbeddedRedis(tmp_path / "redis", aof=True).start()
    try:
        q = RolloutQueue.connect(server.url, "pause", retry_deadline_s=0.5, outage_deadline_s=None)
        rs = RunState.of(q)
        q.put(group("g0"))
        server.kill()
        t0 = time.monotonic()
        back = threading.Timer(3.0, server.start)  # six times the retry deadline
        back.start()
        assert q.depth() == 1 and rs.counters()["groups_produced"] == 1
        assert time.monotonic() - t0 > 2.5
        assert rs.retry.recovered_at > 0  # the watchdog counts heartbeat ages from here
        back.join()
        waiting = [r.getMessage() for r in caplog.records if "unreachable for" in r.getMessage()]
        assert len(waiting) == 1, waiting  # not one line per retry
        url = rf"redis://127\.0\.0\.1:{server.port}/0"
        assert re.fullmatch(
            rf"redis at {url} unreachable for \d+s; waiting \(queue\.outage_deadline_s=none\)", waiting[0]
        ), waiting[0]
        assert any("is back after" in r.getMessage() for r in caplog.records)

        limited = RolloutQueue.connect(server.url, "pause", retry_deadline_s=0.5, outage_deadline_s=1.5)
        server.kill()
        t0 = time.monotonic()
        with pytest.raises(
            QueueUnavailable, match=r"unreachable after \d+ attempts over \d+(\.\d)?s.*outage_deadline_s=1\.5"
        ):
            limited.depth()
        assert 1.0 < time.monotonic() - t0 < 4.0
    finally:
        server.stop()
