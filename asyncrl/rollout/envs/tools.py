"""Tool use: a multi-turn environment where the model calls Python functions.

    rollout:
      chat_template: true
      prompts: examples/tools/calc_prompts.jsonl          # prompt + answer columns
      env:
        type: tools
        tools: ["asyncrl.rollout.envs.calculator:calculator", "my_pkg.tools:lookup"]
        reward: my_pkg.rewards:answer_matches            # fn(prompts, completions, **columns)
        parser: hermes                                   # <tool_call>{json}</tool_call>
        max_turns: 4
        tool_timeout_s: 10

An episode: the prompt is rendered with the tools' schemas (``apply_chat_template(...,
tools=...)``; each schema comes from the function's signature and docstring through
``transformers.utils.get_json_schema``). Each reply is parsed for calls (``tool_calls.py``);
every call runs off the generator's event loop and its output, or an error, goes back as a
``role: tool`` message, rendered by the template (several results of one reply together, as
Qwen's template groups them). A reply without calls is the final answer: the reward function
scores it and the episode ends. So does the ``max_turns``-th reply, whose calls are not run.
An episode that fills the context first (a policy that keeps calling tools) is scored the same
way on its last reply, and marked cut ("length", ``multiturn.run_trajectory``): looping on
tools until the budget runs out must not earn a free 0 where a wrong answer scores below it.

What the model is told instead of the generator failing: a call that cannot be read (bad
JSON, no name, an unclosed tag), an unknown tool, arguments the schema does not allow, a tool
that raises, and one that runs past ``tool_timeout_s``. Calls, errors and timeouts are counted
(``episode_counts``: the trainer's ``rollout/tool_calls``, ``rollout/tool_errors``,
``rollout/tool_timeouts``). A reward that raises or times out fails the episode's reward as any
failed reward does (``rollout/scoring.py``: NaN and left out of the loss, or
rollout.reward_on_failure; counted in rollout/reward_errors and rollout/reward_timeouts).

Tool output is context, never trained: the tool messages' tokens (and the template's own)
are observation tokens with loss mask 0; only the ids the engine sampled have mask 1
(``multiturn.to_interleaved_sample``).

Plain ``def`` tools run on a shared pool of daemon threads per process (``RewardPool``: a call
past its timeout is abandoned to its thread and a new thread takes its place); ``async def``
tools are awaited on the loop under a timeout. A tool that must be killable (a code sandbox)
should run its work in a subprocess of its own.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.config.tool_env import ToolEnvConfig, tool_env_config
from asyncrl.rollout.envs.base import RewardError, check_reward_value
from asyncrl.rollout.envs.chat import ChatTemplateError, ChatTurns, Message, Observation, TurnCodec
from asyncrl.rollout.envs.multiturn import MultiTurnEnvironment
from asyncrl.rollout.envs.reward_fns import WeightedRewards, resolve_function
from asyncrl.rollout.envs.tool_calls import BadCall, ToolCall, get_parser
from asyncrl.rollout.scoring import RewardPool, RewardTimeout

COUNT_NAMES = ("tool_calls", "tool_errors", "tool_timeouts")

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class Tool:
    """A function the model may call, and the JSON schema the chat template shows it."""

    path: str
    fn: Callable[..., Any]
    schema: dict[str, Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @property
    def params(self) -> list[str]:
        return list(self.schema["function"].get("parameters", {}).get("properties", {}))

    def check_arguments(self, args: dict[str, Any]) -> str | None:
        """Why ``args`` do not fit the schema (missing, unknown or mistyped), or None."""
        params = self.schema["function"].get("parameters", {})
        props: dict[str, Any] = params.get("properties", {})
        missing = [p for p in params.get("required", []) if p not in args]
        if missing:
            return f"missing argument(s) {', '.join(missing)}"
        unknown = [a for a in args if a not in props]
        if unknown:
            return f"unknown argument(s) {', '.join(unknown)}; {self.name} takes {', '.join(props) or 'none'}"
        for arg, value in args.items():
            if value is None and props[arg].get("nullable"):
                continue  # an Optional parameter: the schema the model was shown says null is fine
            want = props[arg].get("type")
            types = [want] if isinstance(want, str) else list(want or [])
            if types and not any(_is_json_type(value, t) for t in types):
                return f"argument {arg!r} is {json.dumps(value)}, expected {' or '.join(types)}"
        return None


def _is_json_type(value: Any, json_type: str) -> bool:
    if json_type in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _JSON_TYPES.get(json_type, (object,)))


@functools.lru_cache(maxsize=256)
def load_tool(path: str) -> Tool:
    """'package.module:function' -> a Tool (ValueError naming the path and what is wrong)."""
    # transformers only here: the config layer and --check's start must not import it.
    from transformers.utils import get_json_schema

    try:
        fn = resolve_function(path)
    except ValueError as e:
        raise ValueError(str(e).replace("reward function", "tool", 1)) from None
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ValueError(
            f"tool {path!r}: cannot make its schema: {e} (a tool needs type hints and a Google-style "
            f"docstring with an 'Args:' line per parameter)"
        ) from None
    return Tool(path, fn, schema)


_POOLS: dict[int, RewardPool] = {}
_POOLS_LOCK = threading.Lock()


def tool_pool(workers: int) -> RewardPool:
    """One pool per process (and size): environments are built per trajectory, threads are not."""
    with _POOLS_LOCK:
        if workers not in _POOLS:
            _POOLS[workers] = RewardPool(workers)
        return _POOLS[workers]


class ToolTurns(ChatTurns):
    """Chat turns rendered with the tool schemas (and a system message) in every conversation,
    the first prompt included; observations are ``role: tool`` messages."""

    def __init__(self, tokenizer, tools: list[dict[str, Any]], system: str | None = None):
        self.tools, self.system = tools, system
        super().__init__(tokenizer, role="tool")
        probe = [{"role": "user", "content": "0"}]
        if self._render(probe, generation_prompt=True) == self._render_without_tools(probe):
            raise ChatTemplateError(
                "the chat template ignores tools: the prompt it renders with the tool schemas is the one "
                "without them, so the model would never see the tools (use a tool-aware template)"
            )

    def prompt(self, text: str) -> list[int]:
        return self._ids(self._render([{"role": "user", "content": text}], generation_prompt=True))

    def _render(self, messages: list[Message], *, generation_prompt: bool) -> str:
        return self._apply(messages, self.tools, generation_prompt)

    def _render_without_tools(self, messages: list[Message]) -> str:
        return self._apply(messages, None, True)

    def _apply(self, messages: list[Message], tools: list[dict[str, Any]] | None, generation_prompt: bool) -> str:
        lead = [{"role": "system", "content": self.system}] if self.system else []
        try:
            return self.tokenizer.apply_chat_template(
                [*lead, *messages], tools=tools, add_generation_prompt=generation_prompt, tokenize=False
            )
        except Exception as e:  # the template's own error
            roles = [m["role"] for m in [*lead, *messages]]
            raise ChatTemplateError(f"the chat template cannot render the roles {roles} with tools: {e}") from e


class ToolEnv(MultiTurnEnvironment):
    """See the module doc. Built per trajectory (it holds one episode's state); the settings
    are ``ToolEnvConfig``'s."""

    observation_role = "tool"

    def __init__(self, **kwargs: Any):
        self.spec: ToolEnvConfig = tool_env_config(kwargs)
        tools = [load_tool(p) for p in self.spec.tools]
        self.tools = {t.name: t for t in tools}
        if len(self.tools) < len(tools):
            names = [t.name for t in tools]
            raise ValueError(f"rollout.env_kwargs.tools: two tools share a name ({names})")
        self.parse = get_parser(self.spec.parser)
        self.reward_fn = resolve_function(self.spec.reward)
        self.max_turns = self.spec.max_turns
        self.prompt, self.turn = "", 0
        self.metadata: dict[str, Any] = {}
        self.counts = dict.fromkeys(COUNT_NAMES, 0)

    def chat_tools(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def turn_codec(self, tokenizer, chat_template: bool) -> TurnCodec:
        if not chat_template:
            raise ChatTemplateError(
                "rollout.env=tools needs rollout.chat_template=true (the tool-call format is the template's)"
            )
        return ToolTurns(tokenizer, self.chat_tools(), self.spec.system)

    def episode_counts(self) -> dict[str, int]:
        return dict(self.counts)

    def reset(self, prompt: str, metadata: dict[str, Any]) -> str:
        self.prompt, self.metadata, self.turn = prompt, metadata, 0
        self.counts = dict.fromkeys(COUNT_NAMES, 0)
        self.reward_failure = None
        return prompt

    def step(self, response: str) -> tuple[str, float, bool]:
        raise TypeError("ToolEnv runs its tools off the loop: call astep")

    async def astep(self, response: str) -> tuple[Observation, float, bool]:
        self.turn += 1
        calls = self.parse(response).calls
        if not calls or self.turn >= self.max_turns:
            return "", await self._reward(response), True
        limit = self.spec.max_calls_per_turn
        outputs = list(await asyncio.gather(*(self._run(c) for c in calls[:limit])))
        for c in calls[limit:]:
            name = c.name if isinstance(c, ToolCall) else "?"
            outputs.append((name, f"error: not run: at most {limit} tool calls per reply"))
        return [{"role": "tool", "name": name, "content": text} for name, text in outputs], 0.0, False

    async def truncated(self, response: str) -> float:
        """Cut by the context budget: the last reply is the episode's answer, as at max_turns."""
        return await self._reward(response)

    async def _run(self, call: ToolCall | BadCall) -> tuple[str, str]:
        """(tool name, what the model is told) for one call; never raises."""
        self.counts["tool_calls"] += 1
        if isinstance(call, BadCall):
            self.counts["tool_errors"] += 1
            return "?", f"error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            self.counts["tool_errors"] += 1
            return call.name, f"error: unknown tool {call.name!r}; the tools are {', '.join(self.tools)}"
        problem = tool.check_arguments(call.arguments)
        if problem is not None:
            self.counts["tool_errors"] += 1
            return call.name, f"error: bad arguments for {call.name}: {problem}"
        try:
            out = await self._call(tool.fn, call.arguments, self.spec.tool_timeout_s)
        except RewardTimeout:
            self.counts["tool_timeouts"] += 1
            return call.name, f"error: {call.name} did not return within {self.spec.tool_timeout_s:g} s"
        except Exception as e:  # the tool's own failure: the model is told, the episode goes on
            self.counts["tool_errors"] += 1
            return call.name, f"error: {call.name} raised {type(e).__name__}: {e}"
        text = out if isinstance(out, str) else json.dumps(out, default=str)
        cap = self.spec.max_output_chars
        if len(text) > cap:
            text = text[:cap] + f"... (cut at {cap} characters)"
        return call.name, text

    async def _call(self, fn: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float) -> Any:
        if inspect.iscoroutinefunction(fn):
            try:
                return await asyncio.wait_for(fn(**kwargs), timeout_s)
            except TimeoutError:
                raise RewardTimeout(f"did not return within {timeout_s:g} s") from None
        return await tool_pool(self.spec.tool_workers).call(fn, (), kwargs, timeout_s)

    async def _reward(self, response: str) -> float:
        """The reward function on the final reply; NaN and ``reward_failure`` set if it fails
        (the generator applies the shared rules: counts, one log line per kind, on_failure)."""
        kwargs = WeightedRewards.call_kwargs(self.prompt, response, self.metadata)
        name = self.spec.reward
        try:
            out = await self._call(self.reward_fn, kwargs, self.spec.reward_timeout_s)
            value = out[0] if isinstance(out, (list, tuple)) and len(out) == 1 else out
            return check_reward_value(name, value)
        except RewardTimeout as e:
            self.reward_failure = RewardTimeout(f"{name} {e}")
        except RewardError as e:
            self.reward_failure = e
        except Exception as e:  # user code: its failure voids this episode's reward, not the generator
            self.reward_failure = RewardError(f"{name} raised {type(e).__name__}: {e}")
        return math.nan
