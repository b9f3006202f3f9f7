"""`asyncrl.infra.run_command`: an expected failure becomes one line and its exit code, a bug
keeps its traceback, and an error a Ray task raised is reported by what it wraps."""

from __future__ import annotations

import pytest
from ray.exceptions import RayTaskError

from asyncrl.config import ConfigError
from asyncrl.infra import failure_line, run_command
from asyncrl.queue import QueueUnavailable
from asyncrl.rollout.prompts import PromptSourceError


def _raise(e: BaseException):
    def command() -> int:
        raise e

    return command


def test_expected_failures_are_one_line_with_their_exit_code(capsys):
    assert run_command("asyncrl x", _raise(ConfigError("learner.lr='a':\n  expected a number"))) == 2
    assert capsys.readouterr().err == "asyncrl x: config error: learner.lr='a': expected a number\n"
    assert run_command("asyncrl x", _raise(QueueUnavailable("Redis at redis://h:1/0 unreachable"))) == 3
    assert capsys.readouterr().err == "asyncrl x: Redis at redis://h:1/0 unreachable\n"
    # A file-system error names its path; the others of its kind (no path) are not the user's to fix.
    assert failure_line(PermissionError(13, "Permission denied", "/runs/x")) == ("/runs/x: Permission denied", 2)
    assert failure_line(ConnectionRefusedError(111, "Connection refused")) is None


def test_verbose_adds_the_traceback_and_a_bug_keeps_it(capsys):
    assert run_command("asyncrl x", _raise(ConfigError("bad")), verbose=True) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and err.endswith("asyncrl x: config error: bad\n")
    with pytest.raises(KeyError):
        run_command("asyncrl x", _raise(KeyError("a bug")))
    assert run_command("asyncrl x", _raise(KeyboardInterrupt())) == 130


def test_an_error_from_a_ray_task_is_reported_by_its_cause():
    remote = PromptSourceError("data/p.jsonl line 3: not a JSON object")
    wrapped = RayTaskError("GeneratorActor.start", "Traceback (most recent call last): ...", remote)
    wrapped = wrapped.as_instanceof_cause()  # what ray.get raises: a RayTaskError that is also the cause's class
    assert isinstance(wrapped, PromptSourceError) and str(remote) not in str(wrapped)  # its str is Ray's header
    assert failure_line(wrapped) == ("prompt error: data/p.jsonl line 3: not a JSON object", 2)
