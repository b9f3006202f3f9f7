"""The learner's CPU attention (asyncrl.learner.attention): per-sequence causal SDPA over a
packed row gives every sequence exactly what transformers' own SDPA gives its padded row
(log-probs and gradients, float64), for a GQA Llama, a Qwen2 with a sliding window and a
Gemma-2 (attention-logit soft-capping, against transformers' eager attention: SDPA has no
soft-cap); it computes one SDPA per sequence and refuses what it cannot honour.

    .venv/bin/python -m pytest tests/unit/test_varlen_attention.py -q
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from asyncrl.config.attention_rules import supports_varlen
from asyncrl.data import microbatch as mbatch
from asyncrl.learner import attention, fsdp
from asyncrl.learner.loss import token_logprobs
from asyncrl.learner.step import microbatch_logprobs
from tests.support import models

VOCAB = 29
LENGTHS = [7, 2, 11, 1, 5, 9]
CPU = torch.device("cpu")


def build(arch: str, attn: str):
    """A seeded float64 model of `arch` (2 layers, GQA); qwen2 with a 3-token sliding window;
    gemma2 with a soft-cap that bites (5, on q/k scaled up) and a 4-token window on layer 0."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    attention.register()
    common = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch.startswith("gemma2"):
        cap = None if arch == "gemma2-nocap" else 5.0
        config = Gemma2Config(**common, head_dim=4, query_pre_attn_scalar=4, sliding_window=4)
        config.attn_logit_softcapping, config.final_logit_softcapping = cap, None
        model = Gemma2ForCausalLM(config)
        with torch.no_grad():  # scores well past the cap, so that capping them changes the result
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(8.0)
                layer.self_attn.k_proj.weight.mul_(8.0)
    else:
        window = dict(use_sliding_window=True, sliding_window=3, max_window_layers=0) if arch == "qwen2-window" else {}
        model = Qwen2ForCausalLM(Qwen2Config(**common, **window))
    return model.to(torch.float64).train(False)


def sequences() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(1, VOCAB, n).astype(np.int64)} for n in LENGTHS]


