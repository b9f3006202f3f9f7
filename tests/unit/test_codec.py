"""The rollout-group codec: exact round trips, the wire layout, and every rejection reason.

.venv/bin/python -m pytest tests/unit/test_codec.py -q
"""

from __future__ import annotations

import pickle
import random

import msgpack
import numpy as np
import pytest

from asyncrl.data.codec import RecordError, decode_group, encode_group
from asyncrl.types import RolloutGroup, Sample


def full_group() -> RolloutGroup:
    s0 = Sample(
        response_ids=[5, 6, 7],
        rollout_logprobs=[-0.5, -1.25, 0.0],
        loss_mask=[1, 1, 0],
        reward=0.75,
        behavior_version=4,
        stop_reason="length",
        token_versions=[4, 5, 5],
        token_rewards=[0.0, 0.5, 0.25],
        generator_id="gen-1",
        timings={"generate_s": 0.125, "reward_s": 2},
        error=None,
        prompt_ids=[9, 8],
        trajectory_id=2,
        step_index=3,
    )
    s1 = Sample(
        response_ids=[],
        rollout_logprobs=[],
        loss_mask=[],
        reward=float("nan"),
        behavior_version=6,
        error="reward function raised ZeroDivisionError",
    )
    return RolloutGroup(
        group_id="g-1",
        prompt_id="p-7",
        prompt_ids=[1, 2, 3, 4],
        samples=[s0, s1],
        env="arith",
        metadata={"answer": "42", "tags": [1, 2.5, None, b"\x00"], "nested": {"k": True}},
    )


def record(group: RolloutGroup | None = None) -> dict:
    """The decoded msgpack map of a group, for building malformed variants."""
    return msgpack.unpackb(encode_group(group or full_group()), raw=False)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def reason_of(data: bytes, **kw) -> str:
    with pytest.raises(RecordError) as info:
        decode_group(data, **kw)
    return info.value.reason


def test_round_trip_every_field_and_dtype():
    g = full_group()
    back = decode_group(encode_group(g))
    assert (back.group_id, back.prompt_id, back.env, back.schema_version) == ("g-1", "p-7", "arith", 1)
    assert back.metadata == {"answer": "42", "tags": [1, 2.5, None, b"\x00"], "nested": {"k": True}}
    assert back.prompt_ids.dtype == np.int32 and back.prompt_ids.tolist() == [1, 2, 3, 4]
    a, b = back.samples
    assert a.response_ids.dtype == np.int32 and a.response_ids.tolist() == [5, 6, 7]
    assert a.rollout_logprobs.dtype == np.float32 and a.rollout_logprobs.tolist() == [-0.5, -1.25, 0.0]
    assert a.loss_mask.dtype == np.uint8 and a.loss_mask.tolist() == [1, 1, 0]
    assert a.token_versions.dtype == np.int32 and a.token_versions.tolist() == [4, 5, 5]
    assert a.token_rewards.dtype == np.float32 and a.token_rewards.tolist() == [0.0, 0.5, 0.25]
    assert a.prompt_ids.tolist() == [9, 8]
    assert (a.reward, a.behavior_version, a.stop_reason, a.generator_id) == (0.75, 4, "length", "gen-1")
    assert a.timings == {"generate_s": 0.125, "reward_s": 2.0} and isinstance(a.timings["reward_s"], float)
    assert (a.error, a.trajectory_id, a.step_index) == (None, 2, 3)
    assert b.num_tokens == 0 and b.token_versions is None and b.token_rewards is None and b.prompt_ids is None
    assert np.isnan(b.reward) and b.error == "reward function raised ZeroDivisionError"
    assert back.behavior_version == 4
    # Decoded arrays are ordinary writable arrays, not views of the message bytes.
    a.rollout_logprobs[2] = -3.0


def test_wire_layout_is_raw_little_endian_bytes():
    rec = record()
    assert rec["prompt_ids"] == {"dtype": "<i4", "shape": [4], "data": b"\x01\0\0\0\x02\0\0\0\x03\0\0\0\x04\0\0\0"}
    lp = rec["samples"][0]["rollout_logprobs"]
    # -0.5 = 0xBF000000, -1.25 = 0xBFA00000 as little-endian float32
    assert lp == {"dtype": "<f4", "shape": [3], "data": b"\0\0\0\xbf\0\0\xa0\xbf\0\0\0\0"}
    assert rec["samples"][0]["loss_mask"]["data"] == b"\x01\x01\x00"


def mutate_sample(field, value, i=0):
    rec = record()
    rec["samples"][i][field] = value
    return pack(rec)


