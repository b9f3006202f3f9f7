"""The tool-use environment's settings (``rollout.env: tools``), checked with the config.

    rollout:
      chat_template: true
      env: {type: tools, tools: ["asyncrl.rollout.envs.calculator:calculator"], reward: "my_pkg:answer_reward"}

``rollout.env`` given as a mapping is the environment's name (``type``) with its keyword
arguments (asyncrl.config.envspec folds it into ``env`` and ``env_kwargs``).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError

from asyncrl.config.base import ConfigError, Section, check_import_path

TOOLS_ENV = "tools"


class ToolEnvConfig(Section):
    """rollout.env_kwargs of the tools environment (asyncrl.rollout.envs.tools)."""

    tools: list[str] = Field(min_length=1)
    """Import paths 'package.module:function'. Each function's signature and docstring (Google
    style, an 'Args:' line per parameter) become the schema the chat template shows the model."""
    reward: str
    """Import path of the episode's reward, TRL's signature: fn(prompts, completions, **columns)
    with the final reply as the completion; may be `async def`."""
    parser: str = "hermes"
    """The tool-call format the chat template teaches: a registered name (hermes:
    <tool_call>{json}</tool_call>) or an import path 'package.module:function'."""
    max_turns: int = Field(4, ge=1)
    """Model turns per episode; the last one's tool calls are not run."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """Seconds one tool call may run; past it the model is told the call timed out."""
    reward_timeout_s: float = Field(30.0, gt=0)
    """Seconds the reward may run; past it (or if it raises) the episode's reward is NaN and it
    is left out of the loss."""
    max_calls_per_turn: int = Field(8, ge=1)
    """Calls run per reply; the model is told the rest were not run."""
    max_output_chars: int = Field(4000, ge=1)
    """A tool's output is cut to this many characters (the model is told so)."""
    tool_workers: int = Field(8, ge=1)
    """Threads per generator process running tool calls (a hung call's thread is replaced)."""
    system: str | None = None
    """A system message put before every prompt (the template merges the tool schemas with it)."""


def tool_env_config(env_kwargs: dict[str, Any], where: str = "rollout.env_kwargs") -> ToolEnvConfig:
    """The settings, with import paths checked (found, not imported); ConfigError naming the field."""
    try:
        spec = ToolEnvConfig.model_validate(env_kwargs)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{where}.{loc}: {first['msg']} (rollout.env=tools)") from None
    for i, path in enumerate(spec.tools):
        check_import_path(f"{where}.tools[{i}]", path)
    check_import_path(f"{where}.reward", spec.reward)
    if ":" in spec.parser:
        check_import_path(f"{where}.parser", spec.parser)
    return spec
