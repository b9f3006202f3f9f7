"""The suite's two lanes: `bash scripts/test.sh` runs two pytest sessions side by side, each
over its lane's test files, then tests/multinode at the end of the lane that finishes first
(planned as lane "b"'s).

    python -m tests.support.lanes a        # lane a's test files, one a line
    python -m tests.support.lanes b

A test's cost is mostly start-ups (Ray, a vLLM engine, a trainer), during which one process
imports on one core while the other idles: two lanes overlap those waits.

The split is by file, from the seconds each file took (tests/lanes.json, written by
``ASYNCRL_FILE_DURATIONS=tests/lanes.json pytest ...``: tests.support.durations): the slowest
file first, each to the lane with less work so far (lane "b" starts with the two-node tests it
runs last). A file the table does not know (a new one) runs in lane "a"; every test file is in
exactly one lane (tests/unit/test_lanes.py). Files in one SAME_LANE group never run at the same
time as each other.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
TABLE = TESTS / "lanes.json"
LANES = ("a", "b")
DEFAULT_LANE = "a"
SEPARATE = ("tests/multinode",)
"""Run on their own (a fresh driver process: tests/multinode/conftest.py) at the end of the lane
that finishes first; the split counts them in lane "b"'s work."""
SAME_LANE = (
    # Both run programs as the code sandbox's slot uids, and test_code_sandbox checks that no
    # process of any slot uid is left: the other lane's programs would be seen as its leftovers.
    ("tests/unit/test_code_env.py", "tests/unit/test_code_sandbox.py"),
)
"""Groups of files kept in one lane (so never run at the same time)."""


def test_files() -> list[str]:
    """Every test file the lanes run, relative to the root (tests/multinode apart)."""
    found = {*TESTS.rglob("test_*.py"), *TESTS.rglob("*_test.py")}  # pytest's python_files
    files = sorted(p.relative_to(ROOT).as_posix() for p in found)
    return [f for f in files if not f.startswith(tuple(s + "/" for s in SEPARATE))]


def durations(table: Path = TABLE) -> dict[str, float]:
    """Seconds per test file, as measured; {} without a table."""
    if not table.exists():
        return {}
    raw = json.loads(table.read_text())
    return {str(k): float(v) for k, v in raw.items() if isinstance(v, int | float)}


def split(files: list[str], seconds: dict[str, float]) -> dict[str, list[str]]:
    """{lane: its files, in path order}: longest first to the lane with less work so far;
    unmeasured files to DEFAULT_LANE; a SAME_LANE group as one unit."""
    units: list[tuple[str, ...]] = []
    grouped = {f for group in SAME_LANE for f in group}
    units += [tuple(f for f in group if f in files) for group in SAME_LANE]
    units += [(f,) for f in files if f not in grouped]
    units = [u for u in units if u]
    lanes: dict[str, list[str]] = {lane: [] for lane in LANES}
    work = {lane: 0.0 for lane in LANES}
    work["b"] += sum(t for f, t in seconds.items() if f.startswith(tuple(s + "/" for s in SEPARATE)))
    measured = [u for u in units if all(f in seconds for f in u)]
    for unit in sorted(measured, key=lambda u: (-sum(seconds[f] for f in u), u)):
        lane = min(LANES, key=lambda name: (work[name], name))
        lanes[lane] += unit
        work[lane] += sum(seconds[f] for f in unit)
    for unit in units:
        if unit not in measured:
            lanes[DEFAULT_LANE] += unit
    return {lane: sorted(fs) for lane, fs in lanes.items()}


def lane_files(lane: str) -> list[str]:
    if lane not in LANES:
        raise ValueError(f"no lane {lane!r}: the lanes are {', '.join(LANES)}")
    return split(test_files(), durations())[lane]


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in LANES:
        sys.exit(f"usage: python -m tests.support.lanes {{{'|'.join(LANES)}}}")
    print("\n".join(lane_files(sys.argv[1])))