@pytest.mark.parametrize(
    "data, reason",
    [
        (encode_group(full_group())[:-7], "bad_msgpack"),
        (b"\xc1\x00\x01", "bad_msgpack"),
        (pack([1, 2, 3]), "bad_type"),
        (pack({**record(), "schema": 2}), "unknown_schema"),
        (pack({**record(), "schema": True}), "unknown_schema"),
        (pack({k: v for k, v in record().items() if k != "group_id"}), "missing_field"),
        (pack({**record(), "extra": 1}), "unknown_field"),
        (pack({**record(), "samples": []}), "empty_group"),
        (pack({**record(), "group_id": 7}), "bad_type"),
        (mutate_sample("rollout_logprobs", {"dtype": "<f4", "shape": [2], "data": b"\0" * 8}), "length_mismatch"),
        (mutate_sample("token_versions", {"dtype": "<i4", "shape": [4], "data": b"\0" * 16}), "length_mismatch"),
        (mutate_sample("token_rewards", {"dtype": "<f4", "shape": [1], "data": b"\0" * 4}), "length_mismatch"),
        (mutate_sample("loss_mask", {"dtype": "|u1", "shape": [2], "data": b"\1\1"}), "length_mismatch"),
        (
            mutate_sample(
                "rollout_logprobs", {"dtype": "<f4", "shape": [3], "data": np.array([0, np.nan, 0], "<f4").tobytes()}
            ),
            "nonfinite_logprob",
        ),
        (
            mutate_sample(
                "rollout_logprobs", {"dtype": "<f4", "shape": [3], "data": np.array([0, 0, -np.inf], "<f4").tobytes()}
            ),
            "nonfinite_logprob",
        ),
        (mutate_sample("reward", float("inf")), "nonfinite_reward"),
        (mutate_sample("rollout_logprobs", {"dtype": "<f8", "shape": [3], "data": b"\0" * 24}), "bad_dtype"),
        (mutate_sample("response_ids", {"dtype": "O", "shape": [3], "data": b"\0" * 3}), "bad_dtype"),
        (mutate_sample("response_ids", {"dtype": "<i4", "shape": [3], "data": b"\0" * 11}), "bad_shape"),
        (mutate_sample("response_ids", {"dtype": "<i4", "shape": [3, 1], "data": b"\0" * 12}), "bad_shape"),
        (mutate_sample("loss_mask", {"dtype": "|u1", "shape": [3], "data": b"\1\2\0"}), "bad_mask"),
        (mutate_sample("behavior_version", True), "bad_type"),
        (mutate_sample("behavior_version", -1), "bad_type"),
        (mutate_sample("timings", {"t": "slow"}), "bad_type"),
        (mutate_sample("stop_reason", None), "bad_type"),
    ],
)
def test_rejections_carry_a_specific_reason(data, reason):
    assert reason_of(data) == reason


def test_oversize_is_rejected_before_parsing():
    data = encode_group(full_group())
    assert reason_of(data, max_bytes=len(data) - 1) == "oversize"
    assert decode_group(data, max_bytes=len(data)).group_id == "g-1"


def test_ext_types_and_non_string_keys_are_refused():
    rec = record()
    rec["metadata"] = {"x": msgpack.ExtType(42, b"payload")}
    assert reason_of(pack(rec)) == "ext_type"
    rec["metadata"] = {"when": msgpack.Timestamp(1, 0)}  # ext -1, decoded by msgpack itself
    assert reason_of(pack(rec)) == "bad_type"
    assert reason_of(pack({1: "int key"})) == "bad_msgpack"  # strict_map_key


class _Trap:
    """Unpickling this would create the marker file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_payload_is_rejected_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Trap(str(marker)))
    assert reason_of(payload) in {"bad_msgpack", "bad_type"}
    assert not marker.exists()


def test_fuzz_mutations_never_escape_as_other_exceptions():
    """2,000 random byte flips, truncations, insertions: decode succeeds or raises RecordError."""
    rng = random.Random(1234)
    base = encode_group(full_group())
    reasons: dict[str, int] = {}
    for _ in range(2000):
        data = bytearray(base)
        kind = rng.randrange(4)
        if kind == 0:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 1:
            data = data[: rng.randrange(len(data))]
        elif kind == 2:
            pos = rng.randrange(len(data))
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:
            data = bytearray(rng.randbytes(rng.randint(0, 300)))
        try:
            decode_group(bytes(data))
        except RecordError as e:
            reasons[e.reason] = reasons.get(e.reason, 0) + 1
    assert sum(reasons.values()) > 1500
    assert {"bad_msgpack", "bad_type"} <= reasons.keys()
