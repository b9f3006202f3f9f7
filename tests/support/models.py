"""A tiny float64 Hugging Face Llama for the learner's exactness tests: the learner's own
attention (fsdp.attention_implementation on CPU: the varlen SDPA, which takes a packed row's
position_ids) and real decoder blocks (activation checkpointing)."""

from __future__ import annotations

import torch


def tiny_llama(vocab_size: int, num_hidden_layers: int = 1):
    """Seeded, float64, eval mode (no dropout): two builds give the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM  # transformers: heavy at import

    from asyncrl.learner.fsdp import attention_implementation

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        attn_implementation=attention_implementation(torch.device("cpu"), "float32"),
    )
    return LlamaForCausalLM(config).to(torch.float64).train(False)
