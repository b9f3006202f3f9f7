"""``rollout.env`` given as a mapping: an environment by name (``type``) with its keyword arguments.

    rollout:
      env: {type: verifiers, id: my_env, args: {turns: 2}}
      env: {type: tools, tools: ["my_pkg.tools:search"], reward: "my_pkg.rewards:answer"}

is read as ``env: verifiers`` with ``env_kwargs: {id: my_env, args: {turns: 2}}``, so every part
of asyncrl that names environments by a string (the registry, groups in Redis, the run summary)
keeps doing so; the command-line form ``rollout.env=verifiers rollout.env_kwargs={id: ..., args:
...}`` is the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncrl.config.base import ConfigError, check_import_path


def env_mapping(data: Any) -> Any:
    """A raw rollout section whose ``env`` is ``{type: NAME, **kwargs}`` -> ``env: NAME`` and
    ``env_kwargs: kwargs`` (anything else unchanged)."""
    if not isinstance(data, dict) or not isinstance(data.get("env"), dict):
        return data
    kwargs = dict(data["env"])
    name = kwargs.pop("type", None)
    if not isinstance(name, str) or not name:
        raise ConfigError("rollout.env: a mapping needs 'type', the environment's name or import path")
    if data.get("env_kwargs"):
        raise ConfigError(
            f"rollout.env={{type: {name}, ...}} carries its own keyword arguments: "
            f"set them there or in rollout.env_kwargs, not both"
        )
    return {**data, "env": name, "env_kwargs": kwargs}


def check_library_env(env: str, kwargs: Mapping[str, Any], prompts: str | None) -> None:
    """A library environment's id names a module that can be found, and its args are a mapping."""
    if env != "verifiers":
        return
    ident, args = kwargs.get("id"), kwargs.get("args", {})
    if unknown := sorted(set(kwargs) - {"id", "args"}):
        raise ConfigError(f"rollout.env_kwargs: unknown keys {unknown} for rollout.env=verifiers (id, args)")
    if not isinstance(ident, str) or not ident:
        raise ConfigError(f"rollout.env.id={ident!r}: name the module exposing load_environment(**args)")
    check_import_path("rollout.env.id", f"{ident}:load_environment")
    if not isinstance(args, Mapping):
        raise ConfigError(f"rollout.env.args={args!r}: must be a mapping of load_environment's keyword arguments")
    if prompts:
        raise ConfigError(
            f"rollout.prompts={prompts!r}: a verifiers environment's taskset gives its prompts; unset rollout.prompts"
        )
