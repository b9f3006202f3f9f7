"""Pixel values for the learner: a group's PNG bytes through the model's image processor,
checked against the image tokens of the engine's prompt.

    pixels = ImagePixels.of(model_dir)                 # None for a text model
    inputs = pixels.encode(group.metadata["images"])   # PixelInputs, or RecordError("bad_image", ...)
    pixels.check_tokens(prompt_ids, inputs)            # RecordError("image_tokens", ...) on a mismatch
    pixels.check_response(response_ids)                # and on a sampled image token

For an Idefics3-style model (SmolVLM): the engine expands each ``<image>`` of a prompt into
``image_seq_len`` image tokens per tile (with splitting off, one tile per image), and the
prompt ids a record carries are that expansion. The model places one tile's features, in
order, at every run of ``image_seq_len`` image tokens (``masked_scatter``: more features than
tokens are dropped without a word, fewer fail inside the forward), so a record is trained
only when its image tokens come in runs of exactly ``image_seq_len`` and number
tiles x image_seq_len. Every image is decoded by asyncrl.data.images.decode_image (PNG
signature, size limits before any pixel is inflated) before the processor sees it; the
processor is transformers' PIL backend (no torchvision). Anything else is a RecordError with
its reason, never a crash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.data.codec import RecordError
from asyncrl.data.images import ImageLimits, decode_image, images_of

IMAGE_TOKENS = "image_tokens"
"""The RecordError reason of a prompt whose image tokens do not match its images."""
SUPPORTED = ("idefics3",)
"""Model types whose pixel inputs this module builds (config.model_type)."""


@dataclass(frozen=True)
class PixelInputs:
    """One prompt's images as the model's forward takes them."""

    pixel_values: np.ndarray
    """float32 [tiles, channels, size, size]: every image's tiles, in prompt order."""
    pixel_attention_mask: np.ndarray
    """bool [tiles, size, size]: the real (not padded) pixels of each tile."""

    @property
    def tiles(self) -> int:
        return int(self.pixel_values.shape[0])


def vision_config(config: Any) -> Any:
    """The Hugging Face config's vision part, or None for a text model."""
    return getattr(config, "vision_config", None)


def image_seq_len(config: Any) -> int:
    """Image tokens per tile: the vision tower's patches per tile over the connector's
    pixel-shuffle (scale_factor squared)."""
    vision = config.vision_config
    per_side = int(vision.image_size) // int(vision.patch_size)
    return per_side**2 // int(config.scale_factor) ** 2


class ImagePixels:
    """The model's image processor and the token counts its prompts must carry."""

    def __init__(
        self, image_processor: Any, *, image_token_id: int, image_seq_len: int, image_size: int, limits: ImageLimits
    ) -> None:
        self.image_processor = image_processor
        self.image_token_id = int(image_token_id)
        self.image_seq_len = int(image_seq_len)
        self.image_size = int(image_size)
        self.limits = limits

    @classmethod
    def of(cls, model_dir: str, limits: ImageLimits | None = None, config: Any = None) -> ImagePixels | None:
        """For the model at `model_dir` (its Hugging Face `config`, read when not given): None for a
        text model, ValueError for a vision model whose pixel inputs are not built here."""
        from transformers import AutoConfig, AutoImageProcessor

        config = config if config is not None else AutoConfig.from_pretrained(model_dir)
        vision = vision_config(config)
        if vision is None:
            return None
        if config.model_type not in SUPPORTED:
            raise ValueError(
                f"{config.model_type}: the learner builds pixel inputs for {', '.join(SUPPORTED)} models only"
            )
        from asyncrl.data.microbatch import model_pad_token_id  # torch: only for a vision model

        if model_pad_token_id(config) == int(config.image_token_id):
            # The learner pads micro-batches with it: padding would read as image tokens.
            raise ValueError(f"{model_dir}: pad_token_id is the image token ({config.image_token_id})")
        return cls(
            AutoImageProcessor.from_pretrained(model_dir),  # the PIL backend: no torchvision on CPU installs
            image_token_id=int(config.image_token_id),
            image_seq_len=image_seq_len(config),
            image_size=int(vision.image_size),
            limits=limits or ImageLimits(),
        )

    def empty(self) -> PixelInputs:
        s = self.image_size
        return PixelInputs(np.zeros((0, 3, s, s), np.float32), np.zeros((0, s, s), bool))

    def encode(self, metadata: dict[str, Any]) -> PixelInputs:
        """A group's images (metadata["images"], PNG bytes) as pixel inputs, or RecordError."""
        images = []
        for i, data in enumerate(images_of(metadata, self.limits)):
            try:
                images.append(decode_image(data, self.limits))
            except RecordError as e:
                raise RecordError("bad_image", f"images[{i}]: {e.detail}") from None
        if not images:
            return self.empty()
        try:
            feats = self.image_processor(images=[images], return_tensors="np")
        except (ValueError, TypeError, OSError) as e:  # a decoded, bounded RGB image: not expected
            raise RecordError("bad_image", f"the image processor refused it: {type(e).__name__}: {e}") from None
        values = np.asarray(feats["pixel_values"], np.float32)[0]
        mask = feats.get("pixel_attention_mask")
        mask = np.ones(values.shape[:1] + values.shape[2:], bool) if mask is None else np.asarray(mask, bool)[0]
        s = self.image_size
        if values.ndim != 4 or values.shape[1:] != (3, s, s):
            raise RecordError("bad_image", f"tiles of shape {values.shape[1:]}, the model's are (3, {s}, {s})")
        # The model drops an all-zero tile as padding: its tokens would then have no features.
        blank = [k for k in range(values.shape[0]) if not values[k].any()]
        if blank:
            raise RecordError("bad_image", f"tile {blank[0]} is all zeros after the processor (read as padding)")
        return PixelInputs(values, mask)

    def check_tokens(self, prompt_ids: np.ndarray, inputs: PixelInputs) -> None:
        """RecordError(IMAGE_TOKENS) unless the prompt's image tokens are runs of image_seq_len,
        as many as `inputs` has tiles."""
        is_image = np.asarray(prompt_ids) == self.image_token_id
        runs = _runs(is_image)
        n = self.image_seq_len
        if len(runs) != inputs.tiles or any(r != n for r in runs):
            raise RecordError(
                IMAGE_TOKENS,
                f"the prompt holds {int(is_image.sum())} image tokens in runs of {runs[:8]}; its "
                f"{inputs.tiles} image tile(s) need {inputs.tiles} run(s) of {n}",
            )

    def check_response(self, response_ids: np.ndarray) -> None:
        """RecordError(IMAGE_TOKENS) if a sampled token is the image token: the model would look
        for features it has no image for (a run that lets its engines sample special tokens)."""
        sampled = int((np.asarray(response_ids) == self.image_token_id).sum())
        if sampled:
            raise RecordError(IMAGE_TOKENS, f"the response holds {sampled} image token(s), which no image backs")


def _runs(mask: np.ndarray) -> list[int]:
    """Lengths of the runs of True in a 1-D bool array, in order."""
    if not mask.size:
        return []
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return (edges[1::2] - edges[::2]).tolist()
