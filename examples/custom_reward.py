"""A custom verifiable reward, found by import path.

    PYTHONPATH=. asyncrl train configs/demo.yaml rollout.env=examples.custom_reward:EchoFirstEnv

The environment makes its own prompts ("abc>") and rewards a response whose first
character repeats the prompt's first one, with partial credit for a short answer. Any
class with ``make_prompt`` and ``reward`` works; ``reward`` may raise or return NaN — the
generator records the error on that sample and keeps going.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.rollout.envs.base import Environment


class EchoFirstEnv(Environment):
    def __init__(self, alphabet: str = "abcdef", length: int = 3):
        self.alphabet = alphabet
        self.length = length

    def make_prompt(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        chars = "".join(rng.choice(self.alphabet) for _ in range(self.length))
        return f"{chars}>", {"first": chars[0]}

    def reward(self, prompt: str, response: str, metadata: dict[str, Any]) -> float:
        response = response.strip()
        if not response:
            return 0.0
        hit = 1.0 if response[0] == metadata["first"] else 0.0
        brevity = 0.2 if len(response) <= 2 else 0.0
        return hit + brevity
