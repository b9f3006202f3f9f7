"""Name the colour of the square: a visual task a tiny random vision-language model can learn.

    env = ColourEnv()
    prompt, meta = env.make_prompt(random.Random(0))   # meta["images"]: [PNG bytes], meta["target"]: "red"
    env.reward(prompt, "red", meta)                    # 1.0

Each prompt is one image, drawn at run time (a filled square of one of a few colours on a grey
background, at a random place and size), and the question in text. The image travels in the
group's metadata once (asyncrl.data.images), not per sample. The reward is positional credit
against the colour's name (asyncrl.rollout.envs.synthetic), so a random policy sees a signal;
the text is the same for every prompt, so only the image tells the colours apart.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.data.images import IMAGES_KEY, ImageLimits, encode_image
from asyncrl.rollout.envs.base import Environment
from asyncrl.rollout.envs.synthetic import positional_credit

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 30)}
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"
QUESTION = "colour?"


class ColourEnv(Environment):
    """An image with a coloured square -> the colour's name."""

    sample_special_tokens = False

    def __init__(self, colours: str = "red,green,blue,yellow", size: int = 56, length_penalty: float = 0.05):
        names = [c.strip() for c in colours.split(",") if c.strip()]
        unknown = [c for c in names if c not in COLOURS]
        if not names or unknown:
            raise ValueError(f"colours={colours!r}: a comma-separated subset of {', '.join(COLOURS)}")
        if not 28 <= size <= 512:
            raise ValueError(f"size={size}: between 28 and 512 pixels")
        self.names, self.size, self.length_penalty = names, size, length_penalty
        self.limits = ImageLimits(max_pixels=max(size * size, ImageLimits.max_pixels))

    def target_length(self) -> float:
        return sum(len(n) for n in self.names) / len(self.names)

    def draw(self, name: str, rng: random.Random) -> Any:
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (self.size, self.size), (128, 128, 128))
        side = rng.randint(self.size // 2, self.size)
        x, y = rng.randint(0, self.size - side), rng.randint(0, self.size - side)
        ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[name])
        return image

    def make_prompt(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        name = rng.choice(self.names)
        return IMAGE_PART + QUESTION, {"target": name, IMAGES_KEY: [encode_image(self.draw(name, rng), self.limits)]}

    def reward(self, prompt: str, response: str, metadata: dict[str, Any]) -> float:
        target = metadata.get("target")
        if not isinstance(target, str) or not target:
            raise ValueError("ColourEnv needs metadata 'target' (the colour's name)")
        return positional_credit(response, target, self.length_penalty)
