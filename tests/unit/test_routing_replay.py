"""Routing replay on the tiny Qwen3-MoE in transformers (the learner's model), single process:
replaying the model's own routing changes nothing, other experts change the log-probs and are
the ones used, and the router still gets a gradient."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.routing_replay import (
    install_routing_replay,
    learner_routing,
    mismatch_fraction,
    replay_weights,
    replayed_routing,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from asyncrl.rollout.tiny import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen3-moe")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).train(False)
    with torch.no_grad():  # a random router sits near uniform; sharpen it so top-k is decided
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
    assert install_routing_replay(model) == model.config.num_hidden_layers
    return model


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, use_cache=False).logits
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


IDS = torch.tensor([[5, 9, 13, 17, 21, 25, 29, 33], [6, 10, 14, 18, 22, 26, 30, 34]])


def test_own_routing_replayed_gives_identical_logprobs(moe):
    with torch.no_grad():
        free = _logprobs(moe, IDS)
        own = learner_routing(moe)
        assert own.shape == (IDS.numel(), moe.config.num_hidden_layers, moe.config.num_experts_per_tok)
        with replayed_routing(moe, own):
            replayed = _logprobs(moe, IDS)
    assert torch.equal(free, replayed)


def test_other_experts_are_used_and_change_logprobs(moe):
    with torch.no_grad():
        free = _logprobs(moe, IDS)
        own = learner_routing(moe)
        other = (own + 1) % moe.config.num_experts  # every token, every layer: a different pair
        with replayed_routing(moe, other):
            replayed = _logprobs(moe, IDS)
        # the routers still report their own choice, and it is not what was replayed
        assert mismatch_fraction(other, learner_routing(moe)) > 0
    assert (free - replayed).abs().max() > 1e-6
    # The same forward with the model's own router forced to `other`'s choice: equal to replay
    # (the replayed experts are the ones the experts module ran).
    with torch.no_grad(), replayed_routing(moe, other):
        again = _logprobs(moe, IDS)
    assert torch.equal(again, replayed)
    # Outside the block the model routes itself again.
    with torch.no_grad():
        assert torch.equal(_logprobs(moe, IDS), free)


def test_router_gets_gradient_under_replay(moe):
    with torch.no_grad():
        _logprobs(moe, IDS)
        other = (learner_routing(moe) + 1) % moe.config.num_experts
    moe.zero_grad(set_to_none=True)
    with replayed_routing(moe, other):
        _logprobs(moe, IDS).sum().backward()
    gates = [p.grad for n, p in moe.named_parameters() if n.endswith("mlp.gate.weight")]
    assert gates and all(g is not None and g.abs().sum() > 0 for g in gates)
    moe.zero_grad(set_to_none=True)


def test_wrong_shape_is_refused(moe):
    with (
        pytest.raises(ValueError, match="want \\[tokens, 2, k\\]"),
        replayed_routing(moe, torch.zeros(16, 3, 2, dtype=torch.long)),
    ):
        pass
    with (
        pytest.raises(ValueError, match="4 tokens of replayed experts for a forward of 16"),
        torch.no_grad(),
        replayed_routing(moe, torch.zeros(4, 2, 2, dtype=torch.long)),
    ):
        _logprobs(moe, IDS)


def test_dense_model_is_refused():
    from tests.support.models import tiny_llama

    with pytest.raises(ValueError, match="no Qwen3-MoE router"):
        install_routing_replay(tiny_llama(vocab_size=32).float())


def test_replay_weights_and_mismatch_math():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], requires_grad=True)
    probs = torch.softmax(logits.detach(), -1)[0]
    w = replay_weights(logits, torch.tensor([[0, 2]]), norm_topk_prob=False)
    assert torch.allclose(w[0], probs[[0, 2]])
    wn = replay_weights(logits, torch.tensor([[0, 2]]), norm_topk_prob=True)
    assert torch.allclose(wn.sum(), torch.tensor(1.0))
    wn.sum().backward()  # renormalised weights sum to 1: zero gradient in total, not None
    assert logits.grad is not None
    a = torch.tensor([[[0, 1]], [[2, 3]], [[1, 2]]])
    b = torch.tensor([[[1, 0]], [[2, 1]], [[1, 2]]])  # same set, differs, same
    assert mismatch_fraction(a, b).item() == pytest.approx(1 / 3)
    assert mismatch_fraction(a, b, valid=torch.tensor([False, True, True])).item() == pytest.approx(1 / 2)
    assert mismatch_fraction(a, b, valid=torch.zeros(3, dtype=torch.bool)).item() == 0


def test_forward_routing_layouts():
    from asyncrl.learner.routing_replay import forward_routing

    a = torch.full((2, 1, 2), 3)  # a 3-token sequence: its first 2 positions routed
    b = torch.full((3, 1, 2), 2)  # a 4-token sequence
    packed, routed = forward_routing([a, b], [3, 4], packed=True)
    assert packed.shape == (7, 1, 2)
    assert routed.tolist() == [True, True, False, True, True, True, False]
    assert packed[:, 0, 0].tolist() == [3, 3, 0, 2, 2, 2, 0]
    padded, routed = forward_routing([a, b], [3, 4], packed=False, width=5)
    assert padded.shape == (10, 1, 2)
    assert routed.tolist() == [True, True, False, False, False, True, True, True, False, False]
    assert padded[:, 0, 1].tolist() == [3, 3, 1, 1, 1, 2, 2, 2, 1, 1]
    with pytest.raises(ValueError, match="sequence 1 of 5 tokens"):
        forward_routing([a, b], [3, 5], packed=True)


def test_replay_in_padded_rows_equals_each_sequence_alone(moe):
    """Right-padded rows replay each sequence's positions as the sequence alone does."""
    from asyncrl.learner.routing_replay import forward_routing

    seqs = [IDS[0, :5], IDS[1, :7]]
    with torch.no_grad():
        routings = []
        for s in seqs:
            _logprobs(moe, s[None])
            routings.append((learner_routing(moe)[:-1] + 1) % moe.config.num_experts)
        padded_ids = torch.zeros(2, 7, dtype=torch.long)
        padded_ids[0, :5], padded_ids[1] = seqs[0], seqs[1]
        experts, _ = forward_routing(routings, [5, 7], packed=False, width=7)
        with replayed_routing(moe, experts):
            padded = _logprobs(moe, padded_ids)
        singles = []
        for s, r in zip(seqs, routings, strict=True):
            e, _ = forward_routing([r], [len(s)], packed=True)
            with replayed_routing(moe, e):
                singles.append(_logprobs(moe, s[None])[0])
    assert torch.allclose(padded[0, :4], singles[0], atol=1e-5)
    assert torch.allclose(padded[1], singles[1], atol=1e-5)


def test_replay_under_fsdp2_and_activation_checkpointing_matches_the_plain_model(moe, mesh):
    """The learner's own wrapping (fsdp.shard_model: FSDP2 on a one-rank gloo group, every
    block checkpointed): the patched routers survive it, and the backward's recomputation
    replays too, so the gradients equal the unwrapped model's under the same replay."""
    import copy

    from asyncrl.learner import fsdp

    with torch.no_grad():
        _logprobs(moe, IDS)
        other = (learner_routing(moe) + 1) % moe.config.num_experts
    sharded = fsdp.shard_model(copy.deepcopy(moe), mesh, None, activation_checkpointing=True)
    assert install_routing_replay(sharded) == moe.config.num_hidden_layers
    grads = []
    for model in (moe, sharded):
        model.zero_grad(set_to_none=True)
        with replayed_routing(model, other):
            _logprobs(model, IDS).sum().backward()
        grads.append(
            torch.cat(
                [
                    (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten()
                    for p in model.parameters()
                ]
            )
        )
    moe.zero_grad(set_to_none=True)
    assert grads[0].abs().max() > 1e-4
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
