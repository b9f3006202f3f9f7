"""Name the colour of the square: a visual task a tiny random vision-language model can learn.

    env = ColourEnv()
    prompt, meta = env.make_prompt(random.Random(0))   # meta["images"]: [PNG bytes], meta["target"]: "red"
    env.reward(prompt, "red", meta)                    # 1.0

Each prompt is one image, drawn at run time (a filled square of one of a few colours on a grey
background, at a random place and size), and the question in text, as a chat message of two
content parts, ``{"type": "image"}`` then the text: the model's chat template writes its own
image placeholder (so it needs rollout.chat_template=true), and the generator hands the image to
the engine with it (asyncrl.rollout.vision_prompts). The image travels in the group's metadata
once (asyncrl.data.images), not per sample. The reward is positional credit
against the colour's name (asyncrl.rollout.envs.synthetic), so a random policy sees a signal;
the text is the same for every prompt, so only the image tells the colours apart.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.data.images import IMAGES_KEY, ImageLimits, encode_image
from asyncrl.rollout.envs.base import Environment
from asyncrl.rollout.envs.synthetic import positional_credit
from asyncrl.rollout.prompts import MESSAGES_KEY

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 30)}
QUESTION = "colour?"
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
"""The prompt as the chat template renders it: the image, then the question."""


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
        self.limits = ImageLimits()  # the run's limits (the largest square, 512x512, is within them)

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
        image = encode_image(self.draw(name, rng), self.limits)
        return QUESTION, {"target": name, MESSAGES_KEY: MESSAGES, IMAGES_KEY: [image]}

    def reward(self, prompt: str, response: str, metadata: dict[str, Any]) -> float:
        target = metadata.get("target")
        if not isinstance(target, str) or not target:
            raise ValueError("ColourEnv needs metadata 'target' (the colour's name)")
        return positional_credit(response, target, self.length_penalty)
