"""Activation checkpointing (learner.activation_checkpointing) changes memory, not gradients:
a tiny float64 Llama sharded by the learner's own fsdp.shard_model (FSDP2 on a one-rank gloo
group), with and without checkpointed blocks, run through the learner's forward on packed and
padded micro-batches, gives the same gradient, and every decoder block really recomputes.

    .venv/bin/python -m pytest tests/unit/test_activation_checkpointing.py -q
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from asyncrl.learner import fsdp
from asyncrl.learner.loss import microbatch_loss
from asyncrl.learner.step import forward_logits
from tests.support import models
from tests.unit.test_grad_invariance import TEMP, VOCAB, algo_for, full_batch, make_groups, packed, rel_diff


def tiny_llama():
    return models.tiny_llama(VOCAB, num_hidden_layers=3)


def grad(model, algo, micro: list[dict]) -> torch.Tensor:
    model.zero_grad()
    for mb in micro:
        loss, _ = microbatch_loss(forward_logits(model, mb), mb, algo, temperature=TEMP, num_microbatches=len(micro))
        loss.backward()
    return torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])


def test_checkpointed_blocks_give_the_same_gradient_and_recompute(mesh):
    base = tiny_llama()
    plain = fsdp.shard_model(copy.deepcopy(base), mesh, None)
    ac = fsdp.shard_model(copy.deepcopy(base), mesh, None, activation_checkpointing=True)
    blocks = list(ac.model.layers)  # after fully_shard their class is FSDPLlamaDecoderLayer
    assert len(blocks) == 3
    assert all(isinstance(b.forward, fsdp.CheckpointedForward) for b in blocks)
    assert not any(isinstance(b.forward, fsdp.CheckpointedForward) for b in plain.model.layers)
    # Parameter names stay Hugging Face's (what vLLM, DCP and the export read).
    assert [n for n, _ in ac.named_parameters()] == [n for n, _ in base.named_parameters()]

    # A pre-hook: the recompute stops as soon as it has every tensor the backward needs, before
    # the block's last module returns, so a post-forward hook would not see it.
    calls = {"plain": 0, "ac": 0}
    for name, model in (("plain", plain), ("ac", ac)):
        for b in model.model.layers:
            b.mlp.register_forward_pre_hook(lambda *_, k=name: calls.__setitem__(k, calls[k] + 1))

    algo = algo_for("kl_ref", "token_mean")
    algo = algo.model_copy(update={"entropy_coef": 0.05})
    mb = full_batch(make_groups(np.random.default_rng(0)), algo, "policy")
    n = mb["input_ids"].shape[0]
    for micro in ([mb], [packed(mb, range(n)), packed(mb, [0])]):
        calls.update(plain=0, ac=0)
        want, got = grad(plain, algo, micro), grad(ac, algo, micro)
        assert want.abs().max() > 1e-3
        assert rel_diff(got, want) <= 1e-6
        # Each block's forward ran again in the backward pass: twice the calls.
        assert calls["ac"] == 2 * calls["plain"] > 0, calls


def test_checkpoint_blocks_is_idempotent():
    """Wrapping twice does not nest two recomputes."""
    model = tiny_llama()
    blocks = fsdp.decoder_blocks(model)
    fsdp.checkpoint_blocks(blocks)
    inner = [b.forward.inner for b in blocks]
    fsdp.checkpoint_blocks(blocks)
    assert [b.forward.inner for b in blocks] == inner
