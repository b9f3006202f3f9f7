"""What an elastic generator may take from the job's published config: only what its own host
allowed.

    allow = ImportAllowList.build(["my_pkg.rewards:exact_match"], config_files=["job.yaml"])
    allow.check(named_imports(data))     # the raw config from Redis, before it is parsed
    allow.check_inputs(data)             # engine settings and prompt sources
    cfg = config_from_dict(data)
    allow.check(typed_imports(cfg))      # the parsed config names nothing else

`asyncrl generate` builds its config from what the trainer published in Redis. A config in Redis
is data that any process that reached Redis may have written, so the generator

- loads an import path only if it was given that path itself: ``--allow-import PATH`` or a
  config file of its own (``--allow-imports-from``). Built-in names (``rollout.env: copy``,
  ``policy_loss: ppo``) are not import paths and are always allowed. vLLM engine settings that
  name code (worker classes, logits processors) count as import paths; ``trust_remote_code``
  (the model folder's own Python) needs ``--trust-remote-code``;
- takes only the vLLM engine settings that cannot name code or files (asyncrl.control.engine_keys),
  any other only with ``--allow-engine-key KEY`` (or the same setting in its own config file);
- reads prompts only from a source its host named: ``--allow-prompts SOURCE`` (or the same
  ``rollout.prompts`` in its own config file). Without one it reads no file at all.

The checks run before the config is parsed: parsing looks each module up, and
``importlib.util.find_spec`` imports a dotted path's parent packages (their code runs).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from asyncrl.algo.params import is_import_path
from asyncrl.config import Config, ConfigError
from asyncrl.config.tool_env import TOOLS_ENV
from asyncrl.control.engine_keys import refused_engine_keys

CODE_ENGINE_KWARGS = ("worker_cls", "worker_extension_cls", "logits_processors")
"""vLLM engine arguments whose values vLLM imports by qualified name."""
REMOTE_CODE = "trust_remote_code"


@dataclass(frozen=True)
class ImportPath:
    """One piece of code a config names: where (``rollout.env``) and what (``pkg.mod:Env``)."""

    field: str
    path: str


def named_imports(data: Any) -> list[ImportPath]:
    """Every import path in a raw config mapping (JSON or YAML, not yet validated)."""
    found: list[ImportPath] = []
    algo, rollout = _section(data, "algo"), _section(data, "rollout")

    def add(field: str, value: Any, always: bool = False) -> None:
        if isinstance(value, str) and (always or is_import_path(value)):
            found.append(ImportPath(field, value))

    env, env_kwargs = rollout.get("env"), rollout.get("env_kwargs")
    if isinstance(env, Mapping):  # {type: NAME, **kwargs}, not yet folded by the config
        env, env_kwargs = env.get("type"), env
    add("rollout.env", env)
    if env == TOOLS_ENV and isinstance(env_kwargs, Mapping):  # each tool and the reward are imported
        tools = env_kwargs.get("tools")
        for i, path in enumerate(tools if isinstance(tools, list) else [tools]):
            add(f"rollout.env_kwargs.tools[{i}]", path, always=True)
        add("rollout.env_kwargs.reward", env_kwargs.get("reward"), always=True)
        add("rollout.env_kwargs.parser", env_kwargs.get("parser"))
    ident = env_kwargs.get("id") if env == "verifiers" and isinstance(env_kwargs, Mapping) else None
    if isinstance(ident, str):  # a library environment's load_environment is user code
        add("rollout.env.id", f"{ident}:load_environment", always=True)
    rewards = rollout.get("rewards")
    for i, spec in enumerate(rewards if isinstance(rewards, list) else []):
        add(f"rollout.rewards[{i}].fn", spec.get("fn") if isinstance(spec, Mapping) else spec, always=True)
    add("algo.advantage_estimator", algo.get("advantage_estimator"))
    loss = algo.get("policy_loss")
    add("algo.policy_loss", loss.get("type") if isinstance(loss, Mapping) else loss)
    found += _engine_imports(rollout.get("engine_kwargs"))
    return found


def typed_imports(cfg: Config) -> list[ImportPath]:
    """The same, read from a parsed config: a second look that a config parsed into nothing
    the raw look missed."""
    return named_imports(cfg.to_dict())


def wants_remote_code(data: Any) -> bool:
    kwargs = _section(data, "rollout").get("engine_kwargs")
    return isinstance(kwargs, Mapping) and bool(kwargs.get(REMOTE_CODE))


def _section(data: Any, name: str) -> Mapping[str, Any]:
    section = data.get(name) if isinstance(data, Mapping) else None
    return section if isinstance(section, Mapping) else {}


def _engine_imports(kwargs: Any) -> list[ImportPath]:
    if not isinstance(kwargs, Mapping):
        return []
    found = []
    for key in CODE_ENGINE_KWARGS:
        value = kwargs.get(key)
        values = value if isinstance(value, list) else [value]
        for i, v in enumerate(values):
            if v is None or v == "auto":  # "auto": vLLM picks its own worker
                continue
            where = f"rollout.engine_kwargs.{key}" + (f"[{i}]" if isinstance(value, list) else "")
            found.append(ImportPath(where, v if isinstance(v, str) else repr(v)))
    return found


@dataclass(frozen=True)
class ImportAllowList:
    """What this host allows the job's config: import paths, whether a model folder's own code
    may run, engine settings beyond the safe ones, and prompt sources."""

    paths: frozenset[str] = frozenset()
    remote_code: bool = False
    engine_keys: frozenset[str] = frozenset()
    """Engine settings taken with any value (``--allow-engine-key``)."""
    engine_values: frozenset[tuple[str, str]] = frozenset()
    """(key, value as canonical JSON): settings taken with exactly the value a config file of
    this host gives them."""
    prompt_sources: frozenset[str] = frozenset()
    """Prompt sources as this host names them (``--allow-prompts``); compared by resolved path."""

    @classmethod
    def build(
        cls,
        paths: Sequence[str] = (),
        config_files: Sequence[str | Path] = (),
        remote_code: bool = False,
        *,
        engine_keys: Sequence[str] = (),
        prompt_sources: Sequence[str] = (),
    ) -> ImportAllowList:
        """`paths` as given (``--allow-import``) plus every import path, engine setting and
        prompt source named in each config file (YAML or JSON, as `asyncrl train` reads it;
        ConfigError if unreadable)."""
        allowed, sources = set(paths), set(prompt_sources)
        values: set[tuple[str, str]] = set()
        for file in config_files:
            data = _read_config(Path(file))
            allowed.update(p.path for p in named_imports(data))
            remote_code = remote_code or wants_remote_code(data)
            rollout = _section(data, "rollout")
            kwargs = rollout.get("engine_kwargs")
            if isinstance(kwargs, Mapping):
                values.update((str(k), canonical(v)) for k, v in kwargs.items())
            if isinstance(rollout.get("prompts"), str):
                sources.add(rollout["prompts"])
        return cls(frozenset(allowed), remote_code, frozenset(engine_keys), frozenset(values), frozenset(sources))

    def check(self, found: Iterable[ImportPath], *, remote_code: bool = False) -> None:
        """ConfigError naming the first path not allowed, and how to allow it."""
        for item in found:
            if item.path not in self.paths:
                raise ConfigError(
                    f"the job's config names {item.field}={item.path!r}, an import path this generator was "
                    f"not given: it loads code only from paths allowed on its own host; if you trust it, "
                    f"run asyncrl generate --allow-import {item.path} (or --allow-imports-from CONFIG)"
                )
        if remote_code and not self.remote_code:
            raise ConfigError(
                f"the job's config sets rollout.engine_kwargs.{REMOTE_CODE}=true, which runs the model "
                f"folder's own Python code: if you trust it, run asyncrl generate --trust-remote-code"
            )

    def check_inputs(self, data: Any) -> None:
        """ConfigError naming the first engine setting or prompt source of the raw config `data`
        this host does not take, and how to allow it."""
        rollout = _section(data, "rollout")
        refused = refused_engine_keys(
            rollout.get("engine_kwargs"),
            # --trust-remote-code decides that one; the import allow-list (check) those naming code.
            allowed_keys=self.engine_keys | {REMOTE_CODE, *CODE_ENGINE_KWARGS},
            allowed_values=self.engine_values,
            canonical=canonical,
        )
        if refused:
            where = "rollout.engine_kwargs" + (f".{refused[0].key}" if refused[0].key else "")
            raise ConfigError(
                f"the job's config sets {where}, which {refused[0].why}: vLLM may load code or read files "
                f"through engine settings; if you trust it, run asyncrl generate --allow-engine-key "
                f"{refused[0].key or 'KEY'} (or --allow-imports-from CONFIG)"
            )
        self.check_prompts(rollout.get("prompts"))

    def check_prompts(self, source: Any) -> None:
        if source is None:
            return  # the environment makes the prompts: no file is read
        if not isinstance(source, str):
            raise ConfigError(f"the job's config sets rollout.prompts to a {type(source).__name__}, not a source")
        if _resolved(source) not in {_resolved(s) for s in self.prompt_sources}:
            raise ConfigError(
                f"the job's config names rollout.prompts={source!r}, a prompt source this generator was not "
                f"given: it reads prompts only from sources allowed on its own host; if you trust it, run "
                f"asyncrl generate --allow-prompts {source} (or --allow-imports-from CONFIG)"
            )


def canonical(value: Any) -> str:
    """A JSON value as one text, so two spellings of the same value compare equal."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


def _resolved(source: str) -> str:
    # The same file by any spelling (relative, ./, a symlink) compares equal; a hub id, or a path
    # not there, is compared as written.
    return os.path.realpath(source) if os.path.exists(source) else source


def _read_config(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"--allow-imports-from {str(path)!r}: cannot read it: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--allow-imports-from {str(path)!r} is not valid YAML: {e}") from None
