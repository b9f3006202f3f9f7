"""What every config section shares: the error type, the section base model, the built-in
name lists and the small checks the validators use. Imports neither torch nor Ray."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from pydantic import GetCoreSchemaHandler
from pydantic_core import PydanticCustomError, core_schema

from asyncrl.algo.params import Params, is_import_path
from asyncrl.infra import ExpectedFailure, redact_url

# Names the registries in asyncrl.algo ship with, kept here so that validating a config never
# imports torch; tests/unit check they equal the registries' keys. The policy losses' names
# come from their schema (asyncrl.algo.params).
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae", "maxrl")
OUTCOME_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "maxrl")
# Estimators whose baseline is the other samples of the same prompt: useless for groups of one.
GROUP_BASELINE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "maxrl")
KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
LOSS_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean", "token_mean_per_microbatch")
ENVIRONMENTS = ("copy", "reverse", "arithmetic", "gsm8k", "math", "countdown_chat", "tools", "verifiers", "code")
PROMPT_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?")


class ConfigError(ValueError, ExpectedFailure):
    """A config value is wrong. The message names the field, the value and what is allowed."""

    label = "config error"


@dataclass(frozen=True)
class Secret:
    """Marks a config field whose value must not leave the run's 0600 config.yaml (put it in the
    field's type: ``Annotated[str | None, SECRET]``); asyncrl.config.secrets.redact_config reads
    the marks. ``url``: the value is a URL, shown with its credentials removed; otherwise the
    whole value is replaced.

    A text secret takes a string only: unquoted in YAML, some passwords become numbers, dates
    or booleans (``12:30:45`` is 45045), which the sections' number-to-text rule would
    otherwise take silently as another password. Errors about a secret never show its value
    (asyncrl.config.load)."""

    url: bool = False

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        schema = handler(source)
        if source is str or str in get_args(source):
            return core_schema.no_info_before_validator_function(_text_only, schema)
        return schema


SECRET_NOT_TEXT = "secret_not_text"
"""The error type of a text secret given as something else (asyncrl.config.load words it)."""


def _text_only(value: Any) -> Any:
    if value is not None and not isinstance(value, str):
        raise PydanticCustomError(SECRET_NOT_TEXT, "a secret must be a string")
    return value


SECRET = Secret()
CREDENTIALS_URL = Secret(url=True)


class Section(Params):
    """A config section: unknown keys are errors, the docstring under a field is its description
    (`asyncrl train --help-config`), a number given for a text field is its text (`run_name=1`);
    the same model settings as the algo layer's parameter types, which the config holds."""

    def __repr_args__(self) -> Any:
        # repr() and str() of a section (a debug log line, a traceback's locals) keep its
        # secrets out as config.yaml's readers alone see them (asyncrl.config.secrets).
        for name, value in super().__repr_args__():
            field = type(self).model_fields.get(name) if name else None
            mark = next((m for m in field.metadata if isinstance(m, Secret)), None) if field else None
            if mark is None or value is None:
                yield name, value
            else:
                yield name, redact_url(value) if mark.url and isinstance(value, str) else "<redacted>"


def check_import_path(field_name: str, path: str) -> None:
    """A 'package.module:name' whose module can be found (not imported: that may need torch)."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ConfigError(f"{field_name}={path!r}: an import path must look like 'package.module:name'")
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"{field_name}={path!r}: module {module!r} {not_on_path(module)}")


def not_on_path(module: str) -> str:
    """The end of a message for a module Python cannot find, with how to make it findable."""
    top = module.partition(".")[0]
    return (
        f"cannot be found on the Python path: run from the directory holding {top}/ (or {top}.py) "
        f"with PYTHONPATH=. (e.g. `PYTHONPATH=. asyncrl train ...`), or install the package that provides it"
    )


def one_of(name: str, value: str, allowed: tuple[str, ...], import_path_ok: bool = False) -> None:
    if import_path_ok and is_import_path(value):
        check_import_path(name, value)
        return
    if value not in allowed:
        extra = " or an import path 'package.module:name'" if import_path_ok else ""
        raise ConfigError(f"{name}={value!r}: must be one of {', '.join(allowed)}{extra}")


def ordered(low_name: str, low: float, high_name: str, high: float) -> None:
    if not low < high:
        raise ConfigError(f"{low_name}={low!r} must be < {high_name}={high!r}")


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]; '' -> []. ValueError on anything else."""
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{text!r}: expected core numbers and ranges like '0-2,5'")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{text!r}: range {part!r} runs backwards")
        cores += range(first, last + 1)
    return sorted(set(cores))


def cpu_list(name: str, text: str) -> str:
    """A core list field's text, checked (ConfigError naming ``name``)."""
    try:
        parse_cpu_list(text)
    except ValueError as e:
        raise ConfigError(f"{name}={e}") from None
    return text


def custom_resources(name: str, res: dict[str, Any]) -> dict[str, Any]:
    """A `resources` field: custom Ray resource names with positive amounts (ConfigError naming ``name``)."""
    for key, amount in res.items():
        if key in ("CPU", "GPU", "memory") or not isinstance(amount, (int, float)) or not amount > 0:
            raise ConfigError(
                f"{name}.{key}={amount!r}: must be a custom resource name with an amount > 0 "
                f"(CPUs and GPUs are set by cpus_per_* / gpus_per_*)"
            )
    return res


def is_hub_id(source: str) -> bool:
    """'owner/name' or 'owner/name:config' that is not a path on this machine (asyncrl.rollout.prompts
    loads it with ``datasets``)."""
    return bool(HUB_ID.fullmatch(source)) and not source.endswith(PROMPT_FILE_SUFFIXES) and not Path(source).exists()


def prompt_source(name: str, value: str | None) -> str | None:
    """A prompt source is an existing path or a hub id; anything else fails here, not in a generator."""
    if value is None or Path(value).exists() or is_hub_id(value):
        return value
    raise ConfigError(f"{name}={value!r}: no such file or directory, nor a hub dataset id 'owner/name[:config]'")
