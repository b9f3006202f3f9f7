"""A hostile writer during a real CPU demo job: a client holding the run's Redis password writes
malformed and hostile values into the run's keys for a bounded time (loopback, a bounded number
of rounds), then the run must finish, and so must a resume:

- records another tokenizer or a bug would make (an id past the vocabulary), versions from the
  future, the wrong group size, sequences past the engine's length, positive and NaN log-probs,
  oversize records, garbage bytes and entries without a record are each dead-lettered with their
  reason (every one of them, by its stream entry id) and never trained;
- garbage heartbeats (string and infinite versions, not msgpack) for the run's own generator and
  for strangers, garbage engine records and incarnation counts, unreadable in-flight notes and
  re-issue entries, garbage metrics records, and a rewritten state hash (policy version,
  admission bound, announced weights, status, start time, published config and its
  signature) are skipped or overwritten by the trainer: the trainer, its watchdog and the
  dashboard (polled throughout) keep going;
- the ledger of the real groups balances (queue.ledger=true) after the run and after the resume.

Also the counters hash: a count rewritten with text or past 64 bits restarts at 0 (admission
included, whose budget the trainer's drops and re-issues then bound). Not written: the
ledger's own sets (the produced and dropped ids are this test's instrument, not the run's
input). To cover a new key, add a writer to `ROUND`.
"""

from __future__ import annotations

import re
import time
import urllib.request

import msgpack
import numpy as np
import pytest
import redis

from asyncrl.data.codec import encode_group
from asyncrl.queue import RunState, keys
from asyncrl.queue.server import free_port
from asyncrl.types import RolloutGroup, Sample
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(900)
STEPS = 40
FLUSH_STEPS = 10
"""Steps trained after the writer stops: more than the queue's backlog, so every bad record is read."""
MAX_ROUNDS = 12
MAX_RECORD = 65536
TOKEN = "hostile-writer-token"


def _group(gid: str, *, ids=(3, 4, 5), version: int = 0, n: int = 4, logprob: float = -0.5) -> RolloutGroup:
    samples = [
        Sample(list(ids), [logprob] * len(ids), [1] * len(ids), 1.0, version, generator_id="gen-0") for _ in range(n)
    ]
    return RolloutGroup(gid, gid, [3, 4], samples, env="copy", metadata={"target": "abc"})


def _nan_logprob(gid: str) -> bytes:
    wire = msgpack.unpackb(encode_group(_group(gid)), raw=False)
    lp = wire["samples"][0]["rollout_logprobs"]
    lp["data"] = np.full(lp["shape"][0], np.nan, "<f4").tobytes()
    return msgpack.packb(wire, use_bin_type=True)


def _records(r: int) -> dict[str, tuple[dict, str]]:
    """Round r's bad stream entries: name -> (fields, the reason they must be dead-lettered with)."""
    gid = f"hostile-{r}"
    d = keys.RECORD_FIELD
    return {
        "oov": ({d: encode_group(_group(f"{gid}-oov", ids=(3, 10**6, 5)))}, "token_out_of_range"),
        "future": ({d: encode_group(_group(f"{gid}-future", version=10**6))}, "future_version"),
        "size": ({d: encode_group(_group(f"{gid}-size", n=3))}, "group_size"),
        "long": ({d: encode_group(_group(f"{gid}-long", ids=[3] * 200))}, "too_long"),
        "positive": ({d: encode_group(_group(f"{gid}-pos", logprob=2.0))}, "positive_logprob"),
        "nan": ({d: _nan_logprob(f"{gid}-nan")}, "nonfinite_logprob"),
        "oversize": ({d: encode_group(_group(f"{gid}-big", ids=[3] * 3000))}, "oversize"),
        "garbage": ({d: b"\xc1\x00garbage" * 50}, "bad_msgpack"),
        "no_record": ({b"x": b"1"}, "missing_field"),
    }


