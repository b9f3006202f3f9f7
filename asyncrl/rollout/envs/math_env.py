"""Math answers scored by math-verify: a MATH-style environment and the base GSM8K's shares.

    env = make_env("math")                          # prompts from rollout.prompts, reference in metadata["answer"]
    env.reward(problem, "... so the area is $\\boxed{\\frac{\\pi}{3}}$.", {"answer": "\\frac{\\pi}{3}"})  # 1.0

The reference is a bare answer ("\\frac{\\pi}{3}", MATH-500's "answer" column) or a worked
solution ending in \\boxed{} (MATH's "solution" column: set rollout.answer_field=solution).
The response's answer is its last \\boxed{} (with ``strict=True`` nothing else counts), else
what math-verify finds ("the final answer is ...", the last $...$ or number). See
``math_scorer`` for the comparison and its time limit.
"""

from __future__ import annotations

from typing import Any

from asyncrl.rollout.envs.base import Environment
from asyncrl.rollout.envs.math_scorer import MathScorer


class VerifiedMathEnv(Environment):
    """Reward ``correct_reward`` when the response's answer equals the reference's, else
    ``format_reward`` if an answer could be read at all, else 0. A comparison that takes over
    ``timeout_s`` seconds raises TimeoutError: the sample is scored as failed."""

    name = "math"
    marker = "\\boxed"
    """With ``strict``, a response without this text scores 0 (no answer given the task's way)."""

    def __init__(
        self, strict: bool = False, correct_reward: float = 1.0, format_reward: float = 0.0, timeout_s: float = 5.0
    ):
        self.strict, self.correct_reward, self.format_reward = strict, correct_reward, format_reward
        self.scorer = MathScorer(timeout_s)

    def reward(self, prompt: str, response: str, metadata: dict[str, Any]) -> float:
        if "answer" not in metadata:
            raise KeyError(f"{self.name}: the prompt's metadata has no 'answer' field")
        if self.strict and self.marker not in response:
            return 0.0
        try:
            verdict = self.scorer.check(str(metadata["answer"]), response)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        if not verdict.found:
            return 0.0
        return self.correct_reward if verdict.correct else self.format_reward


class MathEnv(VerifiedMathEnv):
    """MATH-style problems: the model states its answer in \\boxed{}."""
