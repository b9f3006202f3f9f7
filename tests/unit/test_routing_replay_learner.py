"""Routing replay through the learner's own path: rollout records of the tiny Qwen3-MoE (their
routed experts on the wire), the driver's batch assembly, a learner rank's micro-batches (packed
and padded), its proximal log-prob pass and its training step, on a one-rank gloo FSDP2 group.

Replaying the model's own routing gives the log-probs of the run without replay and
router/mismatch_frac 0; other experts change the log-probs and the metric says how many differ;
a routing that names an expert the model does not have is refused (that micro-batch routes
itself), not a crash."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from asyncrl.config import load_config
from asyncrl.data.batch import build_minibatches
from asyncrl.data.codec import decode_group, encode_group
from asyncrl.data.microbatch import seq_fields
from asyncrl.learner import fsdp, loss, optim
from asyncrl.learner.actor import LearnerActor
from asyncrl.learner.group import FIELD_DTYPES
from asyncrl.learner.routing_replay import learner_routing, setup_replay
from asyncrl.types import RolloutGroup, Sample

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PROMPT = np.array([3, 7, 11, 15], dtype=np.int32)
RESPONSES = [np.array([5, 9, 13, 17, 21], dtype=np.int32), np.array([6, 10, 14], dtype=np.int32)]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    """The tiny Qwen3-MoE with sharpened routers (a random router sits near uniform, where a
    top-k could flip between two equal forwards' rounding)."""
    from transformers import AutoModelForCausalLM

    from asyncrl.rollout.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("moe")
    path = write_tiny_model(root / "base", arch="qwen3-moe")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(root / "sharp"))
    for f in path.iterdir():  # the tokenizer files
        if not (root / "sharp" / f.name).exists():
            (root / "sharp" / f.name).write_bytes(f.read_bytes())
    return str(root / "sharp")


def _learner(path: str, mesh, overrides: list[str]) -> LearnerActor:
    """A learner rank as LearnerActor.setup builds it, on the `mesh` fixture's group."""
    cfg = load_config(None, [f"rollout.model={path}", "control.total_steps=4", "learner.lr=1e-2", *overrides])
    actor = LearnerActor(cfg, path, rank=0, world_size=1, sample_special_tokens=True)
    actor.device = torch.device("cpu")
    actor.model = fsdp.load_sharded_model(path, mesh, device=actor.device, dtype="float32")
    if cfg.algo.routing_replay == "rollout":
        setup_replay(actor.model, context_parallel=cfg.learner.context_parallel)
    actor.optimizer = optim.build_optimizer(actor.model.parameters(), cfg.learner)
    actor.scheduler = optim.build_scheduler(actor.optimizer, cfg.learner, total_steps=cfg.control.total_steps)
    actor.sampling = loss.Sampling.of(cfg.rollout)
    actor.logprob_fn = actor.sampling.logprob_fn()
    actor.disallowed = None
    actor.reference = None
    actor.pad_token_id = 0
    return actor


def _own_routing(actor: LearnerActor, response: np.ndarray) -> np.ndarray:
    """What a CUDA engine with the learner's weights returns: each forwarded position's experts."""
    ids = torch.as_tensor(np.concatenate([PROMPT, response]).astype(np.int64))[None]
    with torch.no_grad():
        actor.model(input_ids=ids, use_cache=False)
    return learner_routing(actor.model)[:-1].numpy().astype(np.uint8)


def _records(routings: list[np.ndarray | None]) -> RolloutGroup:
    samples = [
        Sample(
            response_ids=r,
            rollout_logprobs=np.full(len(r), -1.0, np.float32),
            loss_mask=np.ones(len(r), np.uint8),
            reward=float(i == 0),
            behavior_version=0,
            routed_experts=routed,
        )
        for i, (r, routed) in enumerate(zip(RESPONSES, routings, strict=True))
    ]
    group = RolloutGroup(group_id="g0", prompt_id="p0", prompt_ids=PROMPT, samples=samples)
    return decode_group(encode_group(group))  # through the wire, validated as the learner reads it


def _plan(actor: LearnerActor, group: RolloutGroup) -> list[list[dict[str, Any]]]:
    (minibatch,), _ = build_minibatches([group], actor.cfg.algo, num_minibatches=1)
    return [[seq_fields(s) for s in minibatch]]


def _proximal(actor: LearnerActor, plan: list[list[dict[str, Any]]]) -> torch.Tensor:
    actor.store_proximal(0, plan, 1, dict(FIELD_DTYPES))
    return actor._proximal.pop(0)[0]