def logprobs_and_grad(model, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] log-probs and the gradient of their sum over real tokens."""
    model.zero_grad()
    logp = microbatch_logprobs(model, mb, temperature=0.7, logprob_fn=token_logprobs, device=CPU)
    real = torch.arange(logp.shape[1]).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)
    (logp * real).sum().backward()
    return logp.detach() * real, torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2-window", "gemma2"])
def test_packed_varlen_equals_transformers_sdpa_on_padded_rows(arch):
    reference = build(arch, "eager" if arch == "gemma2" else "sdpa")
    varlen = build(arch, attention.VARLEN_SDPA)
    assert varlen.config._attn_implementation == attention.VARLEN_SDPA
    seqs = sequences()
    want, want_grad = logprobs_and_grad(reference, mbatch.collate(seqs, pad_token_id=0))
    assert want_grad.abs().max() > 1e-3
    for name, mb in (
        ("padded", mbatch.collate(seqs, pad_token_id=0)),
        ("packed", mbatch.collate_packed(seqs, pad_token_id=0)),
    ):
        got, grad = logprobs_and_grad(varlen, mb)
        assert (got - want).abs().max() <= 1e-12, name
        # Gemma-2's scores sit deep in tanh's flat tail (scaled q/k): rounding there is amplified.
        assert (grad - want_grad).norm() <= (1e-8 if arch == "gemma2" else 1e-10) * want_grad.norm(), name
    if arch == "qwen2-window":  # the window bites: without it every sequence longer than 3 changes
        no_window = build("qwen2", "sdpa")
        other, _ = logprobs_and_grad(no_window, mbatch.collate(seqs, pad_token_id=0))
        assert (other - want).abs().max() > 1e-3
    if arch == "gemma2":  # the cap bites: SDPA (which ignores it) and an uncapped model are off
        for off in (build("gemma2", "sdpa"), build("gemma2-nocap", "eager")):
            other, _ = logprobs_and_grad(off, mbatch.collate(seqs, pad_token_id=0))
            assert (other - want).abs().max() > 1e-4  # 8 orders of magnitude past the match above


def test_packed_rows_of_a_batch_each_keep_their_sequences_apart():
    """Rows of several sequences each (a batch of packed rows): every sequence as in its own row."""
    reference, varlen = build("llama", "sdpa"), build("llama", attention.VARLEN_SDPA)
    seqs = sequences()  # rows [7, 2, 1, 5] and [11, 9] (lengths add to 15 and 20)
    rows = [[0, 1, 3, 4], [2, 5]]
    ids = torch.zeros(2, 20, dtype=torch.int64)
    pos = torch.zeros(2, 20, dtype=torch.int64)
    for r, members in enumerate(rows):
        start = 0
        for k in members:
            n = LENGTHS[k]
            ids[r, start : start + n] = torch.from_numpy(seqs[k]["input_ids"])
            pos[r, start : start + n] = torch.arange(n)
            start += n
        pos[r, start:] = torch.arange(20 - start)  # the pad tail: a sequence of its own
    with torch.no_grad():
        got = varlen(input_ids=ids, position_ids=pos, use_cache=False).logits
        for r, members in enumerate(rows):
            start = 0
            for k in members:
                n = LENGTHS[k]
                own = reference(input_ids=ids[r : r + 1, start : start + n], use_cache=False).logits
                assert (got[r, start : start + n] - own[0]).abs().max() <= 1e-12
                start += n


def test_segments_cut_at_each_restart_and_one_sdpa_runs_per_sequence(monkeypatch):
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    assert attention.segments(pos, 1) == [[(0, 3), (3, 5), (5, 6), (6, 10)]]
    assert attention.segments(torch.arange(4).unsqueeze(0), 3) == [[(0, 4)]] * 3  # padded rows: one each
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(q, *args, **kw):
        calls.append(q.shape[2])
        return real(q, *args, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counting)
    varlen = build("llama", attention.VARLEN_SDPA)
    mb = mbatch.collate_packed(sequences(), pad_token_id=0)
    with torch.no_grad():
        varlen(input_ids=mb[mbatch.PACKED_IDS], position_ids=mb[mbatch.POSITION_IDS], use_cache=False)
    assert calls == LENGTHS * 2  # per layer, one call per sequence, of its own length: no pad, no cross terms


def test_unsupported_models_get_transformers_eager_and_the_forward_refuses_what_it_cannot_honour():
    assert fsdp.attention_implementation(CPU, "float32") == attention.VARLEN_SDPA
    assert models.tiny_llama(VOCAB).config._attn_implementation == attention.VARLEN_SDPA
    llama = build("llama", "sdpa").config
    assert supports_varlen(llama)
    assert supports_varlen(types.SimpleNamespace(attn_logit_softcapping=50.0))  # honoured (gemma2 above)
    for field, value in (("attention_chunk_size", 8192), ("is_causal", False)):
        config = types.SimpleNamespace(**{field: value})
        assert not supports_varlen(config), field
        # eager, never SDPA: SDPA drops what it has no parameter for (soft-caps, sinks) silently
        assert fsdp.attention_implementation(CPU, "float32", config) == "eager"
    module = build("llama", attention.VARLEN_SDPA).model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 4, dtype=torch.float64)
    kv = torch.zeros(1, 2, 3, 4, dtype=torch.float64)
    pos = torch.arange(3).unsqueeze(0)
    with pytest.raises(NotImplementedError, match="s_aux"):
        attention.varlen_sdpa_forward(module, q, kv, kv, None, s_aux=torch.zeros(4), position_ids=pos)
    with pytest.raises(NotImplementedError, match="attention mask"):
        attention.varlen_sdpa_forward(module, q, kv, kv, torch.ones(1, 1, 3, 3, dtype=torch.bool), position_ids=pos)
    with pytest.raises(ValueError, match="no position_ids"):
        attention.varlen_sdpa_forward(module, q, kv, kv, None)
