"""GSM8K-style reward: extract the final number from a response and compare it to the answer.

    env = GSM8KEnv()
    env.reward(question, "... so she has 18 - 2 = 16 eggs. #### 16", {"answer": "... #### 16"})  # 1.0

Extraction follows the dataset's own convention: the answer is what follows the last
"####"; without a marker, the last number in the text ("strict=False", the common
"flexible" match). Numbers are compared after removing thousands separators, "$" and a
trailing ".", as floats. Prompts come from a file (rollout.prompts) with an "answer"
(GSM8K's worked solution ending in "#### N") or a bare number in the metadata.
"""

from __future__ import annotations

import re
from typing import Any

from asyncrl.rollout.envs.base import Environment

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def _normalize(number: str) -> float | None:
    text = number.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return float(text)
    except ValueError:
        return None


def extract_answer(text: str, strict: bool = False) -> float | None:
    """The number after the last '####', else (unless ``strict``) the last number in ``text``."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        found = _NUMBER.search(tail)
        return _normalize(found.group()) if found else None
    if strict:
        return None
    numbers = _NUMBER.findall(text)
    return _normalize(numbers[-1]) if numbers else None


class GSM8KEnv(Environment):
    """Reward ``correct_reward`` when the extracted answer equals the reference, else ``format_reward``
    if a number could be extracted at all, else 0."""

    def __init__(self, strict: bool = False, correct_reward: float = 1.0, format_reward: float = 0.0):
        self.strict, self.correct_reward, self.format_reward = strict, correct_reward, format_reward

    def reward(self, prompt: str, response: str, metadata: dict[str, Any]) -> float:
        if "answer" not in metadata:
            raise KeyError("gsm8k: the prompt's metadata has no 'answer' field")
        reference = extract_answer(str(metadata["answer"]), strict=False)
        if reference is None:
            raise ValueError(f"gsm8k: cannot read a number from the reference answer {metadata['answer']!r}")
        got = extract_answer(response, strict=self.strict)
        if got is None:
            return 0.0
        return self.correct_reward if abs(got - reference) < 1e-6 else self.format_reward
