"""A lifeline: a small child process that stops whatever a run started once the run's process is
gone, however it went (a clean exit, an exception, SIGTERM past its grace, SIGKILL, an OOM kill).

    line = Lifeline.start(shm_globs=["/dev/shm/asyncrl-demo-v*.safetensors*"])
    # from here on, every process this one starts (and everything *they* exec) carries the
    # run's token in its environment: redis-server, Ray's GCS, raylet, agents and workers,
    # vLLM's spawned EngineCore ...
    line.register([[pid, create_time], ...])       # forked children, which do not show it
    # (the run's own descendants are registered as they appear, every WATCH_S seconds)
    reap_run(line.token, exclude={os.getpid()})     # the same sweep, now (a hard exit)

The lifeline holds the read end of a pipe whose write end only the run's process has; when
that process ends, for any reason, the kernel closes it (or, where a forked child still holds a
copy, the lifeline sees itself reparented within a second) and the lifeline wakes. It then sweeps:
every process of this user whose environment (``/proc/PID/environ``, as it was exec'd) names
the run's token, and every registered [pid, create_time] still alive, gets SIGTERM (vLLM's
engine processes unlink their shared memory when terminated, not when killed; redis-server
flushes its AOF), then SIGKILL after a few seconds; the /dev/shm segments they mapped and the
files the run registered are deleted. After a clean exit it finds nothing and leaves at once.

The token alone is not enough: a process that retitles itself (setproctitle, as Ray's dashboard
and runtime-env agents do) overwrites the memory /proc/PID/environ shows, and once the driver is
gone its children are orphans no tree walk finds. So the run's process also registers every
descendant it started, as they appear (a thread, every WATCH_S seconds): a process that lived
that long is swept by its [pid, create_time] whatever it did to its environment. Children the
process had before the lifeline started (and theirs) are its caller's, not the run's.

What it cannot cover: a process that cleared its environment before exec'ing and was never
registered; a process that left this user (setuid); another host's processes (Ray's other
nodes tear down on their own when the head goes); and the lifeline itself being killed by the
same blow (a scheduler killing the whole cgroup kills everything anyway, so there is nothing
left to sweep). Processes Ray starts for a private instance also die with the driver on Linux
(Ray gives them PR_SET_PDEATHSIG), and the embedded redis-server gets SIGTERM when the thread
that started it ends (asyncrl.queue.server): the lifeline is what covers the rest, chiefly
vLLM's EngineCore, which a SIGKILLed Ray worker would otherwise orphan.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

from asyncrl.infra import shm_segments_of, stop_processes

log = logging.getLogger(__name__)

TOKEN_ENV = "ASYNCRL_RUN_TOKEN"
"""The environment variable every process a run starts carries (its value: the run's token)."""

WATCH_S = 2.0
"""How often the run's process registers its new descendants with the lifeline."""


def _environ_has(pid: int, entry: bytes) -> bool:
    """Whether the process's initial environment (what it was exec'd with) holds `entry`
    ("NAME=value"); False for a process we may not read (another user's) or one that is gone.
    A process whose main thread has exited (the others run on) has no environ of its own: its
    threads' hold the same one."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:
        pass
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    return False


def marked_processes(name: str, value: str, exclude: Iterable[int] = ()) -> list[int]:
    """PIDs of this user's live processes whose environment holds NAME=value."""
    entry, skip, uid = f"{name}={value}".encode(), set(exclude), os.getuid()
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in skip:
            continue
        try:
            if os.stat(f"/proc/{d}").st_uid != uid:
                continue
        except OSError:
            continue
        if _environ_has(int(d), entry):
            found.append(int(d))
    return found


def terminate(pids: Iterable[int], grace_s: float = 5.0) -> list[int]:
    """SIGTERM (and SIGCONT, for a stopped one) each process, SIGKILL those still alive after
    `grace_s`; return the pids that were alive. The /dev/shm/psm_* segments they mapped and
    that are still there afterwards are deleted (a killed engine process leaves them)."""
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    segments = shm_segments_of(p.pid for p in procs)
    stop_processes(procs, grace_s)
    for path in segments:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return [p.pid for p in procs]


def _alive(records: Iterable[tuple[int, float]]) -> list[int]:
    return [pid for pid, _ in _prune_dead(records)]


def _ended(proc) -> bool:
    """Exited, not yet reaped: a zombie whose every thread is gone (the main thread's exit alone
    shows the process as a zombie too, while its other threads run)."""
    import psutil

    return proc.status() == psutil.STATUS_ZOMBIE and proc.num_threads() <= 1


def _prune_dead(records: Iterable[tuple[int, float]]) -> set[tuple[int, float]]:
    """The records whose process is still the one registered (a reused pid is not) and still
    running: a zombie has ended (Ray's idle workers exit by themselves as its raylet goes, and
    wait, reparented, for init to reap them), so there is nothing of it to stop. A zombie with
    threads left is not ended: its main thread exited (pthread_exit) while the others run on."""
    import psutil

    out = set()
    for pid, created in records:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) < 1e-3 and not _ended(proc):
                out.add((pid, created))
    return out


