"""The calculator task's reward: does the final reply end with the reference answer?

    asyncrl train configs/tools_calculator_qwen2.5_0.5b_gpu.yaml

The tools environment calls this with the episode's last reply (the one without a tool call)
as the completion and the prompt file's columns as keyword lists (TRL's signature).
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(prompts: list[str], completions: list[str], answer: list, **columns) -> list[float]:
    """1.0 when the last number of the reply equals the answer, 0.1 for a reply with a number
    that is wrong (it answered), 0.0 for none."""
    numbers = _NUMBER.findall(completions[0].replace(",", ""))
    if not numbers:
        return [0.0]
    return [1.0 if float(numbers[-1]) == float(answer[0]) else 0.1]
