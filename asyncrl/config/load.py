"""Reading a config: YAML, `a.b.c=value` overrides, and pydantic's errors turned into one
line that names the field, the value and the reason.

    cfg = load_config("configs/demo.yaml", ["control.max_staleness=2", "learner.lr=1e-5"])
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from asyncrl.algo.params import LOSS_FIELDS, TAGS, WHERE, LossParams, ParamsError
from asyncrl.algo.params import params_for as algo_params_for
from asyncrl.config.base import SECRET_NOT_TEXT, ConfigError
from asyncrl.config.losses import wrong_loss_field
from asyncrl.config.rollout import REWARD_KINDS
from asyncrl.config.tree import Config
from asyncrl.rundir.store import ObjectPath, StorageError, is_url, run_path

_EXPECTED = {
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "string_type": "expected a string",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "list_type": "expected a list",
    "tuple_type": "expected a list",
    "finite_number": "expected a finite number",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _path(loc: tuple[Any, ...]) -> tuple[str, tuple[Any, ...]]:
    """'algo.policy_loss.eps_clip_high' for a location; the loss's union tag is left out."""
    parts: list[Any] = []
    text = ""
    for i, key in enumerate(loc):
        if i and loc[i - 1] == "policy_loss" and key in TAGS:
            continue
        parts.append(key)
        if i and isinstance(loc[i - 1], int) and key in REWARD_KINDS:
            continue  # a rollout.rewards entry's kind: in parts (for its model), not in the text
        if isinstance(key, int):
            text = f"{text or 'config root'}[{key}]"
        elif isinstance(key, str) and key.isidentifier():
            text += f".{key}" if text else key
        else:
            text = f"{text or 'config root'}[{key!r}]"
    return text, tuple(parts)


def _section_at(parts: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model at a location (list items are their element's model), or None."""
    cls: Any = Config
    for key in parts:
        if isinstance(key, int):
            continue
        if key in REWARD_KINDS and not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            cls = REWARD_KINDS[key]  # the tagged union of rollout.rewards: the entry's own kind
            continue
        field = cls.model_fields.get(key) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        if field is None:
            return None
        cls = field.annotation
        if get_origin(cls) is list:
            cls = get_args(cls)[0]
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def _unknown(loc: tuple[Any, ...]) -> str:
    where, parts = _path(loc)
    parent, key = parts[:-1], parts[-1]
    if parent[-1:] == ("policy_loss",) and len(loc) > len(parts):
        return wrong_loss_field(loc[len(parent)], str(key))
    cls = _section_at(parent)
    if cls is None:
        return f"{where}: unknown field"
    names = [n for n in cls.model_fields]
    pool = names + ([f"policy_loss.{n}" for n in LOSS_FIELDS] if parent == ("algo",) else [])
    close = difflib.get_close_matches(str(key), [p.rpartition(".")[2] for p in pool], n=1)
    hint = ""
    if close:
        hint = f"did you mean {next(p for p in pool if p.rpartition('.')[2] == close[0])!r}? "
    what = "the config root" if not parent else cls.__name__
    return f"{where}: unknown field; {hint}{what} has: {', '.join(names)}"


def _message(err: Any) -> str:
    kind, loc, value, ctx = err["type"], tuple(err["loc"]), err.get("input"), err.get("ctx") or {}
    if kind == "value_error" and isinstance(ctx.get("error"), (ConfigError, ParamsError)):
        return str(ctx["error"])
    if kind == "extra_forbidden":
        return _unknown(loc)
    where, parts = _path(loc)
    if not where:
        where = "config root"
    if kind == "missing" and len(parts) > 1 and isinstance(parts[-1], int):
        # A fixed-length list (learner.betas) given too few values.
        cls, name = _section_at(parts[:-2]), parts[-2]
        field = cls.model_fields.get(name) if cls is not None and isinstance(name, str) else None
        n = len(get_args(field.annotation)) if field is not None else "more"
        return f"{_path(loc[:-1])[0]}: expected a list of {n} values"
    if kind == "missing":
        parent, cls = _path(loc[:-1])[0] or "config root", _section_at(parts[:-1])
        needs = [n for n, f in cls.model_fields.items() if f.is_required()] if cls is not None else []
        why = f" ({cls.__name__} needs: {', '.join(needs)})" if cls is not None else ""
        return f"{parent}: missing field {parts[-1]!r}{why}"
    if parts[-1:] == ("policy_loss",) or (len(parts) > 1 and parts[-2] == "policy_loss"):
        where = where if where.startswith(WHERE) else WHERE
    if kind == "invalid_key":
        return f"{where}: keys must be strings"
    if kind == SECRET_NOT_TEXT:
        return (
            f"{where}: a secret must be a string, got a {type(value).__name__}; quote it in YAML "
            "('...'): unquoted, YAML reads some passwords as numbers, dates or booleans"
        )
    if _is_secret(parts):
        return f"{where}: {_EXPECTED.get(kind) or err['msg']} (the value is a secret: not shown)"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()), "?")
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        return f"{where}={value!r}: must be {_BOUNDS[kind]} {bound}"
    if kind == "literal_error":
        return f"{where}={value!r}: must be one of {ctx.get('expected')}"
    if kind in ("too_short", "too_long"):
        size = ctx.get("max_length") if kind == "too_long" else ctx.get("min_length")
        return f"{where}={value!r}: expected a list of {size} values"
    reason = _EXPECTED.get(kind) or err["msg"]
    return f"{where}={value!r}: {reason}"


