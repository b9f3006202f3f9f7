"""A run directory's layout: the names its writers (the trainer, the metrics sink, the
checkpointer) and its readers (the dashboard, `asyncrl export`, resume) agree on.

    run_dir/
      config.yaml             CONFIG_FILE: the validated config the run started with
      metrics.jsonl           METRICS_FILE: one row per step (asyncrl.monitor.sinks.JsonlSink)
      summary.json            SUMMARY_FILE: written when the run ends (asyncrl.control.summary)
      checkpoints/            CHECKPOINTS_DIR (asyncrl.learner.checkpoint writes them)
        step_000010/          a complete checkpoint: it holds COMPLETE_MARKER
          extra.msgpack       EXTRA_FILE: the trainer's own state (queue ids, versions)
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


def step_of(path: RunPath) -> int:
    return int(path.name.removeprefix("step_"))


def complete_checkpoints(root: str | Path | RunPath) -> list[RunPath]:
    """The complete ``step_N`` checkpoints under `root`, oldest first (by step number)."""
    root = run_path(root)
    if isinstance(root, ObjectPath):
        # One listing of every marker instead of a request per checkpoint (and no isdir first).
        found = root.fs.glob(f"{root.path}/step_*/{COMPLETE_MARKER}")
        steps = [ObjectPath(root.fs, str(key).rsplit("/", 1)[0], root.storage_options) for key in found]
        return sorted(steps, key=step_of)
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step_*") if (p / COMPLETE_MARKER).exists()), key=step_of)


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
