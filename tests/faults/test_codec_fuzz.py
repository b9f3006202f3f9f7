"""10,000+ hostile records through the real queue consumer: every one that the codec rejects is
dead-lettered with the reason the codec gives it, nothing crashes, and the consumer goes on
serving good records (interleaved ones, and a fresh one put afterwards).

    .venv/bin/python -m pytest tests/faults/test_codec_fuzz.py -q

Mutations: byte flips, truncations, random bytes, pickles, and structure-aware ones made on
the decoded wire map (wrong types, NaN/inf logprobs, length/shape lies, unknown schema and
fields, ext types, deep nesting, empty groups), plus stream entries without a record field.
Writes are pipelined in chunks, so the whole test takes a few seconds.
"""

from __future__ import annotations

import math
import pickle
import random
import time

import msgpack
import pytest
import redis

from asyncrl.data.codec import RecordError, decode_group, encode_group
from asyncrl.queue import RolloutQueue, RunState, keys
from asyncrl.types import RolloutGroup, Sample

N_BAD = 10_000
GOOD_EVERY = 25


def _group(gid: str, n_samples: int = 2, length: int = 5) -> RolloutGroup:
    samples = [
        Sample(list(range(3, 3 + length)), [-0.1 * (k + 1)] * length, [1] * length, float(k), 0, generator_id="g0")
        for k in range(n_samples)
    ]
    return RolloutGroup(gid, f"p-{gid}", [1, 2, 3], samples, env="copy", metadata={"target": "abc"})


def _structural(rng: random.Random, gid: str) -> tuple[dict | bytes, str]:
    """A wire map (or raw bytes) with one deliberate lie; returns it with a label for failures."""
    wire = msgpack.unpackb(encode_group(_group(gid, rng.randint(1, 3), rng.randint(1, 9))), raw=False)
    s = wire["samples"][0]
    kind = rng.randrange(16)
    if kind == 0:
        s["rollout_logprobs"]["data"] = b"\x00\x00\xc0\x7f" * s["rollout_logprobs"]["shape"][0]
    elif kind == 1:
        s["rollout_logprobs"]["data"] = b"\x00\x00\x80\x7f" * s["rollout_logprobs"]["shape"][0]  # +inf
    elif kind == 2:
        s["response_ids"]["shape"] = [s["response_ids"]["shape"][0] + rng.randint(1, 5)]
    elif kind == 3:
        n = s["loss_mask"]["shape"][0] + 1  # a well-formed array, one token longer than the response
        s["loss_mask"] = {"dtype": "|u1", "shape": [n], "data": b"\x01" * n}
    elif kind == 4:
        wire["schema"] = rng.choice([0, 2, 99, "1", None])
    elif kind == 5:
        wire[rng.choice(["__reduce__", "extra", "x" * 40])] = 1
    elif kind == 6:
        del wire[rng.choice(["group_id", "samples", "prompt_ids", "schema"])]
    elif kind == 7:
        wire["group_id"] = rng.choice([1, None, b"bytes", ["list"], {"a": 1}])
    elif kind == 8:
        s["reward"] = rng.choice(["1.0", None, [1.0], math.nan, math.inf])
    elif kind == 9:
        s["rollout_logprobs"]["dtype"] = rng.choice(["<f8", "O", "|V4", ">f4", "float32", ""])
    elif kind == 10:
        wire["samples"] = []
    elif kind == 11:
        s["behavior_version"] = rng.choice([-1, 1.5, "3", None, 2**63 + 5])
    elif kind == 12:
        nested: object = 1
        for _ in range(rng.randint(40, 200)):
            nested = [nested]
        wire["metadata"] = {"deep": nested}
    elif kind == 13:
        return msgpack.packb(msgpack.ExtType(rng.randint(0, 127), b"\x00" * 8)), "ext_type"
    elif kind == 14:
        s["loss_mask"]["data"] = bytes([rng.randint(2, 255)]) * s["loss_mask"]["shape"][0]
    else:
        s["response_ids"]["shape"] = [-1] if rng.random() < 0.5 else [2, 2]
    return wire, f"structural-{kind}"


class _Evil:
    def __reduce__(self):
        return (print, ("unpickled!",))