def reap_run(
    token: str,
    *,
    registered: Iterable[tuple[int, float]] = (),
    shm_globs: Iterable[str] = (),
    exclude: Iterable[int] = (),
    grace_s: float = 5.0,
) -> list[int]:
    """Stop every process that carries the run's token or was registered (not `exclude`),
    delete the files `shm_globs` match, and return the pids stopped."""
    # The files first, at once: a resume of the same run (same file names) may start soon after.
    for pattern in shm_globs:
        for path in glob.glob(pattern):
            with contextlib.suppress(OSError):
                os.unlink(path)
    skip = {os.getpid(), *exclude}
    pids = sorted(set(marked_processes(TOKEN_ENV, token, skip)) | (set(_alive(registered)) - skip))
    return terminate(pids, grace_s) if pids else []


class Lifeline:
    """The run's side of the lifeline: the pipe's write end, and the token. `Lifeline.current`
    is the one this process started (None: none), for `hard_exit`."""

    current: Lifeline | None = None

    def __init__(self, proc: subprocess.Popen, write_fd: int, token: str, shm_globs: list[str]):
        self.proc, self._fd, self.token, self.shm_globs = proc, write_fd, token, shm_globs
        self.registered: list[tuple[int, float]] = []
        self._previous_token: str | None = None
        self._closed = threading.Event()
        self._callers: set[tuple[int, float]] = set()
        self._lock = threading.Lock()

    @classmethod
    def start(cls, shm_globs: Iterable[str] = ()) -> Lifeline:
        """Start the lifeline and mark this process's environment with a fresh token, so every
        process started from here on carries it."""
        import psutil

        token, shm_globs = secrets.token_hex(16), list(shm_globs)
        callers = set()  # the children this process already has: its caller's, not the run's
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children():
                with contextlib.suppress(psutil.Error):
                    callers.add((child.pid, child.create_time()))
        read_fd, write_fd = os.pipe()
        os.set_inheritable(write_fd, False)
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}  # the sweep must not find itself
        args = [sys.executable, "-m", "asyncrl.lifeline", str(os.getpid()), token, *shm_globs]
        proc = subprocess.Popen(
            args,
            stdin=read_fd,
            env=env,
            stdout=subprocess.DEVNULL,
            # Its own session: Ctrl-C or a SIGTERM to the run's process group must not end it
            # before the run is over.
            start_new_session=True,
            close_fds=True,
        )
        os.close(read_fd)
        line = cls(proc, write_fd, token, shm_globs)
        line._callers = callers
        line._previous_token = os.environ.get(TOKEN_ENV)
        os.environ[TOKEN_ENV] = token
        Lifeline.current = line
        threading.Thread(target=line._watch_descendants, name="lifeline-watch", daemon=True).start()
        return line

    def _watch_descendants(self) -> None:
        known: set[tuple[int, float]] = set()
        warned = False
        while not self._closed.wait(WATCH_S):
            try:
                now = set(self._descendants())
                if new := now - known:
                    self.register(sorted(new))
                known = now
                # Forget the dead (a reward that starts a process per sample registers thousands):
                # what was just seen is alive; the rest (forked engines, reparented) is looked up.
                with self._lock:
                    others = set(self.registered) - now
                    if others:
                        self.registered = sorted((set(self.registered) & now) | _prune_dead(others))
            except Exception as e:  # a dead watcher would stop registering, silently
                if not warned:
                    log.warning("lifeline: registering the run's processes failed (%s); retrying", e)
                    warned = True

    def _descendants(self) -> list[tuple[int, float]]:
        """[pid, create_time] of this process's descendants that the run started: children that
        existed before the lifeline (the caller's own: a test session's Redis and Ray, a
        notebook's kernels) are not the run's, and neither is anything below them."""
        import psutil

        children: dict[int, list[tuple[int, float]]] = {}
        # Fresh Process objects, not process_iter's: its cached ones (and their .info) are
        # shared with any other thread of the run that walks the process table.
        for pid in psutil.pids():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                with proc.oneshot():
                    children.setdefault(proc.ppid(), []).append((pid, proc.create_time()))
        found: list[tuple[int, float]] = []
        todo = [c for c in children.get(os.getpid(), []) if c not in self._callers and c[0] != self.proc.pid]
        while todo:
            found.append(todo.pop())
            todo += children.get(found[-1][0], [])
        return found

    def register(self, records: Iterable[Iterable]) -> None:
        """Also sweep these [pid, create_time] processes (forked ones: they keep the
        environment their parent was exec'd with, without the token)."""
        new = [(int(pid), float(created)) for pid, created in records]
        lines = "".join(f"{pid} {created!r}\n" for pid, created in new)
        with self._lock:  # the watcher thread registers too; one writer at a time on the pipe
            self.registered += new
            if lines and self._fd >= 0:
                with contextlib.suppress(OSError):
                    os.write(self._fd, lines.encode())

    def close(self, wait_s: float = 30.0) -> None:
        """Let the lifeline sweep now (after a clean stop it finds nothing) and wait for it."""
        self._closed.set()
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        if Lifeline.current is self:
            Lifeline.current = None
        if self._previous_token is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = self._previous_token
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=wait_s)

    def __enter__(self) -> Lifeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def hard_exit(code: int, why: str) -> None:
    """Leave now, without the orderly tear-down, but stop what this process started first: its
    descendants and everything carrying the current lifeline's token (its registered processes
    and files too). For a second signal or a shutdown grace that ran out."""
    import psutil

    log.error("%s: exiting now (status %d), stopping what the run started", why, code)
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    line = Lifeline.current
    pids: set[int] = set()
    with contextlib.suppress(psutil.Error):
        pids = {p.pid for p in psutil.Process().children(recursive=True)}
    if line is not None:
        exclude = {os.getpid(), line.proc.pid}
        pids |= set(marked_processes(TOKEN_ENV, line.token, exclude)) | set(_alive(line.registered))
        pids -= exclude
    with contextlib.suppress(Exception):
        terminate(pids, grace_s=3.0)
    for pattern in line.shm_globs if line is not None else ():
        for path in glob.glob(pattern):
            with contextlib.suppress(OSError):
                os.unlink(path)
    os._exit(code)