def _is_secret(parts: tuple) -> bool:
    """Whether a location is a secret field or inside one (storage_options' keys)."""
    from asyncrl.config.secrets import secret_fields  # it imports the tree this module builds

    names = tuple(p for p in parts if isinstance(p, str))
    return any(names[: len(path)] == path for path in secret_fields())


def config_error(e: ValidationError, prefix: tuple[str, ...] = ()) -> ConfigError:
    """One message for pydantic's errors (the first in full); `prefix` locates a model built on its own."""
    errors = [{**x, "loc": prefix + tuple(x["loc"])} for x in e.errors(include_url=False)]
    msg = _message(errors[0])
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more: {'; '.join(_message(x) for x in errors[1:4])})"
    return ConfigError(msg)


def params_for(name_or_path: str, **fields: Any) -> LossParams:
    """asyncrl.algo.params_for with the config's errors: a ConfigError naming the field."""
    try:
        return algo_params_for(name_or_path, **fields)
    except ParamsError as e:
        raise ConfigError(str(e)) from None
    except ValidationError as e:
        raise config_error(e, prefix=("algo", "policy_loss")) from None


_YAML_OPENERS = ("[", "{", '"', "'")
"""A value starting with one of these is meant as YAML (a list, a mapping, a quoted string):
one that does not parse is an error, not a string."""


def _parse_scalar(item: str, text: str) -> Any:
    """Parse the right-hand side of an `a.b.c=value` override with YAML's scalar rules; text
    that is not YAML stays a string unless it opens a list, a mapping or a quote."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        if text.lstrip().startswith(_YAML_OPENERS):
            raise ConfigError(f"override {item!r}: the value is not valid YAML: {_yaml_problem(e)}") from None
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `a.b.c=value` items into the YAML tree. A loss given by name (`policy_loss: sapo`)
    opens as {type: sapo} so that `algo.policy_loss.sapo_tau_pos=2` refines it."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected the form a.b.c=value")
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if part == "policy_loss" and isinstance(child, str):
                child = node[part] = {"type": child}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_scalar(item, raw)
    return data


def config_from_dict(data: Any) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"config root: expected a mapping of sections, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise config_error(e) from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's message on one line: where (1-based) and what, without its quoted excerpt."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        what = "; ".join(str(part) for part in (e.context, e.problem) if part)
        return f"line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}: {what}"
    return " ".join(str(e).split())


_FILE_PATHS = (("rollout", "prompts"), ("control", "eval_prompts"), ("rollout", "model"))
"""The fields of a config file that name an input on disk (a reward model's `model` too)."""


def _relative_to_file(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """A config file's relative input paths resolved against the file's directory when they
    exist there (`prompts: ../data/train.jsonl` next to the config works from any working
    directory); one that does not stays as written, relative to the working directory.
    Overrides on the command line are not touched: they are relative to the working directory."""

    def resolved(value: Any) -> Any:
        if not isinstance(value, str) or not value or os.path.isabs(value) or "://" in value:
            return value
        candidate = os.path.normpath(base / value)
        return candidate if os.path.exists(candidate) else value

    for section, key in _FILE_PATHS:
        node = data.get(section)
        if isinstance(node, dict) and key in node:
            node[key] = resolved(node[key])
    rewards = data.get("rollout", {}).get("rewards") if isinstance(data.get("rollout"), dict) else None
    for entry in rewards if isinstance(rewards, list) else []:
        if isinstance(entry, dict) and "model" in entry:
            entry["model"] = resolved(entry["model"])
    return data


def load_config(path: str | Path | ObjectPath | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (optional), apply `a.b.c=value` overrides, build and validate the tree."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(run_path(path).read_text())  # a run dir's config.yaml may be a URL
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist") from None
        except StorageError as e:
            raise ConfigError(str(e)) from None
        except OSError as e:  # a directory, no permission
            raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_yaml_problem(e)}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r}: expected a mapping of sections at the top")
        data = loaded if is_url(str(path)) else _relative_to_file(loaded, Path(str(path)).parent)
    data = apply_overrides(data, overrides or [])
    return config_from_dict(data)
