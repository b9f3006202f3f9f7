"""A custom verifiable reward, found by import path: an environment class, or plain reward
functions with TRL's signature.

    PYTHONPATH=. asyncrl train configs/demo.yaml rollout.env=examples.custom_reward:EchoFirstEnv 'rollout.env_kwargs={}'
    PYTHONPATH=. asyncrl train configs/demo.yaml 'rollout.rewards=[{fn: examples.custom_reward:letters_in_place}]'
    PYTHONPATH=. asyncrl train configs/demo.yaml \
        'rollout.rewards=[{fn: examples.custom_reward:exact_copy}, {fn: examples.custom_reward:brevity, weight: 0.1}]'

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


# Reward functions as TRL users write them: batched lists in, one float (or None) per completion
# out; the prompt's metadata fields (here the copy task's "target") arrive as keyword lists.


def letters_in_place(prompts, completions, target, **_):
    """The share of the target's letters in place, less 0.1 per letter too many or too few, at
    least -1: the partial credit a random policy needs to start learning (it almost never
    copies all of it, so exact_copy alone teaches it little)."""
    scores = []
    for c, t in zip(completions, target, strict=True):
        c = c.strip()
        right = sum(a == b for a, b in zip(c, t, strict=False))
        scores.append(max(-1.0, right / max(len(t), 1) - 0.1 * abs(len(c) - len(t))))
    return scores


def exact_copy(prompts, completions, target, **_):
    return [1.0 if c.strip() == t else 0.0 for c, t in zip(completions, target, strict=True)]


def brevity(prompts, completions, **_):
    """1 for an answer of at most 3 characters, None (no opinion) for an empty one."""
    return [None if not c.strip() else float(len(c.strip()) <= 3) for c in completions]