def _bad_record(rng: random.Random, i: int, base: bytes) -> bytes | None:
    """The i-th hostile record (None: a stream entry with no record field at all)."""
    kind = i % 6
    if kind == 0:
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if kind == 1:
        return base[: rng.randrange(len(base))]
    if kind == 2:
        return rng.randbytes(rng.randint(0, 300))
    if kind == 3:
        return pickle.dumps(rng.choice([_Evil(), {"group_id": f"pk-{i}"}, [1, 2, 3]]), protocol=rng.randint(0, 5))
    if kind == 4 and i % 60 == 4:
        return None
    wire, _ = _structural(rng, f"s-{i}")
    return wire if isinstance(wire, bytes) else msgpack.packb(wire, use_bin_type=True)


def test_10k_hostile_records_are_dead_lettered_and_the_consumer_keeps_serving(redis_url):
    run = "fuzz10k"
    q = RolloutQueue.connect(redis_url, run, max_record_bytes=1 << 16)
    rs = RunState.of(q)
    raw = redis.Redis.from_url(redis_url)
    rng = random.Random(2026)
    base = encode_group(_group("base", 3, 7))
    expected_reasons: list[str] = []
    expected_served: list[str] = []
    pipe = raw.pipeline(transaction=False)
    t0 = time.perf_counter()
    for i in range(N_BAD):
        data = _bad_record(rng, i, base)
        if data is None:
            pipe.xadd(keys.rollouts(run), {b"other": b"x"})
            expected_reasons.append("missing_field")
        else:
            try:
                expected_served.append(decode_group(data, max_bytes=1 << 16).group_id)  # still valid
            except RecordError as e:
                expected_reasons.append(e.reason)
            pipe.xadd(keys.rollouts(run), {keys.RECORD_FIELD: data})
        if i % GOOD_EVERY == 0:
            pipe.xadd(keys.rollouts(run), {keys.RECORD_FIELD: encode_group(_group(f"good-{i}"))})
            expected_served.append(f"good-{i}")
        if len(pipe) >= 1000:
            pipe.execute()
    pipe.execute()
    t_write = time.perf_counter() - t0

    unique = list(dict.fromkeys(expected_served))  # valid mutants of "base" share its id: served once
    got: list = []
    deadline = time.monotonic() + 120
    while len(got) < len(unique) and time.monotonic() < deadline:
        batch = q.get_batch(64, min_version=0, timeout=0.5)
        q.ack([entry for entry, _ in batch])
        got += batch
    t_read = time.perf_counter() - t0 - t_write
    print(
        f"{N_BAD} hostile + {N_BAD // GOOD_EVERY} good records: written in {t_write:.1f}s, "
        f"consumed in {t_read:.1f}s; reasons {sorted(set(expected_reasons))}"
    )

    assert [g.group_id for _, g in got] == unique
    assert q.get_batch(1, 0, timeout=0.2) == []
    assert len(expected_reasons) >= 0.95 * N_BAD
    dead = q.deadletter_entries()
    assert [e["reason"] for e in dead] == expected_reasons
    assert all(e["source_id"] for e in dead)
    assert rs.counters()["dead_lettered"] == len(expected_reasons)
    # Every reason the codec documents for these mutations shows up.
    assert {
        "bad_msgpack",
        "ext_type",
        "unknown_schema",
        "missing_field",
        "unknown_field",
        "bad_type",
        "bad_dtype",
        "bad_shape",
        "length_mismatch",
        "nonfinite_logprob",
        "empty_group",
        "bad_mask",
    } <= set(expected_reasons)
    assert raw.xlen(keys.rollouts(run)) == 0  # everything acked or dead-lettered

    # Still alive: a good record put now is served.
    q.put(_group("after-the-storm"))
    ((entry, group),) = q.get_batch(1, min_version=0, timeout=5.0)
    assert group.group_id == "after-the-storm" and group.samples[0].reward == 0.0
    q.ack([entry])
    q.close()
    raw.close()


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps(_Evil()),
        b"cos\nsystem\n(S'true'\ntR.",
        pickle.dumps({"group_id": "g", "samples": []}),
    ],
)
def test_pickles_are_bad_msgpack_and_never_unpickled(payload, capsys):
    with pytest.raises(RecordError) as e:
        decode_group(payload)
    assert e.value.reason in ("bad_msgpack", "bad_type", "unknown_schema", "ext_type")
    assert "unpickled!" not in capsys.readouterr().out