def _main(argv: list[str]) -> int:
    parent, token, shm_globs = int(argv[0]), argv[1], argv[2:]
    # The run's signals are not ours: a SIGTERM that reaches the whole group must not end the
    # lifeline before it has swept up after the run.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    registered: set[tuple[int, float]] = set()
    prune_at = 1024  # the registry's size at which the dead are dropped (then twice what is left)
    buffer = b""
    # EOF: the run's process closed its end or is gone. A child it forked keeps a copy of that
    # end (fork keeps every descriptor), so its death is also seen as our reparenting.
    while True:
        orphaned = os.getppid() != parent
        ready, _, _ = select.select([0], [], [], 0.0 if orphaned else 1.0)
        chunk = os.read(0, 65536) if ready else b""
        if not chunk and (ready or orphaned):
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError):
                pid, created = line.split()
                registered.add((int(pid), float(created)))
        if len(registered) >= prune_at:
            registered = _prune_dead(registered)
            prune_at = max(1024, 2 * len(registered))
    # Give what is already on its way out (multiprocessing's resource tracker, which cleans up
    # after the parent once its pipe closes) a moment to go by itself.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and marked_processes(TOKEN_ENV, token, {os.getpid(), parent}):
        time.sleep(0.2)
    stopped = reap_run(token, registered=registered, shm_globs=shm_globs, exclude={parent})
    if stopped:
        print(f"asyncrl lifeline: stopped {len(stopped)} processes the run left: {stopped}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
