"""A tiny random reward model, for trying reward models on CPU (configs/reward_model.yaml) and
for the tests: a LlamaForSequenceClassification with num_labels=1 (its logit is the reward) and
the tiny policy's character tokenizer, with a chat template so inputs go through it.

    PYTHONPATH=. python examples/tiny_reward_model.py runs/tiny-reward-model

Its scores are random, so a run trained on it alone learns nothing meaningful; a real reward
model is any such directory (a *ForSequenceClassification saved with save_pretrained).
"""

from __future__ import annotations

import sys
from pathlib import Path

CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{{ eos_token }}{% endfor %}"
"""Each turn as 'u:prompt<eos>' / 'a:completion<eos>' (characters the tiny tokenizer has)."""


def write_tiny_reward_model(path: str | Path, *, seed: int = 0, chat_template: bool = True) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from asyncrl.rollout.tiny import write_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(path)
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(str(path))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
    )
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).float().save_pretrained(str(path))
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUTPUT_DIR")
    print(f"wrote a tiny reward model to {write_tiny_reward_model(sys.argv[1])}")
