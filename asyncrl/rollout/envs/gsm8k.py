"""GSM8K-style reward: the response's final answer, compared with the reference by math-verify.

    env = GSM8KEnv()
    env.reward(question, "... so she has 18 - 2 = 16 eggs. #### 16", {"answer": "... #### 16"})  # 1.0

Extraction follows the dataset's own convention: the answer is what follows the last
"####"; without a marker (unless ``strict``) it is what math-verify reads: a \\boxed{} answer,
"the answer is ...", else the last number. The comparison is math-verify's, so "1,000",
"$1000" and "\\boxed{1000}" all match 1000, and 0.5 matches \\frac{1}{2} (``math_scorer``).
Prompts come from a file (rollout.prompts) with an "answer" (GSM8K's worked solution ending
in "#### N") or a bare number in the metadata.

``extract_answer`` is the quick regex reading of a GSM8K answer as a float, for callers that
want the number itself.
"""

from __future__ import annotations

import re

from asyncrl.rollout.envs.math_env import VerifiedMathEnv

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


class GSM8KEnv(VerifiedMathEnv):
    """Reward ``correct_reward`` when the response's answer equals the reference, else
    ``format_reward`` if an answer could be read at all, else 0. ``strict``: the answer must
    follow "####"."""

    name = "gsm8k"
    marker = "####"
