"""A small verifiers (v1) environment for the tests, written as a module of its own.

    name = write_vf_env(tmp_path)        # tmp_path/<name>.py; put tmp_path on sys.path
    rollout.env = {type: verifiers, id: name, args: {turns: 2}}

verifiers imports a taskset by a top-level module name, so the source
(tests/support/vf_copy_task.py) is written to a folder as a module of that name; a run's
generators, which cannot see that folder, import it as ``tests.support.vf_copy_task``. Two
in-memory tasks (the tiny model's copy task), a rubric of two rule rewards (weights 1 and
0.5), a ``@vf.stop`` on the reply "stop", and an environment that answers each reply
(``turns > 1``) through ``agent.interaction``.
"""

from __future__ import annotations

from pathlib import Path

SOURCE = (Path(__file__).parent / "vf_copy_task.py").read_text()
"""The environment's module (tests.support.vf_copy_task), written out under another name by
``write_vf_env``."""

WORDS = ("abc", "bad")


def write_vf_env(folder: str | Path, name: str = "vf_copy_env") -> str:
    """Write the environment module into ``folder``; returns its module name."""
    (Path(folder) / f"{name}.py").write_text(SOURCE)
    return name


def env_reply(reply: str) -> str:
    """What the environment answers to a reply (EchoEnv.run)."""
    return f"{len(reply)}>"
