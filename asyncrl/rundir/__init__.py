"""A run directory's layout: the names its writers (the trainer, the metrics sink, the
checkpointer) and its readers (the dashboard, `asyncrl export`, resume) agree on.

    run_dir/
      config.yaml             CONFIG_FILE: the validated config the run started with
      metrics.jsonl           METRICS_FILE: one row per step (asyncrl.monitor.sinks.JsonlSink)
      summary.json            SUMMARY_FILE: written when the run ends (asyncrl.control.summary)
      checkpoints/            CHECKPOINTS_DIR (asyncrl.learner.checkpoint writes them)
        step_000010/          a complete checkpoint: it holds COMPLETE_MARKER
          extra.msgpack       EXTRA_FILE: the trainer's own state (queue ids, versions)
        step_000010.r1/       the same step saved again (an outage checkpoint): revision 1
        latest                LATEST: names the newest complete checkpoint directory

Reading it needs neither torch nor Ray, so the dashboard of a finished run stays light.
Everything in it but config.yaml is free of secrets (asyncrl.config.secrets), and a run
creates it all private to its user (`private_files`, control.private_files).

The run directory may be an fsspec URL (``s3://bucket/runs/x``): asyncrl.rundir.store; the
functions here take either (a `RunPath`, or a location that `run_path` opens).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

from asyncrl.rundir.store import ObjectPath, RunPath, run_path

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINTS_DIR = "checkpoints"
COMPLETE_MARKER = ".complete"
LATEST = "latest"
EXTRA_FILE = "extra.msgpack"


REVISION_SEP = ".r"
"""A step saved again is written beside the first under ``step_N.rK`` (K = 1, 2, ...): the
previous one stays complete until the new one is (asyncrl.learner.checkpoint)."""


def step_of(path: RunPath) -> int:
    return int(path.name.removeprefix("step_").split(REVISION_SEP)[0])


def revision_of(path: RunPath) -> int:
    """0 for ``step_N``, K for ``step_N.rK``."""
    _, _, revision = path.name.partition(REVISION_SEP)
    return int(revision) if revision else 0


def _order(path: RunPath) -> tuple[int, int]:
    return step_of(path), revision_of(path)


def checkpoint_name(step: int, revision: int = 0) -> str:
    return f"step_{step:06d}" + (f"{REVISION_SEP}{revision}" if revision else "")


def complete_checkpoints(root: str | Path | RunPath) -> list[RunPath]:
    """The complete ``step_N`` (and ``step_N.rK``) checkpoints under `root`, oldest first (by
    step, then revision: of one step saved twice, the newer save comes last)."""
    root = run_path(root)
    if isinstance(root, ObjectPath):
        # One listing of every marker instead of a request per checkpoint (and no isdir first).
        found = root.fs.glob(f"{root.path}/step_*/{COMPLETE_MARKER}")
        steps = [ObjectPath(root.fs, str(key).rsplit("/", 1)[0], root.storage_options) for key in found]
        return sorted(steps, key=_order)
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step_*") if (p / COMPLETE_MARKER).exists()), key=_order)


def complete_checkpoint_of(root: str | Path | RunPath, step: int) -> RunPath | None:
    """The newest complete checkpoint of `step` under `root` (any revision), or None."""
    found = [p for p in complete_checkpoints(root) if step_of(p) == step]
    return found[-1] if found else None


def latest_checkpoint(run_dir: str | Path | RunPath) -> RunPath | None:
    """The run's newest complete checkpoint, None before its first."""
    steps = complete_checkpoints(run_path(run_dir) / CHECKPOINTS_DIR)
    return steps[-1] if steps else None


def read_extra(path: str | Path | RunPath) -> dict[str, Any]:
    return msgpack.unpackb((run_path(path) / EXTRA_FILE).read_bytes(), raw=False)


PRIVATE_UMASK = 0o077
"""Files 0600, directories 0700."""


@contextlib.contextmanager
def private_files(enabled: bool = True) -> Iterator[None]:
    """While inside, files and directories this process creates, and those of the processes it
    starts meanwhile (redis-server, a local Ray and its workers: a child keeps the umask it was
    started with), are readable by their user only. The umask is the process's, so other
    threads' files are private meanwhile too; it is restored on the way out."""
    if not enabled:
        yield
        return
    previous = os.umask(PRIVATE_UMASK)
    os.umask(previous | PRIVATE_UMASK)  # never looser than the user's own
    try:
        yield
    finally:
        os.umask(previous)
