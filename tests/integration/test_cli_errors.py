"""Every `asyncrl` command ends an expected failure (bad input, a server that does not answer)
with one line on stderr and a non-zero exit code, never a traceback; --verbose adds the
traceback. A closed loopback port stands for a server that is not there.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from asyncrl.cli import main
from asyncrl.infra import free_port
from asyncrl.queue.server import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "asyncrl.cli"]
GAVE_UP = re.compile(r"unreachable after \d+ attempts over (\d+\.\d)s")


def _last_line(stderr: str) -> str:
    return stderr.rstrip("\n").splitlines()[-1]


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_generate_against_unreachable_redis_says_where_and_how_long():
    port = free_port()
    argv = ["generate", "--redis", f"redis://u:s3cret@127.0.0.1:{port}/0", "--run", "demo", "--connect-timeout", "0.5"]
    quiet, verbose = _spawn(*argv), _spawn(*argv, "--verbose")  # side by side: each waits out its deadline
    out, err = quiet.communicate(timeout=60)
    assert quiet.returncode == 3, err
    line = _last_line(err)
    assert line.startswith(f"asyncrl generate: Redis at redis://u@127.0.0.1:{port}/0 unreachable after "), err
    assert float(GAVE_UP.search(line).group(1)) >= 0.5 and "Connection refused" in line
    assert "Traceback" not in err and "s3cret" not in err + out
    assert sum(x.startswith("asyncrl generate:") for x in err.splitlines()) == 1

    _, err = verbose.communicate(timeout=60)
    assert verbose.returncode == 3 and "Traceback (most recent call last)" in err
    assert "QueueUnavailable" in err and GAVE_UP.search(_last_line(err)) and "s3cret" not in err


def test_dashboard_refuses_an_unreachable_redis_at_start():
    port = free_port()
    argv = [
        "dashboard",
        "--redis",
        f"redis://127.0.0.1:{port}/0",
        "--port",
        str(free_port()),
        "--connect-timeout",
        "0.5",
    ]
    out = subprocess.run(
        [*CLI, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,  # today's dashboard serves its page anyway and never exits
    )
    assert out.returncode == 3, out.stderr
    line = _last_line(out.stderr)
    assert line.startswith(f"asyncrl dashboard: Redis at redis://127.0.0.1:{port}/0 unreachable after "), line
    assert float(GAVE_UP.search(line).group(1)) >= 0.5 and line.endswith("is --redis right?")
    assert "Traceback" not in out.stderr and "http://" not in out.stdout  # no page was served


def test_a_dashboard_started_before_its_redis_waits_for_it(tmp_path):
    redis_port, http_port = free_port(), free_port()
    url = f"redis://127.0.0.1:{redis_port}/0"
    dash = _spawn("dashboard", "--redis", url, "--port", str(http_port), "--connect-timeout", "20")
    server = EmbeddedRedis(tmp_path, port=redis_port)
    try:
        first = dash.stderr.readline()
        assert f"Redis at {url}: ConnectionError" in first and "retry 1" in first, first
        server.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{http_port}/api/runs", timeout=2)
                break
            except httpx.TransportError:
                assert dash.poll() is None, dash.communicate()[1]
                assert time.monotonic() < deadline, "the dashboard never served"
                time.sleep(0.2)
        assert r.status_code == 200 and r.json() == {"runs": []}
    finally:
        dash.terminate()
        dash.communicate(timeout=30)
        server.stop()


ROWS = {
    # name: (argv, what the line says, exit code); {tmp} is a fresh directory holding bad.yaml
    # and a plain file a-file, {redis} a live Redis, {closed} a loopback port nothing listens on.
    "train: no such config": ("train {tmp}/nope.yaml", "does not exist", 2),
    "train: bad YAML": ("train {tmp}/bad.yaml", "is not valid YAML: line 2, column 1", 2),
    "train: config is a directory": ("train {tmp}", "cannot be read: Is a directory", 2),
    "train: resume a missing run dir": ("train --resume {tmp}/nope", "does not exist", 2),
    "train: run dir under a file": (
        "train configs/demo.yaml control.run_dir={tmp}/a-file/run",
        "{tmp}/a-file/run: Not a directory",
        2,
    ),
    "train: no Ray cluster there": (
        "train configs/demo.yaml control.run_dir={tmp}/run control.ray_address={closed}",
        "control.ray_address='{closed}': no Ray cluster answers there",
        3,
    ),
    "generate: not a Redis URL": ("generate --redis http://{closed}/0 --run x", "must start with redis://", 2),
    "generate: no such run": ("generate --redis {redis} --run nosuch", "'nosuch'", 2),
    "dashboard: no such run dir": ("dashboard {tmp}/nope", "not a directory", 2),
    "dashboard: open host without a token": ("dashboard --redis {redis} --host 0.0.0.0", "set a token", 2),
    "export: not a run dir": ("export {tmp}", "is not a run directory", 2),
    "tiny-model: path under a file": ("tiny-model {tmp}/a-file/m", "{tmp}/a-file/m: Not a directory", 2),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_each_command_ends_an_expected_failure_with_one_line(row, tmp_path, redis_url, capsys, monkeypatch):
    # In this process, as the `asyncrl` console script calls main: the imports are paid once.
    monkeypatch.chdir(ROOT)
    (tmp_path / "bad.yaml").write_text("a: [1\n")
    (tmp_path / "a-file").write_text("")
    where = {"tmp": tmp_path, "redis": redis_url, "closed": f"127.0.0.1:{free_port()}"}
    argv, says, code = ROWS[row]
    rc = main(argv.format(**where).split())
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == code and len(lines) == 1 and says.format(**where) in lines[0], err
    assert "Traceback" not in err
