"""bench/jsonout.py: a bench's JSON is its last stdout line even when libraries and child
processes write to stdout during the run and after it (Ray's atexit hooks, vLLM's engine
process), and nothing of theirs reaches stdout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, os, subprocess, sys
from bench.jsonout import JsonStdout

atexit.register(lambda: print("a library's atexit line"))
with JsonStdout() as out:
    print("a library's log line")
    os.write(1, b"a raw write to fd 1\\n")
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); print('a child, late')"])
    out.line("the bench's own summary")
    out.result = {"ratio": 1.5, "checks": {"ok": True}}
print("after the bench")
"""


def test_the_json_is_the_last_stdout_line_and_others_go_to_stderr():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    lines = proc.stdout.splitlines()
    assert lines == ["the bench's own summary", json.dumps({"ratio": 1.5, "checks": {"ok": True}})]
    for text in ("a library's log line", "a raw write to fd 1", "after the bench", "atexit line", "a child, late"):
        assert text in proc.stderr


def test_no_json_when_the_bench_fails():
    script = "from bench.jsonout import JsonStdout\nwith JsonStdout():\n    raise SystemExit(3)\n"
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and proc.stdout == ""
