"""The suite's two lanes (tests.support.lanes, run by scripts/test.sh): every test file runs in
exactly one, the split follows the measured seconds, and the per-file timing it is computed
from (tests.support.durations) adds up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from tests.support import durations, lanes
from tests.support.orphans import adopting, is_subreaper

ROOT = Path(__file__).resolve().parents[2]


def _on_disk() -> set[str]:
    """Every file pytest would collect under tests/, found without tests.support.lanes."""
    out = set()
    for root, _, files in os.walk(ROOT / "tests"):
        for name in files:
            if name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py")):
                out.add((Path(root) / name).relative_to(ROOT).as_posix())
    return out


def test_the_lanes_are_disjoint_and_cover_every_test_file_but_the_two_node_ones():
    a, b = lanes.lane_files("a"), lanes.lane_files("b")
    assert a and b
    assert not set(a) & set(b), set(a) & set(b)
    expected = {f for f in _on_disk() if not f.startswith("tests/multinode/")}
    assert set(a) | set(b) == expected, (expected - set(a) - set(b), set(a) | set(b) - expected)
    assert len(a) + len(b) == len(expected)  # no file twice in one lane
    assert any(f.startswith("tests/multinode/") for f in _on_disk())  # what lane b runs last


def test_files_that_must_not_run_at_once_share_a_lane():
    for group in lanes.SAME_LANE:
        assert all((ROOT / f).is_file() for f in group), group  # a renamed file is renamed here too
        where = {lane for lane in lanes.LANES for f in group if f in lanes.lane_files(lane)}
        assert len(where) == 1, (group, where)


def test_the_split_puts_the_longest_first_where_there_is_less_work_and_new_files_in_the_default_lane():
    files = ["t/a.py", "t/b.py", "t/c.py", "t/d.py", "t/new.py"]
    seconds = {"t/a.py": 100.0, "t/b.py": 60.0, "t/c.py": 50.0, "t/d.py": 10.0, "tests/multinode/x.py": 30.0}
    got = lanes.split(files, seconds)
    # b starts at 30 s (the two-node tests it runs last): a 100 | b 30+60, then c to b (90 < 100),
    # then d to a (100 < 140); new.py unmeasured: lane a.
    assert got == {"a": ["t/a.py", "t/d.py", "t/new.py"], "b": ["t/b.py", "t/c.py"]}
    assert lanes.split(files, {}) == {"a": files, "b": []}


def test_the_committed_table_balances_the_lanes():
    seconds = lanes.durations()
    assert seconds, "tests/lanes.json"
    work = {
        lane: sum(seconds.get(f, 0.0) for f in lanes.lane_files(lane))
        + (sum(t for f, t in seconds.items() if f.startswith("tests/multinode/")) if lane == "b" else 0.0)
        for lane in lanes.LANES
    }
    assert abs(work["a"] - work["b"]) <= 0.1 * max(work.values()), work


def test_the_lanes_cli_prints_a_lanes_files_and_refuses_an_unknown_lane():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.lanes", "b"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.split() == lanes.lane_files("b")
    bad = subprocess.run(
        [sys.executable, "-m", "tests.support.lanes", "c"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert bad.returncode != 0 and "usage" in bad.stderr


def test_file_durations_add_up_per_file_and_two_sessions_merge_into_one_table(tmp_path):
    assert durations.file_of("tests/unit/test_x.py::test_y[a::b]") == "tests/unit/test_x.py"
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"tests/old.py": 5.0, "tests/x.py": 1.0}))
    writers = [
        threading.Thread(target=durations.merge_into, args=(table, {f"tests/l{i}.py": float(i), "tests/x.py": 2.0}))
        for i in range(8)
    ]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    got = json.loads(table.read_text())
    assert got == {"tests/old.py": 5.0, "tests/x.py": 2.0, **{f"tests/l{i}.py": float(i) for i in range(8)}}


def test_the_plugin_writes_each_files_seconds_when_asked(tmp_path, monkeypatch):
    """A real pytest session over two small files, with ASYNCRL_FILE_DURATIONS set."""
    (tmp_path / "test_one.py").write_text("import time\ndef test_a():\n    time.sleep(0.3)\ndef test_b():\n    pass\n")
    (tmp_path / "test_two.py").write_text("def test_c():\n    pass\n")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.support.durations"]\n')
    table = tmp_path / "out" / "d.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), durations.ENV: str(table)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(table.read_text())
    assert set(got) == {"test_one.py", "test_two.py"}
    assert got["test_one.py"] >= 0.3 > got["test_two.py"]
    table.unlink()
    monkeypatch.delenv(durations.ENV, raising=False)  # not asked: the hooks record and write nothing
    durations.pytest_runtest_logreport(type("Report", (), {"nodeid": "tests/x.py::t", "duration": 1.0})())
    durations.pytest_sessionfinish(None)
    assert not table.exists() and "tests/x.py" not in durations._seconds


def test_adopting_names_the_orphans_a_block_left_and_nothing_else():
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        orphan_maker = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\n"  # the parent exits at once
        with adopting(grace_s=0.5) as left:
            subprocess.run([sys.executable, "-c", orphan_maker], check=True)
        assert len(left) == 1 and left[0] != outside.pid
        assert not psutil.pid_exists(left[0])  # killed and reaped, not left to the next test
        with adopting(grace_s=0.5) as none_left:
            subprocess.run([sys.executable, "-c", "pass"], check=True)
        assert none_left == []
        assert not is_subreaper()
    finally:
        outside.kill()
        outside.wait()
