"""NCCL weight sync (vLLM weight-transfer API) from this process to a GeneratorActor's engine on GPU.

.venv/bin/python -m pytest tests/gpu/test_nccl_sync.py -q     # skipped without CUDA
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_nccl_publish_switches_engine_weights_and_version(tiny_model_dir, redis_server):
    from transformers import AutoModelForCausalLM

    from asyncrl.config import Config
    from asyncrl.rollout.generator import GeneratorActor
    from asyncrl.sync import build_weight_sync

    cfg = Config()
    cfg.sync.backend = "nccl"  # engine_args gives the engine vLLM's nccl weight transfer by itself
    gen = GeneratorActor(cfg, tiny_model_dir, "gpu-0", redis_server.url, "gpu", autostart=False)
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        state = {k: v + 0.01 for k, v in model.state_dict().items()}
        sync = build_weight_sync(cfg.sync, run="gpu", engines=[gen])
        info = sync.publish(state, version=1)
        assert gen.engine.weight_transfer == "nccl"
        assert (info.errors, info.fallbacks) == ((), 0) and gen.version() == 1  # through NCCL, not the file
        assert info.apply_s > 0 and info.bytes > 0
        # the engine samples with the new weights: its logprobs equal an HF forward with them
        # (parameter sums are no fingerprint: vLLM may keep repacked copies of the weights)
        model.load_state_dict(state)
        prompt = [5, 6, 7, 8]
        out = gen.sample(prompt, 1, 8, 1.0, True)[0]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out["token_ids"]])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out["token_ids"])[:, None])[:, 0]
        assert out["versions"] == [1] * 8
        assert float((ref - torch.tensor(out["logprobs"])).abs().max()) < 1e-3
        sync.close()
    finally:
        gen.shutdown()
