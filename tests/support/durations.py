"""A pytest plugin (loaded by tests/conftest.py): with ``ASYNCRL_FILE_DURATIONS=PATH`` set, each
test file's total seconds (set-up, call and tear-down of its tests) go into the JSON file PATH
at the end of the session, merged into what PATH already holds (so two lanes, or a run of a
few files, update a table instead of replacing it). tests/lanes.json is such a table: the
lanes' split is computed from it (tests.support.lanes).

    ASYNCRL_FILE_DURATIONS=tests/lanes.json .venv/bin/python -m pytest tests/unit
"""

from __future__ import annotations

import fcntl
import json
import os
from collections import defaultdict
from pathlib import Path

ENV = "ASYNCRL_FILE_DURATIONS"

_seconds: dict[str, float] = defaultdict(float)


def file_of(nodeid: str) -> str:
    """The test file of a node id: 'tests/unit/test_x.py::test_y[1]' -> 'tests/unit/test_x.py'."""
    return nodeid.split("::", 1)[0]


def record(nodeid: str, seconds: float) -> None:
    _seconds[file_of(nodeid)] += seconds


def merge_into(path: Path, seconds: dict[str, float]) -> dict[str, float]:
    """Write `seconds` (rounded to 0.1 s) over PATH's entries, under a lock: two sessions that
    end together both land. Returns the table written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table: dict[str, float] = {}
        if path.exists() and path.read_text().strip():
            table = json.loads(path.read_text())
        table.update({f: round(s, 1) for f, s in seconds.items()})
        table = dict(sorted(table.items()))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1) + "\n")
        tmp.replace(path)
    return table


def pytest_runtest_logreport(report) -> None:
    if os.environ.get(ENV):
        record(report.nodeid, report.duration)


def pytest_sessionfinish(session) -> None:
    target = os.environ.get(ENV)
    if target and _seconds:
        merge_into(Path(target).resolve(), dict(_seconds))
