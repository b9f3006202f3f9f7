"""Prompt images on the engine side: which model takes them, and the checks a prompt's images pass
before the engine sees them.

    vision = VisionModel.of(model_dir)                 # None for a text model
    encode = with_images(prompt_encoder(tok, True), vision, ImageLimits())
    ids = encode(text, metadata)                       # PromptImageError for a bad image or count
    images = prompt_images(metadata, ids, vision, limits)   # decoded, for multi_modal_data

A prompt's images are its group's metadata ``images`` (asyncrl.data.images: PNG bytes, once per
group). Its text holds one image placeholder per image, written by the model's chat template from
a ``{"type": "image"}`` content part (the template knows the model's placeholder: ``<image>`` for
Idefics3, the vision-start/pad/end triple for Qwen2-VL). The engine is handed the prompt's ids
with one placeholder token per image and the decoded images as ``multi_modal_data``; vLLM
expands each placeholder to the image's tokens (Idefics3: ``<fake_token_around_image>
<global-img>`` + image_seq_len ``<image>`` + ``<fake_token_around_image>``), and the expanded ids it
ran are the ones the samples carry (``engine_prompt_ids``), so the learner never re-tokenizes.

Every check here runs before the engine: vLLM itself refuses more images than placeholders, but
takes a placeholder without an image as a plain token, so a prompt whose counts differ would be
sampled, and trained, with an image token standing for nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.config import ConfigError
from asyncrl.data.codec import RecordError
from asyncrl.data.images import IMAGES_KEY, ImageLimits, check_group_images


class PromptImageError(ConfigError):
    """A prompt's images cannot go to the engine: the message says which and why."""


PLACEHOLDERS = {"idefics3": "<image>"}
"""model_type -> the placeholder its chat template writes for one image (and the token vLLM expands)."""


@dataclass(frozen=True)
class VisionModel:
    """What the engine side needs to know of a vision-language model."""

    model_type: str
    image_token_id: int
    """The placeholder token: one per image in the ids handed to the engine."""
    tokens_per_image: int | None
    """Placeholder tokens per image after the engine's expansion, when fixed (Idefics3 without
    image splitting: image_seq_len); None when it depends on the image."""

    @classmethod
    def of(cls, model: str) -> VisionModel | None:
        """The model directory's vision side; None for a text model, a hub id or a directory
        without a config.json (read only when local: no download)."""
        from asyncrl.rollout.families import read_config

        config = read_config(model)
        if config is None or not isinstance(config.get("vision_config"), dict):
            return None
        model_type = str(config.get("model_type"))
        token = config.get("image_token_id", config.get("image_token_index"))
        if not isinstance(token, int) or isinstance(token, bool):
            raise ConfigError(f"rollout.model={model!r}: a vision-language config without an integer image_token_id")
        return cls(model_type, token, _tokens_per_image(model))

    def expanded_length(self, ids: list[int], images: int) -> int | None:
        """The prompt's length once the engine has expanded its placeholders (None if unknown)."""
        if self.tokens_per_image is None:
            return None
        return len(ids) + images * (self.tokens_per_image + 2)  # + the two tokens around the image


