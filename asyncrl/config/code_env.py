"""The code environment's settings (``rollout.env: code``), checked with the config.

    rollout:
      env: code
      env_kwargs: {timeout_s: 2, memory_mb: 256, all_or_nothing: false}
      prompts: examples/code/problems.jsonl

A bad key or value is one line at config load, naming the field (not a traceback in a
generator after Ray started). The problem file's reader lives here too, so that the config
load reads a local problem file through with the same checks the environment makes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator

from asyncrl.config.base import ConfigError, Section

CODE_ENV = "code"


class CodeEnvConfig(Section):
    """rollout.env_kwargs of the code environment (asyncrl.rollout.envs.code)."""

    timeout_s: float = Field(2.0, ge=0.5, le=600)
    """Wall-clock seconds per test run, starting Python included (about 0.1 s: less than 0.5
    would time every program out); CPU seconds are limited to the same, rounded up. Past it the
    run's processes are killed and the response scores violation_reward."""
    memory_mb: int = Field(256, ge=32, le=1 << 20)
    """Address space per process of the program (RLIMIT_AS)."""
    max_output_bytes: int = Field(1 << 20, ge=1, le=1 << 30)
    """stdout (and stderr) read per run; more is a violation and kills the run."""
    max_file_bytes: int = Field(1 << 20, ge=0, le=1 << 40)
    """Largest file the program may write (RLIMIT_FSIZE)."""
    max_processes: int = Field(8, ge=1, le=1 << 16)
    """Processes and threads the program may run at once (RLIMIT_NPROC on a uid of its own)."""
    max_open_files: int = Field(64, ge=8, le=1 << 20)
    """RLIMIT_NOFILE (at most the kernel's default fs.nr_open: a higher one fails every run)."""
    max_disk_bytes: int = Field(16 << 20, ge=1 << 20, le=1 << 34)
    """With a mount namespace (root): the size of each private tmpfs it writes to (its directory,
    /tmp, /var/tmp, /dev/shm, /run/lock), host memory while it runs, gone afterwards."""
    max_concurrent: int = Field(default_factory=lambda: max(1, os.cpu_count() or 1), ge=1, le=256)
    """Programs running at once per generator process (reward threads beyond wait for a slot)."""
    max_tests: int = Field(32, ge=1)
    """Tests run per response (the first ones); the reward still divides by all of them."""
    all_or_nothing: bool = False
    """1 only when every test passes; false: the fraction of tests passed."""
    violation_reward: float = Field(0.0, allow_inf_nan=False)
    """The reward of a response whose program broke a sandbox limit (timeout, memory, output...)."""
    hide: list[str] = Field(default_factory=list)
    """Directories the programs must not see, each covered by an empty tmpfs (mount namespace
    only, i.e. root): the problems' own files above all, whose expected outputs a program could
    otherwise look up and print (a world-readable checkout is readable to its uid). Absolute
    paths: a generator may run in another working directory."""

    @field_validator("hide")
    @classmethod
    def _directories(cls, paths: list[str]) -> list[str]:
        out = []
        for p in paths:
            full = os.path.realpath(p)
            if not os.path.isabs(p) or full == "/" or not os.path.isdir(full):
                raise ValueError(f"{p!r} is not an absolute path of a directory other than / (a tmpfs covers each)")
            out.append(full)
        return out


def code_env_config(env_kwargs: dict[str, Any], where: str = "rollout.env_kwargs") -> CodeEnvConfig:
    """The settings; ConfigError naming the field and the environment."""
    try:
        return CodeEnvConfig.model_validate(env_kwargs)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{where}.{loc}: {first['msg']} (rollout.env=code)") from None


def check_code_prompts(prompts: str | None, prompt_field: str) -> None:
    """A local JSONL problem file is read through at config load: a malformed line or a
    problem without valid tests is one line naming file:line, before anything starts."""
    if prompts is None:
        raise ConfigError("rollout.env=code needs rollout.prompts: a JSONL file of problems with 'tests'")
    if not prompts.endswith(".jsonl") or not os.path.isfile(prompts):
        return  # other sources' records are checked as they are read (a bad one fails its sample)
    try:
        load_problems(prompts, prompt_field)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"rollout.prompts: {e}") from None


def parse_tests(value: Any, where: str = "tests") -> list[tuple[str, str]]:
    """A problem's tests, [{"input": str, "output": str}, ...] -> [(input, output)]; ValueError
    naming ``where`` and what is wrong."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: expected a non-empty list of {{'input': str, 'output': str}}, got {value!r:.100}")
    tests = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or not isinstance(t.get("input"), str) or not isinstance(t.get("output"), str):
            raise ValueError(f"{where}[{i}]: expected {{'input': str, 'output': str}}, got {t!r:.100}")
        tests.append((t["input"], t["output"]))
    return tests


def load_problems(path: str | Path, prompt_field: str = "prompt") -> list[dict[str, Any]]:
    """Every problem of a JSONL file, each line checked: ValueError naming file:line."""
    problems = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            if not isinstance(record.get(prompt_field), str):
                raise ValueError(f"{where}: no {prompt_field!r} string (keys: {', '.join(record) or 'none'})")
            parse_tests(record.get("tests"), f"{where}: tests")
            problems.append(record)
    if not problems:
        raise ValueError(f"{path}: no problems")
    return problems
