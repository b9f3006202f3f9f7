"""``rollout.env`` given as a mapping: an environment from a library, by type.

    rollout:
      env: {type: verifiers, id: my_env, args: {turns: 2}}

is read as ``env: verifiers`` with ``env_kwargs: {id: my_env, args: {turns: 2}}``, so every part
of asyncrl that names environments by a string (the registry, groups in Redis, the run summary)
keeps doing so; the command-line form ``rollout.env=verifiers rollout.env_kwargs={id: ..., args:
...}`` is the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncrl.config.base import ConfigError, check_import_path

LIBRARY_TYPES = ("verifiers",)
SPEC_KEYS = ("type", "id", "args")


def expand_env_spec(data: Any) -> Any:
    """A rollout section whose ``env`` is a mapping -> the same with ``env``/``env_kwargs`` strings."""
    if not isinstance(data, Mapping) or not isinstance(data.get("env"), Mapping):
        return data
    spec = dict(data["env"])
    if unknown := sorted(set(spec) - set(SPEC_KEYS)):
        raise ConfigError(f"rollout.env: unknown keys {unknown}; a library environment is {{type, id, args}}")
    kind = spec.get("type")
    if kind not in LIBRARY_TYPES:
        raise ConfigError(f"rollout.env.type={kind!r}: must be one of {', '.join(LIBRARY_TYPES)}")
    if data.get("env_kwargs"):
        raise ConfigError("rollout.env_kwargs: give a library environment's arguments as rollout.env.args")
    out = dict(data)
    out["env"] = kind
    out["env_kwargs"] = {"id": spec.get("id"), "args": spec.get("args") or {}}
    return out


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
