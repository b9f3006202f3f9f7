"""Reading the tool calls out of a model's reply, in the format its chat template teaches.

    parse = get_parser("hermes")               # a registered format, or 'package.module:function'
    reply = parse('2+2? <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>')
    reply.content                              # '2+2?'
    reply.calls                                # (ToolCall('calculator', {'expression': '2+2'}),)

    register_parser("my_format", my_parse)     # my_parse(text) -> ParsedReply

A call the model began but that cannot be read (bad JSON, no name, an unclosed tag) is a
``BadCall``, not an exception: the environment answers it with an error message as the tool's
output, so the model learns the format instead of the generator dying of it.

Hermes' format, which Qwen2.5/Qwen3, Hermes and many other templates teach: each call is a JSON
object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``.
Those tags must survive ``decode(..., skip_special_tokens=True)`` (the text environments see):
they do in Qwen's tokenizers, where they are added tokens but not special ones.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: a tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class BadCall:
    """A call the model began but that cannot be read; ``error`` says why (the model is told)."""

    text: str
    error: str


@dataclass(frozen=True)
class ParsedReply:
    """A reply split into its text and its calls, in the order they were written."""

    content: str
    calls: tuple[ToolCall | BadCall, ...] = ()


ToolCallParser = Callable[[str], ParsedReply]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"


def read_call(body: str) -> ToolCall | BadCall:
    """One call's JSON text -> a ToolCall, or a BadCall saying what is wrong with it."""
    text = body.strip()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BadCall(text, f"the call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict):
        return BadCall(text, f"the call is a JSON {type(obj).__name__}, expected an object with 'name' and 'arguments'")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return BadCall(text, "the call has no 'name' (a string naming the tool)")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return BadCall(text, f"the arguments of {name!r} are a string that is not a JSON object")
    if not isinstance(args, dict):
        return BadCall(text, f"the arguments of {name!r} are a JSON {type(args).__name__}, expected an object")
    return ToolCall(name, args)


def parse_hermes(text: str) -> ParsedReply:
    """``<tool_call>{json}</tool_call>`` blocks; an unclosed last block (the reply was cut, or the
    model stopped inside it) is a BadCall."""
    calls: list[ToolCall | BadCall] = []
    content: list[str] = []
    end = 0
    for m in _HERMES.finditer(text):
        content.append(text[end : m.start()])
        calls.append(read_call(m.group(1)))
        end = m.end()
    rest = text[end:]
    opened = rest.find(_HERMES_OPEN)
    if opened >= 0:
        content.append(rest[:opened])
        tail = rest[opened + len(_HERMES_OPEN) :].strip()
        calls.append(BadCall(tail, "the call's <tool_call> is never closed by </tool_call>"))
    else:
        content.append(rest)
    return ParsedReply("".join(content).strip(), tuple(calls))


PARSERS: dict[str, ToolCallParser] = {"hermes": parse_hermes}
"""Formats by name (rollout.env_kwargs.parser); extend with ``register_parser``."""


def register_parser(name: str, parser: ToolCallParser) -> None:
    """Add a format under ``name`` (a module that registers must be imported where generators
    run; an import path in the config needs no registration)."""
    if ":" in name:
        raise ValueError(f"parser name {name!r}: a name may not contain ':' (that marks an import path)")
    PARSERS[name] = parser


def get_parser(name: str) -> ToolCallParser:
    """A registered format or an import path 'package.module:function' (ValueError otherwise)."""
    if ":" not in name:
        if name not in PARSERS:
            raise ValueError(
                f"tool-call parser {name!r}: not a registered format ({', '.join(sorted(PARSERS))}) "
                f"nor an import path 'package.module:function'"
            )
        return PARSERS[name]
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # user code: whatever its import raises is this path's failure
        raise ValueError(f"tool-call parser {name!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"tool-call parser {name!r}: module {module_name!r} has no function {attr!r}")
    return fn
