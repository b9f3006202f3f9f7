"""Synthetic string tasks a tiny random model can learn from scratch on CPU.

    env = CopyEnv(min_len=3, max_len=5)
    prompt, meta = env.make_prompt(random.Random(0))   # e.g. ("cab=", {"target": "cab"})
    env.reward(prompt, "cbb", meta)                     # 2/3 positions right -> 0.6667

Every task uses characters of ``asyncrl.rollout.tiny.DEFAULT_ALPHABET`` only, keeps
prompts short (3-5 characters plus a separator) and scores with partial credit,
so even a random policy sees a reward signal:

    reward = (#positions i with response[i] == target[i]) / len(target)
             - length_penalty * |len(response) - len(target)|

The length penalty makes "stop after the answer" learnable (max_tokens ~8 is enough). Only
if nothing else can lengthen the answer for free: the reward sees text decoded without special
tokens, so these tasks forbid sampling any special token but EOS (``sample_special_tokens``);
otherwise a policy pads its answer with <pad>/<bos> instead of learning to stop.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.rollout.envs.base import Environment


def positional_credit(response: str, target: str, length_penalty: float) -> float:
    """Fraction of target positions matched, minus ``length_penalty`` per character of length error."""
    if not target:
        raise ValueError("target must be a non-empty string")
    # Lengths may differ: the overlap is scored, the length error is penalised below.
    hits = sum(1 for r, t in zip(response, target, strict=False) if r == t)
    return hits / len(target) - length_penalty * abs(len(response) - len(target))


class _StringTask(Environment):
    """Shared prompt making for the copy and reverse tasks: '<chars><separator>'."""

    separator = "="
    sample_special_tokens = False

    # long_tail: per-prompt token budgets (metadata "max_tokens", honoured by the generator):
    # most prompts get the short one, a few a budget 6x longer, as in real workloads where
    # some prompts make the model ramble; synchronous trainers wait for those every step.
    LONG_TAIL_BUDGETS = ((0.9, 8), (0.1, 48))

    def __init__(
        self,
        min_len: int = 3,
        max_len: int = 5,
        alphabet: str = "abcde",
        length_penalty: float = 0.05,
        long_tail: bool = False,
    ):
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        if not alphabet or self.separator in alphabet:
            raise ValueError(f"alphabet {alphabet!r} must be non-empty and not contain {self.separator!r}")
        if length_penalty < 0:
            raise ValueError(f"length_penalty={length_penalty}: must be >= 0")
        self.min_len, self.max_len = min_len, max_len
        self.alphabet = alphabet
        self.length_penalty = length_penalty
        self.long_tail = long_tail

    def target_of(self, chars: str) -> str:
        raise NotImplementedError

    def target_length(self) -> float:
        return (self.min_len + self.max_len) / 2

    def make_prompt(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        n = rng.randint(self.min_len, self.max_len)
        chars = "".join(rng.choice(self.alphabet) for _ in range(n))
        metadata: dict[str, Any] = {"target": self.target_of(chars)}
        if self.long_tail:
            weights, budgets = zip(*self.LONG_TAIL_BUDGETS, strict=True)
            metadata["max_tokens"] = rng.choices(budgets, weights=weights)[0]
        return chars + self.separator, metadata

    def reward(self, prompt: str, response: str, metadata: dict[str, Any]) -> float:
        target = metadata.get("target")
        if target is None:  # prompts from a file: derive the target from the prompt itself
            if not prompt.endswith(self.separator):
                raise ValueError(f"prompt {prompt!r} does not end with {self.separator!r}")
            target = self.target_of(prompt[: -len(self.separator)])
        return positional_credit(response, target, self.length_penalty)


class CopyEnv(_StringTask):
    """'abc=' -> 'abc'."""

    separator = "="

    def target_of(self, chars: str) -> str:
        return chars


class ReverseEnv(_StringTask):
    """'abc<' -> 'cba'."""

    separator = "<"

    def target_of(self, chars: str) -> str:
        return chars[::-1]


class ArithmeticEnv(Environment):
    """'3+4=' -> '7', '9*8=' -> '72' with digit-wise partial credit (see ``positional_credit``)."""

    sample_special_tokens = False

    def __init__(self, max_operand: int = 9, ops: str = "+-*", length_penalty: float = 0.05):
        if max_operand < 1:
            raise ValueError(f"max_operand={max_operand}: must be >= 1")
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"ops={ops!r}: must be a non-empty subset of '+-*'")
        self.max_operand, self.ops, self.length_penalty = max_operand, ops, length_penalty

    def target_length(self) -> float | None:
        """Mean answer length over the uniformly drawn (a, op, b) (None past ~100k cases)."""
        n = self.max_operand + 1
        if n * n * len(self.ops) > 100_000:
            return None
        lengths = [len(str(self.evaluate(a, op, b))) for a in range(n) for b in range(n) for op in self.ops]
        return sum(lengths) / len(lengths)

    @staticmethod
    def evaluate(a: int, op: str, b: int) -> int:
        return {"+": a + b, "-": a - b, "*": a * b}[op]

    def make_prompt(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.ops)
        return f"{a}{op}{b}=", {"target": str(self.evaluate(a, op, b))}

    def reward(self, prompt: str, response: str, metadata: dict[str, Any]) -> float:
        target = metadata.get("target")
        if target is None:
            expr = prompt.rstrip("=")
            for op in "+-*":
                left, sep, right = expr.partition(op)
                if sep and left.isdigit() and right.isdigit():
                    target = str(self.evaluate(int(left), op, int(right)))
                    break
            else:
                raise ValueError(f"prompt {prompt!r} is not of the form 'a+b=' / 'a-b=' / 'a*b='")
        return positional_credit(response, target, self.length_penalty)
