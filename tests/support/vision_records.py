"""Image records for the vision learner's tests: a tiny Idefics3's prompts as the engine expands
them, PNG images in the group's metadata, the driver's sequences, transformers' plain
log-probs to compare against, and micro-batches."""

from __future__ import annotations

import numpy as np
import torch

from asyncrl.config import AlgoConfig, RolloutConfig
from asyncrl.data import microbatch as mbatch
from asyncrl.data.batch import build_minibatches
from asyncrl.data.images import IMAGES_KEY, ImageLimits, encode_image
from asyncrl.types import RolloutGroup, Sample

TEMP = 0.7
COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 40)}
COLOUR_ENV = "asyncrl.rollout.envs.colour:ColourEnv"


def colour_rollout(n_samples: int, **extra) -> RolloutConfig:
    """The rollout section of the engine tests' colour task on the tiny Idefics3 (``extra``: the
    platform's own settings, e.g. a CUDA engine's engine_kwargs)."""
    return RolloutConfig(
        n_samples=n_samples,
        max_tokens=4,
        temperature=TEMP,
        env=COLOUR_ENV,
        env_kwargs={},
        chat_template=True,
        engine_max_model_len=128,
        max_prompt_tokens=64,
        engine_max_num_seqs=8,
        seed=11,
        **extra,
    )


def png(colour: str, size=(40, 56)) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (128, 128, 128))
    ImageDraw.Draw(img).rectangle([8, 8, 30, 30], fill=COLOURS[colour])
    return encode_image(img, ImageLimits())


def engine_prompt(model_dir: str, n_images: int) -> np.ndarray:
    """The prompt ids as the engine returns them: each <image> expanded (the processor does
    the same expansion, which is what vLLM's Idefics3 processor calls)."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    images = [Image.new("RGB", (8, 8))] * n_images
    enc = processor(text=["<image>" * n_images + "colour:"], images=[images] if images else None)
    return np.asarray(enc["input_ids"][0], np.int32)


def group(model_dir: str, gid: str, colours: list[str], rng, n: int = 2, prompt=None) -> RolloutGroup:
    samples = []
    for i in range(n):
        t = int(rng.integers(3, 7))
        samples.append(
            Sample(
                response_ids=rng.integers(3, 40, t),  # characters: no special or image token
                rollout_logprobs=-rng.uniform(0.5, 3.0, t),
                loss_mask=np.ones(t, np.uint8),
                reward=float(i),
                behavior_version=0,
            )
        )
    ids = engine_prompt(model_dir, len(colours)) if prompt is None else prompt
    return RolloutGroup(gid, gid, ids, samples, metadata={IMAGES_KEY: [png(c) for c in colours]})


def sequences(model_dir, pixels, groups):
    minibatches, metrics = build_minibatches(groups, AlgoConfig(), num_minibatches=1, pixels=pixels)
    return minibatches[0], metrics


def plain_logprobs(hf, seq, disallowed=None) -> torch.Tensor:
    """transformers' own forward on one sequence (its default attention), no FSDP, no asyncrl;
    `disallowed` tokens masked out of the softmax as the engines mask them."""
    ids = torch.as_tensor(seq.input_ids.astype(np.int64))[None]
    kw = {}
    if seq.pixel_values is not None and len(seq.pixel_values):
        kw = {
            "pixel_values": torch.as_tensor(seq.pixel_values)[None],
            "pixel_attention_mask": torch.as_tensor(seq.pixel_attention_mask)[None],
        }
    logits = hf(input_ids=ids, **kw).logits[0].float()
    if disallowed is not None:
        logits = logits.masked_fill(disallowed, -1e4)
    logp = torch.log_softmax(logits[:-1] / TEMP, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), logp])


def load_plain(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).train(False)


def micro(seqs, packed: bool):
    fields = [mbatch.seq_fields(s) for s in seqs]
    mb = (mbatch.collate_packed if packed else mbatch.collate)(fields, pad_token_id=0)
    mb[mbatch.PADDING_KEY] = False
    return mb


def padding(mb):
    return mbatch.padding_microbatch(mbatch.field_dtypes(mb), pad_token_id=0)