def _tokens_per_image(model: str) -> int | None:
    """Idefics3's fixed count: ``image_seq_len`` when its image processor never splits images."""
    path = os.path.join(model, "processor_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    image_processor = data.get("image_processor")
    seq_len = data.get("image_seq_len")
    splits = not isinstance(image_processor, dict) or image_processor.get("do_image_splitting", True)
    return seq_len if isinstance(seq_len, int) and not isinstance(seq_len, bool) and not splits else None


def prompt_images(
    metadata: dict[str, Any], ids: list[int], vision: VisionModel | None, limits: ImageLimits
) -> list[Any]:
    """The prompt's images decoded (RGB PIL images, in prompt order), after every check; [] for a
    prompt without any. PromptImageError for a bad image, images a text model would ignore, or a
    placeholder count that differs from the image count."""
    placeholders = 0 if vision is None else sum(1 for t in ids if t == vision.image_token_id)
    if IMAGES_KEY not in metadata:
        if placeholders:
            raise PromptImageError(
                f"the prompt has {placeholders} image placeholder(s) but no images (metadata[{IMAGES_KEY!r}])"
            )
        return []
    try:
        images = check_group_images(metadata, limits)
    except RecordError as e:
        raise PromptImageError(f"the prompt's {e.detail}") from None
    if vision is None:
        if images:
            raise PromptImageError(
                f"the prompt carries {len(images)} image(s), but rollout.model is not a vision-language model: "
                "a run would sample and train on the text alone"
            )
        return []
    if placeholders != len(images):
        raise PromptImageError(
            f"the prompt has {placeholders} image placeholder(s) for {len(images)} image(s): each image needs "
            f"one {{'type': 'image'}} content part, which the chat template writes as the model's placeholder"
        )
    return images


def images_refused(env_name: str, multi_turn: bool, teacher: bool) -> str | None:
    """Why this run's prompts may not carry images (None: they may): what would sample or score
    them without their images."""
    if multi_turn:
        return f"rollout.env={env_name!r} is multi-turn: it takes no prompt images yet (its turns would go without)"
    if teacher:
        return "rollout.teacher scores prompts without their images: not with image prompts yet"
    return None


def with_images(
    encode: Callable[[str, dict[str, Any]], list[int]],
    vision: VisionModel | None,
    limits: ImageLimits,
    refused: str | None = None,
) -> Callable[[str, dict[str, Any]], list[int]]:
    """``encode`` that also checks the prompt's images (``prompt_images``) as each prompt is drawn,
    so a bad one stops the generator with its reason before it is admitted or sampled;
    ``refused`` (``images_refused``): why this run takes no images at all."""

    def checked(text: str, metadata: dict[str, Any]) -> list[int]:
        ids = encode(text, metadata)
        if refused is not None and IMAGES_KEY in metadata:
            raise PromptImageError(f"the prompt carries images, but {refused}")
        prompt_images(metadata, ids, vision, limits)
        return ids

    return checked


def engine_prompt_ids(given: list[int], ran: list[int] | None, images: int, vision: VisionModel | None) -> list[int]:
    """The prompt ids a group's samples carry: the engine's expanded ones for a prompt with images
    (checked: as many image tokens as its images take), the given ones otherwise."""
    if not images or vision is None:
        return given
    if ran is None:
        raise PromptImageError("the engine returned no prompt ids for a prompt with images")
    count = sum(1 for t in ran if t == vision.image_token_id)
    want = images * vision.tokens_per_image if vision.tokens_per_image is not None else None
    if count < images or (want is not None and count != want):
        raise PromptImageError(
            f"the engine's prompt holds {count} image tokens for {images} image(s)"
            + (f" (expected {want})" if want is not None else "")
        )
    return list(ran)


def describe_images(
    model: str, chat_template: bool, text: str, metadata: dict[str, Any], where: str, limits: ImageLimits
) -> list[str]:
    """``--check``'s lines for a drawn prompt's images: read and decoded as the generator reads
    them, and what the engine will get; PromptImageError (a ConfigError) where a generator would
    stop. ``where`` names the prompt's source in messages."""
    from asyncrl.rollout.families import read_config

    if IMAGES_KEY not in metadata:
        return []
    try:
        images = check_group_images(metadata, limits)
    except RecordError as e:
        raise PromptImageError(f"{where}: a drawn prompt's images: {e}") from None
    sizes = ", ".join(f"{i.size[0]}x{i.size[1]}" for i in images)
    read = f"{where}: a drawn prompt's {len(images)} image(s) read and decoded ({sizes})"
    if model == "tiny":  # the tiny text model a run writes at start-up
        raise PromptImageError(f"{where}: {len(images)} prompt image(s), but rollout.model=tiny is a text model")
    if read_config(model) is None:
        return [f"{read}; what the engine gets not checked ({model!r} is not a local model directory)"]
    from transformers import AutoTokenizer  # heavy: only for a local model and a prompt with images

    from asyncrl.rollout.prompts import encode_prompt

    vision = VisionModel.of(model)
    try:
        ids = encode_prompt(AutoTokenizer.from_pretrained(model), text, chat_template, metadata)
        prompt_images(metadata, ids, vision, limits)
    except ValueError as e:
        raise PromptImageError(f"{where}: {e}") from None
    assert vision is not None  # prompt_images refuses images for a text model
    expanded = vision.expanded_length(ids, len(images))
    each = f"{vision.tokens_per_image} image tokens" if vision.tokens_per_image else "the image's tokens"
    after = f", {expanded} after" if expanded is not None else ""
    return [
        f"{read}; the engine gets them as multi_modal_data beside the prompt's {len(images)} placeholder "
        f"token(s) (id {vision.image_token_id}), each expanded to {each} ({len(ids)} prompt tokens as given{after})"
    ]
