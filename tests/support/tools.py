"""Tools, a reward and a tool-aware tokenizer for the tool-use tests (nothing downloaded).

    tok = tool_tokenizer(tmp_dir)        # every printable character a token, <tool_call> tags, TOOLS_TEMPLATE

``TOOLS_TEMPLATE`` is shaped like Qwen2.5's (the Hermes format): the tool schemas as JSON in a
system turn, the model's calls as ``<tool_call>{json}</tool_call>`` in its reply, and the tool
results of one reply grouped into one user turn as ``<tool_response>...</tool_response>``.
Turns are ``<bos>role:content<eos>|`` as in tests/support/chat.py: the ``|`` after ``<eos>`` is
part of the end of a turn the engine never samples.
"""

from __future__ import annotations

import string
import time
from pathlib import Path

TOOLS_TEMPLATE = (
    "{%- if tools %}<bos>system:{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "Tools:\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    'Call one as <tool_call>{"name": NAME, "arguments": {...}}</tool_call><eos>|'
    "{%- elif messages[0].role == 'system' %}<bos>system:{{ messages[0].content }}<eos>|{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<bos>user:{% endif %}"
    "<tool_response>{{ m.content }}</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<eos>|{% endif %}"
    "{%- elif m.role != 'system' %}<bos>{{ m.role }}:{{ m.content }}<eos>|"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<bos>assistant:{% endif %}"
)
ALPHABET = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")


def tool_tokenizer(path: str | Path, template: str = TOOLS_TEMPLATE):
    """The tiny character tokenizer over every printable character (JSON needs quotes and
    braces), with ``<tool_call>``/``</tool_call>`` as added, non-special tokens (as in Qwen's
    tokenizers, so they survive ``skip_special_tokens``) and ``template``; saved and loaded back."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import AutoTokenizer

    from asyncrl.rollout.tiny import write_tokenizer

    tok = write_tokenizer(path, ALPHABET)
    # One token per character, newlines included ("." would leave "\n\n" as one unknown piece).
    tok._tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = template
    tok.save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


CAPITALS = {"france": "Paris", "peru": "Lima"}


def capital(country: str) -> str:
    """The capital city of a country.

    Args:
        country: The country's name in English, e.g. "france".
    """
    return CAPITALS[country.lower()]


def stats(values: list[float], scale: int = 1) -> dict:
    """The sum and maximum of some numbers, each times a scale.

    Args:
        values: The numbers.
        scale: What each number is multiplied by.
    """
    return {"sum": sum(values) * scale, "max": max(values) * scale}


def rounded(value: float, digits: int | None = None) -> str:
    """A number rounded to some digits (to a whole number when none are given).

    Args:
        value: The number.
        digits: How many digits after the point, or null for a whole number.
    """
    return str(round(value, digits))


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "rested"


async def slow_lookup(seconds: float) -> str:
    """Wait without blocking, then answer.

    Args:
        seconds: How long to wait.
    """
    import asyncio

    await asyncio.sleep(seconds)
    return "found"


def final_number(prompts, completions, answer, **columns):
    """1.0 if the last number of the final reply is the reference answer, else 0.0 (TRL's signature)."""
    words = completions[0].replace("=", " ").split()
    numbers = [w.strip(".,") for w in words if w.strip(".,").lstrip("-").isdigit()]
    return [1.0 if numbers and numbers[-1] == str(answer[0]) else 0.0]


def broken_reward(prompts, completions, **columns):
    raise RuntimeError("the verifier is down")


# The tiny model's alphabet has no quotes or braces: for episodes on its engine, a template that
# lists the tools by name, and a "format" in which every reply calls the calculator.
TINY_TOOLS_TEMPLATE = (
    "{%- if tools %}<bos>system:tools:{% for t in tools %} {{ t.function.name }}{% endfor %}<eos>|{%- endif %}"
    "{%- for m in messages %}<bos>{{ m.role }}:{{ m.content }}<eos>|{%- endfor %}"
    "{%- if add_generation_prompt %}<bos>assistant:{% endif %}"
)
TINY_CALL = "1+1"


def every_reply_calls(text: str):
    """A tool-call parser under which each reply calls calculator(TINY_CALL)."""
    from asyncrl.rollout.envs.tool_calls import ParsedReply, ToolCall

    return ParsedReply(text, (ToolCall("calculator", {"expression": TINY_CALL}),))


def signed_number(prompts, completions, answer, **columns):
    """1.0 for the right final number, -1.0 for anything else (a wrong answer scores below 0)."""
    return [1.0 if final_number(prompts, completions, answer)[0] == 1.0 else -1.0]


def slow_reward(prompts, completions, **columns):
    """A verifier that does not answer in time."""
    time.sleep(30)
    return [1.0]
