"""A sample's routed experts on the wire: which experts the engine sent each token to.

    wire = encode_routing(experts)                       # experts: uint8 [N, layers, k]
    experts = decode_routing(wire, rows=N, where="samples[0].routed_experts")

One row per position the engine ran forward for the sample (its prompt, then its response but
the last token, which no forward ever takes as input: the layout vLLM's
``enable_return_routed_experts`` returns), ``layers`` rows of the model's MoE layers, ``k``
expert indices each (the router's top-k). One byte per index: a model with more than 256
experts is refused at start-up (``check_expert_count``), so the compact form never wraps. A
Qwen3-30B-A3B position costs 48 layers x 8 = 384 bytes (its float32 log-prob: 4), over the
prompt as well as the response; the record size limit (queue.max_record_bytes) bounds it like
any other field.

Decoding trusts nothing (the bytes come from Redis): the map's fields, the dtype, a 3-D shape
that matches the byte count and the sample's row count; a failure is a RecordError whose reason
the queue dead-letters. The expert RANGE (index < the model's expert count) is checked where
the model is known: ``check_expert_range`` on the learner, before any forward.
"""

from __future__ import annotations

from typing import Any

import numpy as np

WIRE_DTYPE = "|u1"
MAX_EXPERTS = 256
"""The most experts an index of the wire form (one byte) can name."""
MAX_LAYERS = 4096
"""The most MoE layers a wire routing may declare: far past any model, and small enough that a
declared shape with zero positions never asks numpy for an impossible array."""
_FIELDS = {"dtype", "shape", "data"}


class RoutingError(ValueError):
    """A routing array that cannot be trusted; ``reason`` is the dead-letter word."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def check_expert_count(num_experts: int) -> None:
    """Refuse a model whose expert indices do not fit the one-byte wire form."""
    if not 0 < num_experts <= MAX_EXPERTS:
        raise ValueError(
            f"algo.routing_replay: the model has {num_experts} experts; routed experts travel as "
            f"one byte per index, for at most {MAX_EXPERTS}"
        )


REPLAY_MODEL_TYPE = "qwen3_moe"
"""The model family whose router the learner's replay patches (asyncrl.learner.routing_replay)."""


def check_replay_model(model: str, config: dict[str, Any] | None, context_parallel: int) -> None:
    """algo.routing_replay='rollout' at start-up (``asyncrl train`` and ``--check``, before the
    learners load): refuse a local model replay cannot serve (not Qwen3-MoE, or more experts
    than a byte names) and context parallelism; ``config`` is its config.json (None for a hub
    id, not read at start-up: the learner refuses it when it loads the model). ValueError."""
    if context_parallel > 1:
        raise ValueError(
            f"algo.routing_replay='rollout' with learner.context_parallel={context_parallel}: a context-parallel "
            "forward splits the packed row, which the replayed routing does not follow; use one or the other"
        )
    if config is None:
        return
    model_type = config.get("model_type")
    if model_type != REPLAY_MODEL_TYPE:
        raise ValueError(
            f"algo.routing_replay='rollout': rollout.model={model!r} is model_type {model_type!r}; routing "
            f"replay patches the Qwen3-MoE router ({REPLAY_MODEL_TYPE!r}) only (a dense model has none to replay)"
        )
    # transformers writes the count under either name (its attribute map); absent: the class's
    # default, checked by the learner once the model is built.
    experts = config.get("num_experts", config.get("num_local_experts"))
    if isinstance(experts, int) and not isinstance(experts, bool):
        check_expert_count(experts)


def encode_routing(experts: np.ndarray) -> dict[str, Any]:
    """uint8 [N, layers, k] -> {dtype, shape, data} (raw bytes, as the codec's other arrays)."""
    a = np.asarray(experts)
    if a.ndim != 3:
        raise ValueError(f"routed experts of shape {a.shape}, want [positions, layers, k]")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= MAX_EXPERTS):
        raise ValueError(f"routed experts outside [0, {MAX_EXPERTS}): one byte per index")
    a = np.ascontiguousarray(a, dtype=np.uint8)
    return {"dtype": WIRE_DTYPE, "shape": list(a.shape), "data": a.tobytes()}


def decode_routing(obj: Any, *, rows: int, where: str) -> np.ndarray:
    """The wire map -> uint8 [rows, layers, k]; raises RoutingError (bad_type, bad_dtype,
    bad_shape, length_mismatch)."""
    if not isinstance(obj, dict) or set(obj) != _FIELDS:
        raise RoutingError("bad_type", f"{where}: expected a map of {sorted(_FIELDS)}")
    if obj["dtype"] != WIRE_DTYPE:
        raise RoutingError("bad_dtype", f"{where}: dtype {obj['dtype']!r}, expected {WIRE_DTYPE!r}")
    shape = obj["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) != 3
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        or not 0 < shape[1] <= MAX_LAYERS
        or not 0 < shape[2] <= MAX_EXPERTS
    ):
        # Bounded here, not only by the byte count: [0, 2**40, 2**40] has zero bytes, and numpy
        # refuses to shape it with a ValueError the queue would not dead-letter.
        raise RoutingError(
            "bad_shape",
            f"{where}: shape {shape!r}, expected [positions, 0 < layers <= {MAX_LAYERS}, 0 < k <= {MAX_EXPERTS}]",
        )
    data = obj["data"]
    if not isinstance(data, bytes) or len(data) != shape[0] * shape[1] * shape[2]:
        raise RoutingError("bad_shape", f"{where}: {len(data) if isinstance(data, bytes) else 'no'} bytes for {shape}")
    if shape[0] != rows:
        raise RoutingError("length_mismatch", f"{where}: {shape[0]} positions, the sample has {rows}")
    return np.frombuffer(data, dtype=np.uint8).reshape(shape).copy()


def routed_rows(prompt_len: int, response_len: int) -> int:
    """Positions a sample's routing covers: its prompt and response but the last token."""
    return max(prompt_len + response_len - 1, 0)


def check_expert_range(experts: np.ndarray, num_experts: int, layers: int, k: int, where: str) -> None:
    """The learner's check, with the model known: the layer and top-k counts are the model's
    every index names one of its experts, and no position's top-k names an expert twice; raises
    RoutingError (bad_shape, expert_range, duplicate_expert)."""
    if experts.shape[1:] != (layers, k):
        raise RoutingError(
            "bad_shape", f"{where}: [.., {experts.shape[1]}, {experts.shape[2]}], model has [.., {layers}, {k}]"
        )
    if experts.size and int(experts.max()) >= num_experts:
        raise RoutingError("expert_range", f"{where}: expert {int(experts.max())} of a model with {num_experts}")
    # A router's top-k names k distinct experts; a repeat would run the token through one expert
    # twice with the weights renormalised over the repeat: a forward no engine ran, trained silently.
    ordered = np.sort(experts, axis=-1)
    repeats = np.argwhere((ordered[..., 1:] == ordered[..., :-1]).any(axis=-1))
    if repeats.size:
        pos, layer = (int(x) for x in repeats[0])
        raise RoutingError(
            "duplicate_expert",
            f"{where}: position {pos} layer {layer} names experts {experts[pos, layer].tolist()}",
        )
