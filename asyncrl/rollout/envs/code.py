"""Code problems: the model writes a Python program, run in a sandbox against stdin/stdout tests.

    rollout:
      env: code
      env_kwargs: {timeout_s: 2, memory_mb: 256, all_or_nothing: false}
      prompts: examples/code/problems.jsonl    # {"prompt": ..., "tests": [{"input": ..., "output": ...}]}

The program is the last fenced code block of the response (```python, ```py or a bare ```), else
the whole response. Each test runs it once, in a fresh sandbox (``sandbox.py``), with the test's
``input`` on stdin; it passes when its stdout equals ``output`` up to trailing whitespace on each
line and trailing blank lines. Reward: the fraction of tests passed (``all_or_nothing``: 1 only
when all pass). A sandbox violation (timeout, CPU, memory, output or file size limit, killing its
launcher) scores the response ``violation_reward`` (0) whatever the other tests did, and stops
its remaining tests. A sandbox that cannot start at all raises: the sample fails (not the
model's doing).

Why stdin/stdout rather than a function and asserts: the comparison runs here, outside the
sandbox. Asserts would run inside the model's own process, where the program can replace
``assert``'s helpers, patch the checker or ``os._exit(0)`` before any test ran; a program that
only prints cannot forge a verdict. It is also the format of competitive-programming sets (APPS,
CodeContests, LiveCodeBench's stdin problems), and every test is its own process, so one test's
state cannot leak into the next.

What the sandbox enforces, and what it cannot on a given host, is in ``sandbox.py`` and
docs/guide/code.md; the host's isolation is logged once per process.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config.code_env import CodeEnvConfig, code_env_config, load_problems, parse_tests
from asyncrl.rollout.envs.base import Environment
from asyncrl.rollout.envs.sandbox import Sandbox, SandboxLimits

__all__ = ["CodeEnv", "CodeResult", "extract_program", "load_problems", "parse_tests", "same_output"]

_FENCE = re.compile(r"```[ \t]*(?:(?:python3?|py)[ \t]*)?\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_program(response: str) -> str:
    """The last fenced code block's body (```python, ```py or ```), else the whole response."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def same_output(got: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""

    def norm(text: str) -> list[str]:
        lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(got) == norm(expected)


@dataclass
class CodeResult:
    """One response's checks: what ``reward`` scored, for logs and metrics."""

    passed: int = 0
    total: int = 0
    timeouts: int = 0
    violation: str | None = None
    sandbox_ms: float = 0.0
    verdicts: list[str] = field(default_factory=list)
    """Per test run: pass, fail, error (it exited non-zero) or the violation's name."""


class CodeStats:
    """Totals over this environment's checks so far (thread-safe): ``CodeEnv.stats``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = {"responses": 0, "tests": 0, "passed": 0, "timeouts": 0, "violations": 0}
        self.sandbox_ms = 0.0

    def add(self, r: CodeResult) -> None:
        with self._lock:
            self.counts["responses"] += 1
            self.counts["tests"] += len(r.verdicts)
            self.counts["passed"] += r.passed
            self.counts["timeouts"] += r.timeouts
            self.counts["violations"] += r.violation is not None
            self.sandbox_ms += r.sandbox_ms


class CodeEnv(Environment):
    """Python programs scored by their stdin/stdout tests in a sandbox (see the module docstring).

    Prompts come from rollout.prompts (each record's ``tests`` reaches the reward as metadata);
    the keyword arguments are ``asyncrl.config.code_env.CodeEnvConfig``'s, checked there."""

    def __init__(self, **kwargs: Any):
        self.config: CodeEnvConfig = code_env_config(kwargs)
        c = self.config
        self.sandbox = Sandbox(
            SandboxLimits(
                timeout_s=c.timeout_s,
                memory_mb=c.memory_mb,
                max_output_bytes=c.max_output_bytes,
                max_file_bytes=c.max_file_bytes,
                max_processes=c.max_processes,
                max_open_files=c.max_open_files,
                max_disk_bytes=c.max_disk_bytes,
                max_concurrent=c.max_concurrent,
            ),
            hide=c.hide,
        )
        self.stats = CodeStats()

    def check(self, response: str, metadata: dict[str, Any]) -> CodeResult:
        """Run the response's program against the problem's tests."""
        tests = parse_tests(metadata.get("tests"), "the prompt's metadata 'tests'")
        program = extract_program(response)
        result = CodeResult(total=len(tests))
        for stdin, expected in tests[: self.config.max_tests]:
            run = self.sandbox.run(program, stdin)
            result.sandbox_ms += run.wall_ms
            result.timeouts += run.violation == "timeout"
            if run.violation is not None:
                result.violation = run.violation
                result.verdicts.append(run.violation)
                break
            if run.exit_code != 0:
                result.verdicts.append("error")
            elif same_output(run.stdout, expected):
                result.passed += 1
                result.verdicts.append("pass")
            else:
                result.verdicts.append("fail")
        self.stats.add(result)
        return result

    def reward(self, prompt: str, response: str, metadata: dict[str, Any]) -> float:
        return self.score_result(self.check(response, metadata))

    def reward_with_counts(self, prompt: str, response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, int]]:
        """The reward and its check's counts, which generators report per step (rollout/code_*)."""
        result = self.check(response, metadata)
        counts = {
            "code_tests": len(result.verdicts),
            "code_passed": result.passed,
            "code_timeouts": result.timeouts,
            "code_violations": int(result.violation is not None),
            "code_sandbox_ms": round(result.sandbox_ms),
        }
        return self.score_result(result), counts

    def score_result(self, result: CodeResult) -> float:
        if result.violation is not None:
            return self.config.violation_reward
        if self.config.all_or_nothing:
            return 1.0 if result.passed == result.total else 0.0
        return result.passed / result.total
