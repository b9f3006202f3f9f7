"""A custom multi-turn environment, trained step-wise.

    PYTHONPATH=. asyncrl train configs/demo.yaml rollout.env=examples.multiturn_env:GuessDigitEnv \\
        'rollout.env_kwargs={}' algo.stepwise=true algo.advantage_estimator=grpo

The model guesses a hidden digit; after each wrong guess the environment answers "<" or
">" and the episode goes on, up to `max_turns`. Every step of a trajectory gets the
trajectory's advantage at its own response tokens (step-wise GRPO); consecutive steps
that share a prefix are merged into one sequence when algo.merge_stepwise is on.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.rollout.envs.multiturn import MultiTurnEnvironment


class GuessDigitEnv(MultiTurnEnvironment):
    def __init__(self, max_turns: int = 3):
        self.max_turns = max_turns
        self._target = 0
        self._turn = 0

    def make_prompt(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        target = rng.randrange(10)
        return "guess:", {"target": target}

    def reset(self, prompt: str, metadata: dict[str, Any]) -> str:
        self._target = int(metadata["target"])
        self._turn = 0
        return prompt

    def step(self, response: str) -> tuple[str, float, bool]:
        self._turn += 1
        guess = next((int(c) for c in response if c.isdigit()), None)
        if guess == self._target:
            return "", 1.0, True
        if self._turn >= self.max_turns or guess is None:
            return "", 0.0, True
        return ("<" if self._target < guess else ">"), 0.0, False