def _other_keys(c: redis.Redis, run: str, r: int) -> None:
    """Every other key of the run the test may write: garbage, or values that lie."""
    now = time.time()
    beats = {
        "gen-0": b"\xc1",
        "ghost-str": msgpack.packb({"version": "3", "heartbeat": now}),
        "ghost-inf": msgpack.packb({"version": float("inf"), "heartbeat": now, "tokens_per_s": float("nan")}),
        "ghost-list": msgpack.packb([1, 2, 3]),
    }
    c.hset(keys.generators(run), mapping=beats)
    pids = {"ghost": msgpack.packb({"host": "h", "pids": [["x", None]], "segments": ["/etc/passwd"]}), "gen-9": b"\xc1"}
    c.hset(keys.engine_pids(run), mapping=pids)
    c.set(keys.incarnation(run, "gen-9"), "not a count")
    c.hset(keys.inflight(run, "ghost"), mapping={"p": b"\xc1", "q": msgpack.packb([1])})
    c.rpush(keys.reissue(run), b"\xc1", msgpack.packb({"prompt_id": 7}), msgpack.packb([1, 2]))
    c.xadd(keys.metrics(run), {keys.RECORD_FIELD: b"\xc1"})
    c.xadd(keys.metrics(run), {keys.RECORD_FIELD: msgpack.packb({"step": float("inf"), "metrics": {"x": "y"}})})
    c.xadd(keys.deadletter(run), {b"junk": b"1"})
    c.hset(keys.counters(run), mapping={"groups_started": "many", "dropped_stale": "1e999", "duplicates": "9" * 30})
    c.sadd(keys.RUNS, f"ghost-{r}", "bad:run", "")
    c.hset(
        keys.state(run),
        mapping={
            "policy_version": "garbage",
            "max_staleness": "-",
            "groups_per_step": "inf",
            "weights_version": "1e999",
            "weights_location": "/nonexistent/v99.safetensors",
            "status": "\xff" * 3,
            "started_at": "nan",
            "config": "{" * 5000,
            "config_sig": "forged",
            "alert_rollout_kl": "inf",
        },
    )


def _dashboard_ok(port: int, run: str) -> None:
    paths = ("/api/runs", "/metrics", *(f"/api/run/{run}/{p}" for p in ("summary", "generators", "alerts", "series")))
    for path in paths:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200, path
            resp.read()


def test_a_hostile_writer_during_a_run_and_its_resume(train_job):
    port = free_port()
    job = train_job(
        "hostile-writer",
        f"control.total_steps={STEPS}",
        f"queue.max_record_bytes={MAX_RECORD}",
        "monitor.dashboard=true",
        f"monitor.dashboard_port={port}",
        f"monitor.dashboard_token={TOKEN}",
    )
    job.start()
    job.wait_for_step(2, timeout=500)
    run = job.run_name
    expected: dict[str, str] = {}  # stream entry id -> reason
    rounds, t0 = 0, time.monotonic()
    with job.client() as c:
        while rounds < MAX_ROUNDS and time.monotonic() - t0 < 30 and job.trainer_step() < STEPS - FLUSH_STEPS:
            for fields, reason in _records(rounds).values():
                expected[c.xadd(keys.rollouts(run), fields).decode()] = reason
            _other_keys(c, run, rounds)
            _dashboard_ok(port, run)
            rounds += 1
            time.sleep(0.5)
        print(f"hostile writer: {rounds} rounds, {len(expected)} bad records, until step {job.trainer_step()}")
        assert rounds >= 2

        def all_read() -> bool:  # each bad entry is deleted from the stream as it is dead-lettered
            return not job.running() or all(not c.xrange(keys.rollouts(run), i, i) for i in expected)

        wait_for(all_read, 300, "the trainer reading every bad record")
        _dashboard_ok(port, run)
    assert job.wait(600) == 0, job.log_tail()

    with job.observe() as q:
        dead = {e["source_id"]: e for e in q.deadletter_entries()}
    missing = sorted(set(expected) - set(dead))
    assert not missing, f"{len(missing)} bad records not dead-lettered, e.g. {missing[:3]}"
    wrong = {i: (dead[i]["reason"], want) for i, want in expected.items() if dead[i]["reason"] != want}
    assert not wrong, wrong
    log = job.log_tail(2_000_000)
    for reason in set(expected.values()):
        said = len(re.findall(rf"dead-lettered: {reason}\b", log))
        assert said == 1, (reason, said)  # logged once per reason, however many came
    summary = job.audit().check().summary
    print("ledger after the run:", summary)
    assert summary["trained"] == STEPS * 4 and summary["lost"] == 0
    assert not any(g.startswith("hostile-") for g in job.final_trained_ids())

    # Between the two trainers: what the resumed run's generator reads as it starts.
    with job.observe() as q:
        c = q.client
        c.hset(keys.engine_pids(run), "gen-0", msgpack.packb({"host": "h", "pids": [[1, 0.0]], "segments": ["/x"]}))
        c.set(keys.incarnation(run, "gen-0"), "not a count")
        c.hset(keys.inflight(run, "gen-0"), mapping={"hostile-note": b"\xc1", "hostile-list": msgpack.packb([1])})
        c.hset(keys.generators(run), "gen-0", msgpack.packb({"version": "x", "heartbeat": "y"}))
    job.resume(f"control.total_steps={STEPS + 3}")
    assert job.wait(600) == 0, job.log_tail()
    assert job.final_extra()["step"] == STEPS + 3
    summary = job.audit().check().summary
    print("ledger after the resume:", summary)
    assert summary["trained"] == (STEPS + 3) * 4 and summary["lost"] == 0
    with job.observe() as q:
        counters = RunState.of(q).counters()
    assert counters["notes_unreadable"] == 2, counters  # the predecessor's bad notes, their admission given back