@pytest.mark.parametrize("packing", [True, False])
def test_learner_replays_record_routing_in_both_passes(moe_path, mesh, packing):
    layout = f"learner.packing={str(packing).lower()}"
    plain = _learner(moe_path, mesh, [layout])
    replay = _learner(moe_path, mesh, [layout, "algo.routing_replay=rollout"])
    num_experts = replay.model.config.num_experts
    own = [_own_routing(replay, r) for r in RESPONSES]
    other = [((r.astype(np.int64) + 1) % num_experts).astype(np.uint8) for r in own]

    free = _proximal(plain, _plan(plain, _records([None, None])))
    with_own = _proximal(replay, _plan(replay, _records(own)))
    with_other = _proximal(replay, _plan(replay, _records(other)))
    # Real positions only: a padded row's padding routes to experts 0..k-1 (never read by a loss).
    live = torch.zeros_like(free, dtype=torch.bool)
    for b, r in enumerate(RESPONSES):
        live[b, 1 : len(PROMPT) + len(r)] = True
    torch.testing.assert_close(with_own[live], free[live], rtol=0, atol=1e-6)  # (a) own routing: nothing changes
    assert (with_other - free)[live].abs().max() > 1e-3  # (b) other experts: other log-probs
    # Without the replay setting the records' routing is dropped at batch assembly.
    assert _plan(plain, _records(own))[0][0].get("routed_experts") is None

    # (c) the training step reports the fraction of (scored token, layer) pairs routed otherwise.
    fields = dict(FIELD_DTYPES)
    step_own = replay.train_minibatch(_plan(replay, _records(own)), 1, fields)
    step_other = replay.train_minibatch(_plan(replay, _records(other)), 1, fields)
    step_plain = plain.train_minibatch(_plan(plain, _records([None, None])), 1, fields)
    pairs = sum(len(r) for r in RESPONSES) * replay.model.config.num_hidden_layers  # scored tokens x layers
    own_frac, other_frac = step_own.metrics["router/mismatch_frac"], step_other.metrics["router/mismatch_frac"]
    assert (own_frac.total, own_frac.count) == (0.0, pairs)
    # One update (lr 1e-2) moved the routers since `other` was drawn: most pairs, not all, still differ.
    assert other_frac.count == pairs and other_frac.total / other_frac.count > 0.5
    assert "router/mismatch_frac" not in step_plain.metrics  # a run without replay: no such metric


@pytest.mark.parametrize(
    "experts, says",
    [([200, None], "expert_range: micro-batch 0 sequence 1: expert 200"), ([1, 1], "duplicate_expert")],
)
def test_out_of_range_routing_is_refused_not_a_crash(moe_path, mesh, caplog, experts, says):
    """An expert index past the model's (the wire's byte allows up to 255), or a top-k naming one
    expert twice, is refused where the model is known; that micro-batch routes itself, the step
    runs, and the reason is logged."""
    replay = _learner(moe_path, mesh, ["algo.routing_replay=rollout"])
    plain_logp = _proximal(replay, _plan(replay, _records([None, None])))
    bad = [_own_routing(replay, r) for r in RESPONSES]
    bad[1][0, 0, : len(experts)] = [e if e is not None else bad[1][0, 0, i] for i, e in enumerate(experts)]
    with caplog.at_level("WARNING"):
        logp = _proximal(replay, _plan(replay, _records(bad)))
    torch.testing.assert_close(logp, plain_logp, rtol=0, atol=1e-6)
    assert says in caplog.text
    result = replay.train_minibatch(_plan(replay, _records(bad)), 1, dict(FIELD_DTYPES))
    assert "router/mismatch_frac" not in result.metrics


def test_replay_needs_every_sequence_routed_and_no_context_parallelism(moe_path, mesh, caplog):
    """A micro-batch replays only when each of its sequences has a routing (one without: the
    whole micro-batch routes itself, its fields as a dense model's, and the reason is logged
    once); context parallelism, whose forward splits the packed row, is refused at start-up."""
    from asyncrl.data.microbatch import ROUTED_EXPERTS, collate_packed
    from asyncrl.learner.routing_replay import REPLAY_EXPERTS, attach_replay

    replay = _learner(moe_path, mesh, ["algo.routing_replay=rollout"])
    own = _own_routing(replay, RESPONSES[0])
    both = _plan(replay, _records([own, _own_routing(replay, RESPONSES[1])]))[0]
    half = _plan(replay, _records([own, None]))[0]
    assert len(collate_packed(both, pad_token_id=0)[ROUTED_EXPERTS]) == 2
    routed = collate_packed(both, pad_token_id=0)
    assert attach_replay(replay.model, [routed]) == []
    assert routed[REPLAY_EXPERTS].dtype == torch.uint8  # one byte per index held per micro-batch, as on the wire
    mixed = collate_packed(half, pad_token_id=0)
    assert [r is None for r in mixed[ROUTED_EXPERTS]] == [False, True]
    logged: set[str] = set()
    dense = collate_packed([{k: v for k, v in s.items() if k != ROUTED_EXPERTS} for s in half], pad_token_id=0)
    unrouted = dict(dense)  # records with no routing at all (an engine that returned none): said too
    with caplog.at_level("WARNING"):
        refused = attach_replay(replay.model, [mixed, unrouted], logged=logged)
        attach_replay(replay.model, [collate_packed(half, pad_token_id=0)], logged=logged)
    assert refused == [
        "unrouted_sequence: micro-batch 0: 1 of its 2 sequences carry no routing",
        "unrouted_sequence: micro-batch 1: none of its sequences carries a routing",
    ]
    assert caplog.text.count("unrouted_sequence") == 1  # said once per reason, not per micro-batch or step
    assert REPLAY_EXPERTS not in mixed and mixed.keys() == dense.keys()
    assert all(torch.equal(mixed[k], dense[k]) for k in dense)
    with pytest.raises(ValueError, match="context_parallel"):
        setup_replay(replay.model, context_parallel=2)
