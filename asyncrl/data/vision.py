"""Vision-language prompts: chat messages with image parts -> token ids and pixel values.

    vl = VisionPrompter.load(model_dir)                 # tokenizer + image processor, no torchvision
    prompt = vl.encode(messages, images)                # VisionPrompt: ids, pixel_values, grid_thw

What a Qwen2-VL processor does, done with its two parts: the chat template renders the messages
(an image part becomes ``<|vision_start|><|image_pad|><|vision_end|>``), the image processor
turns each image into patches and its (t, h, w) patch grid, and each ``<|image_pad|>`` is
expanded to one token per merged patch (t*h*w / merge**2). The processor object itself is not
used because transformers builds it with its video processor, which needs torchvision (not in
the CPU install; see docs/guide/vision.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

IMAGE_PAD = "<|image_pad|>"


@dataclass(frozen=True)
class VisionPrompt:
    input_ids: np.ndarray
    """int32 [P]: the prompt, image pads expanded."""
    pixel_values: np.ndarray
    """float32 [patches, C*T*patch*patch]: every image's patches, in prompt order."""
    image_grid_thw: np.ndarray
    """int64 [images, 3]: each image's patch grid."""


class VisionPrompter:
    def __init__(self, tokenizer: Any, image_processor: Any):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if self.image_pad_id is None or self.image_pad_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {IMAGE_PAD} token: not a Qwen2-VL-style model")
        self.merge = int(image_processor.merge_size)

    @classmethod
    def load(cls, model_dir: str) -> VisionPrompter:
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

        return cls(AutoTokenizer.from_pretrained(model_dir), Qwen2VLImageProcessorPil.from_pretrained(model_dir))

    def render(self, messages: list[dict[str, Any]]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, messages: list[dict[str, Any]], images: list[Any]) -> VisionPrompt:
        """The prompt's ids with each image pad expanded, and the images' patches (ValueError
        when the template's image parts and ``images`` differ in number)."""
        ids = self.tokenizer(self.render(messages), add_special_tokens=False)["input_ids"]
        pads = [i for i, t in enumerate(ids) if t == self.image_pad_id]
        if len(pads) != len(images):
            raise ValueError(f"the messages have {len(pads)} image parts but {len(images)} images were given")
        if not images:
            return VisionPrompt(np.asarray(ids, np.int32), np.zeros((0, 0), np.float32), np.zeros((0, 3), np.int64))
        feats = self.image_processor(images=images, return_tensors="np")
        grid = np.asarray(feats["image_grid_thw"], np.int64)
        counts = (grid.prod(axis=1) // self.merge**2).tolist()
        out: list[int] = []
        k = 0
        for t in ids:
            if t == self.image_pad_id:
                out.extend([t] * int(counts[k]))
                k += 1
            else:
                out.append(t)
        return VisionPrompt(np.asarray(out, np.int32), np.asarray(feats["pixel_values"], np.float32), grid)
