"""The learner's forward for vision-language prompts.

Idefics3 (SmolVLM) in training: `image_inputs` gives the FSDP forward of a micro-batch its
pixel arguments (asyncrl.learner.step.forward_logits). Below, for a Qwen2-VL-style model
outside the trainer: log-probs of the response tokens given the image, in one pass.

    lp = response_logprobs(model, prompt, response_ids, temperature=0.7)   # float32 [R]

``model`` is a Qwen2-VL-style ``AutoModelForImageTextToText``; ``prompt`` the VisionPrompt the
generator built (asyncrl.data.vision), with the image's patches. The model computes its own
multimodal RoPE positions from the ids and the patch grid (three position streams: time,
height, width; text tokens advance all three), which is what the engine does while it decodes
token by token; the test checks the two agree. Temperature as in the engine's processed
log-probs: log_softmax(logits / T).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from asyncrl.data import microbatch as mbatch
from asyncrl.data.pixels import image_seq_len, vision_config
from asyncrl.data.vision import VisionPrompt


def mm_token_type_ids(model: Any, ids: Any) -> Any:
    """1 at image tokens, 0 at text: what the model places its RoPE grid by."""
    return (ids == int(model.config.image_token_id)).long()


def response_logprobs(model: Any, prompt: VisionPrompt, response_ids: np.ndarray, temperature: float = 1.0) -> Any:
    """log p(response[t] | prompt, image, response[:t]) for every t: a float32 tensor [R]
    (with grad when the model is in training)."""
    import torch

    from asyncrl.algo.logprobs import logprobs_from_logits

    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    response = torch.as_tensor(np.asarray(response_ids, np.int64))
    if bool((response == int(model.config.image_token_id)).any()):
        # the model places image features at every image-pad id: one in a response cannot be scored
        raise ValueError("the response holds an image-pad token: generators must not sample special tokens")
    ids = torch.cat([torch.as_tensor(prompt.input_ids.astype(np.int64)), response])[None]
    kwargs: dict[str, Any] = {}
    if len(prompt.image_grid_thw):
        param = next(model.parameters())
        kwargs["pixel_values"] = torch.as_tensor(prompt.pixel_values).to(param.device, param.dtype)
        kwargs["image_grid_thw"] = torch.as_tensor(prompt.image_grid_thw).to(param.device)
        kwargs["mm_token_type_ids"] = mm_token_type_ids(model, ids).to(param.device)
    logits = model(input_ids=ids.to(next(model.parameters()).device), use_cache=False, **kwargs).logits[0]
    p = int(prompt.input_ids.shape[0])
    # Position t predicts token t+1: the response's tokens are predicted from p-1 .. p+R-2.
    scores = logits[p - 1 : p - 1 + response.shape[0]].float()
    return logprobs_from_logits(scores, response.to(scores.device), temperature)


# ---------------------------------------------------------------- Idefics3 (SmolVLM) micro-batches


def image_inputs(model: Any, mb: dict[str, Any], device: Any) -> dict[str, Any]:
    """The pixel arguments of `model`'s forward on micro-batch `mb`: {} for a text model; the
    micro-batch's tiles (asyncrl.data.microbatch.IMAGE_FIELDS); for one without images (a
    padding micro-batch, text prompts) a stand-in tile of ones whose features no token takes.

    The stand-in is there because the vision tower and the connector are FSDP units: each
    gathers its parameters in every forward and reduces its gradient in every backward, a
    collective, so every rank must run them in every micro-batch, images or not (a rank that
    skipped them: a gloo "collective mismatch" abort). Their backward runs too: the model's
    ``masked_scatter`` of the features into the embeddings keeps them in the graph, with a zero
    gradient where no token took them. A count of image tokens that does not match the tiles would
    fail inside the model (or, with more tiles than tokens, drop features silently): the driver
    refuses such records (asyncrl.data.pixels); finding one here is a bug, raised before any
    collective."""
    import torch

    config: Any = getattr(model, "config", None)
    vision = vision_config(config)
    if vision is None:
        return {}
    ids: torch.Tensor = mbatch.forward_ids(mb)
    tokens = int((ids == int(config.image_token_id)).sum())
    per_tile = image_seq_len(config)
    if mbatch.PIXEL_VALUES in mb:
        values = mb[mbatch.PIXEL_VALUES]
        tiles = len(mb[mbatch.TILE_INDEX]) if mbatch.TILE_INDEX in mb else values.shape[1]
        if tokens != tiles * per_tile:
            raise ValueError(f"a micro-batch with {tiles} tiles x {per_tile} holds {tokens} image tokens")
        return {"pixel_values": values.to(device), "pixel_attention_mask": mb[mbatch.PIXEL_MASK].to(device)}
    if tokens:
        raise ValueError(f"a micro-batch holds {tokens} image tokens and no images")
    s = int(vision.image_size)
    return {
        "pixel_values": torch.ones(1, 1, int(vision.num_channels), s, s, device=device),
        "pixel_attention_mask": torch.ones(1, 1, s, s, dtype=torch.bool, device=device),
    }


@contextlib.contextmanager
def shared_tiles(model: Any, mb: dict[str, Any]) -> Iterator[None]:
    """While `model` runs on `mb`: the vision tower encodes the micro-batch's distinct tiles
    only (asyncrl.data.microbatch.TILE_INDEX: a group's samples share one image), and the
    connector's output is laid out one row per tile of the sequences, in their order, which is
    what the model places at the image tokens. The gradient of a shared tile sums over the
    sequences that use it, as if each had encoded it. A hook on the connector, inside the
    model's forward (and so inside FSDP's hooks), for the length of the forward."""
    index = mb.get(mbatch.TILE_INDEX)
    if index is None:
        yield
        return
    inner = model.model  # an HF model's base model, or a LoRA reference's wrapped HF model
    connector = getattr(inner, "connector", None) or inner.model.connector
    handle = connector.register_forward_hook(lambda _module, _args, out: out.index_select(0, index.to(out.device)))
    try:
        yield
    finally:
        handle.remove()
