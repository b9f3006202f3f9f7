"""Run an untrusted Python program in a sandbox: limited, isolated as far as this host allows, killed on time.

    sandbox = Sandbox(SandboxLimits(timeout_s=2.0, memory_mb=256))
    run = sandbox.run("print(input()[::-1])", stdin="abc\\n")   # RunResult(stdout="cba\\n", violation=None, ...)

Every run gets:

- a new session (its own process group), started through ``sandbox_launcher.py``, which forks
  the program as its child so the program's parent is never the caller;
- resource limits: RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_NOFILE,
  no core files;
- a wall-clock timeout after which its whole process group (and pid namespace, and uid) is
  killed; stdout and stderr read up to ``max_output_bytes`` each, then it is killed;
- a new empty temporary directory as cwd and HOME, removed afterwards; an environment of PATH,
  HOME, TMPDIR and LANG only (nothing of the caller's, no secrets); ``python -I -S`` (no user
  site, no site-packages, PYTHON* variables ignored);
- where the host allows it (probed once per process, stated in one log line, ``isolation()``):
  a network namespace (no interface but a loopback that is down: no network at all), a pid
  namespace (it sees and signals only its own processes; when the program exits, the kernel
  kills whatever it left behind), and, as root, a uid of its own per concurrent slot
  (RLIMIT_NPROC binds it, which it does not bind root; it cannot read files that are not
  world-readable, nor signal the caller) with the interpreter's directory made reachable, and
  its pid namespace's own /proc and private tmpfs mounts over its directory, /tmp, /var/tmp,
  /dev/shm and /run/lock (``max_disk_bytes`` each), in a mount namespace; its own IPC
  namespace with the network's. Always: no new privileges, and it dies with the caller.
  Not root: a user namespace gives the network and pid namespaces. Root without these: no
  capabilities, and a pids cgroup per slot when one can be made (RLIMIT_NPROC never binds
  uid 0).

Not enforced (docs/guide/code.md): world-readable files outside its directory stay readable;
without a mount namespace, disk use is bounded per file (RLIMIT_FSIZE) and by time; memory is per process
(a program may fork up to max_processes processes of memory_mb each); no seccomp filter, so
every system call the kernel lets an unprivileged user make is allowed.

Concurrency: at most ``max_concurrent`` programs run at once per process (callers beyond
that wait); each run holds a slot, a file lock under the temporary directory that also keeps
two processes on one host from sharing a uid.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.rollout.envs.sandbox_host import (
    LAUNCHER,
    SCRATCH_DIRS,
    SCRATCH_INODES,
    SLOT_UID_BASE,
    Isolation,
    hidden_ancestor,
    interpreter,
    isolation,
    kill_cgroup,
    kill_uid,
    minimal_env,
    pids_cgroup,
    spec_flags,
)

__all__ = ["SLOT_UID_BASE", "Isolation", "RunResult", "Sandbox", "SandboxLimits", "isolation"]

log = logging.getLogger(__name__)

MAX_SLOTS = 256
_SIGNAL_VIOLATIONS = {
    int(signal.SIGXCPU): "cpu_limit",
    int(signal.SIGXFSZ): "file_size_limit",
    int(signal.SIGKILL): "killed",
}
"""SIGKILL: the hard RLIMIT_CPU, or the kernel's out-of-memory killer."""
_ERROR_VIOLATIONS = {"MemoryError": "memory_limit", "[Errno 27]": "file_size_limit", "[Errno 28]": "disk_limit"}
"""What Python makes of a limit it met (EFBIG, ENOSPC), in a failed program's stderr."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 2.0
    """Wall-clock seconds per run; CPU seconds are limited to the same, rounded up."""
    memory_mb: int = 256
    """Address space per process (RLIMIT_AS)."""
    max_output_bytes: int = 1 << 20
    """Read from stdout and from stderr each; more kills the run (violation output_limit)."""
    max_file_bytes: int = 1 << 20
    """Largest file it may write (RLIMIT_FSIZE; beyond: SIGXFSZ, violation file_size_limit)."""
    max_processes: int = 8
    """Processes and threads at once (RLIMIT_NPROC on its own uid; as root only with a uid of its own)."""
    max_open_files: int = 64
    max_disk_bytes: int = 16 << 20
    """With a mount namespace (root): its directory, /tmp, /var/tmp, /dev/shm and /run/lock are
    private tmpfs mounts of this size each, gone with the run (full: violation disk_limit)."""
    max_concurrent: int = 4
    """Programs running at once in this process."""


@dataclass
class RunResult:
    stdout: str
    stderr: str
    exit_code: int | None
    """The program's exit code; None when a signal ended it."""
    signal: int | None
    violation: str | None
    """timeout, cpu_limit, memory_limit, output_limit, file_size_limit, disk_limit, escaped (it killed the
    launcher), or None when it stayed within its limits (it may still have failed)."""
    wall_ms: float
    notes: list[str] = field(default_factory=list)


def _under(path: str, top: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), top]) == top


class Sandbox:
    """Runs programs under ``limits``, at most ``limits.max_concurrent`` at once (thread-safe)."""

    def __init__(
        self, limits: SandboxLimits | None = None, isolation: Isolation | None = None, hide: Sequence[str] = ()
    ):
        self.limits = limits or SandboxLimits()
        self.hide = [os.path.realpath(p) for p in hide]
        """Directories covered by an empty tmpfs in its mount namespace (where there is one)."""
        self._warned = False
        self.isolation = isolation
        """None: what the host allows (``isolation()``); tests pass less to check the fallbacks."""
        self._slots = threading.BoundedSemaphore(self.limits.max_concurrent)
        # One place per host whatever TMPDIR says: the slots' uids are the host's, so two
        # processes with different TMPDIRs must still see each other's locks.
        self._lock_dir = Path("/tmp") / f"asyncrl-sandbox-slots-{os.geteuid()}"

    def run(self, program: str, stdin: str = "") -> RunResult:
        iso = self.isolation or isolation()
        with self._slots:
            slot, lock = self._take_slot()
            try:
                return self._run(program, stdin, iso, slot)
            finally:
                lock.close()

    def _take_slot(self):
        """A slot no process on this host is using: (index, its open lock file)."""
        self._lock_dir.mkdir(mode=0o700, exist_ok=True)
        if self._lock_dir.lstat().st_uid != os.geteuid() or self._lock_dir.is_symlink():
            raise RuntimeError(f"{self._lock_dir} is not this user's own directory: refusing its locks")
        while True:
            for i in range(MAX_SLOTS):
                f = open(self._lock_dir / f"{i}.lock", "a")  # noqa: SIM115 - held for the run
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return i, f
                except OSError:
                    f.close()
            time.sleep(0.01)

    def _rlimits(self) -> dict[str, list[int]]:
        lim = self.limits
        cpu = max(1, int(lim.timeout_s + 0.999))
        limits = {
            "RLIMIT_CPU": [cpu, cpu + 1],
            "RLIMIT_AS": [lim.memory_mb << 20] * 2,
            "RLIMIT_FSIZE": [lim.max_file_bytes] * 2,
            "RLIMIT_NOFILE": [lim.max_open_files] * 2,
            "RLIMIT_CORE": [0, 0],
        }
        return limits

    def _run(self, program: str, stdin: str, iso: Isolation, slot: int) -> RunResult:
        lim = self.limits
        base = tempfile.gettempdir()
        if iso.own_uid and hidden_ancestor(base) is not None:  # its uid must reach its directory
            base = "/tmp"
        workdir = tempfile.mkdtemp(prefix="asyncrl-sandbox-", dir=base)
        uid = SLOT_UID_BASE + slot if iso.own_uid else None
        exe, prefix = interpreter()
        if self.hide and not iso.mountns and not self._warned:
            self._warned = True
            log.warning("code sandbox: no mount namespace here, so %s stay visible to programs", self.hide)
        spec: dict = {"rlimits": self._rlimits(), "unshare": spec_flags(iso), "userns": iso.userns}
        spec.update(uid=uid, gid=uid, nproc=lim.max_processes, parent=os.getpid())
        if uid is not None:
            spec["rlimits"]["RLIMIT_NPROC"] = [lim.max_processes] * 2
        elif iso.pids_cgroup:
            spec["cgroup"] = pids_cgroup(f"{os.geteuid()}-{slot}", lim.max_processes)
        if iso.mountns:
            hidden = hidden_ancestor(prefix)
            # not one above its own directory: that must stay writable
            extra = [p for p in self.hide if not _under(workdir, p) and not (hidden and _under(p, hidden))]
            spec.update(hide=([hidden] if hidden else []) + extra, keep=[prefix])
            spec["scratch"] = {"bytes": lim.max_disk_bytes, "inodes": SCRATCH_INODES, "dirs": list(SCRATCH_DIRS)}
        try:
            # UTF-8 whatever the locale; a lone surrogate is the program's SyntaxError, not ours
            Path(workdir, "main.py").write_bytes(program.encode("utf-8", "surrogatepass"))
            if uid is not None:
                os.chown(workdir, uid, uid)
                os.chown(Path(workdir, "main.py"), uid, uid)
            spec["argv"] = [exe, "-I", "-S", "-B", "main.py"]
            return self._launch(spec, workdir, stdin)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _launch(self, spec: dict, workdir: str, stdin: str) -> RunResult:
        status_r, status_w = os.pipe()
        spec["status_fd"] = status_w
        with tempfile.TemporaryFile() as stdin_file:  # a file: no pipe to fill while it does not read
            stdin_file.write(stdin.encode("utf-8", "surrogatepass"))
            stdin_file.seek(0)
            t0 = time.monotonic()
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", LAUNCHER, json.dumps(spec)],
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=workdir,
                    env=minimal_env(workdir),
                    pass_fds=(status_w,),
                    start_new_session=True,
                )
            finally:
                os.close(status_w)
        child_pid: int | None = None
        status_text = ""
        try:
            out, violation, status_text = self._collect(proc, status_r, t0)
            for line in status_text.splitlines():
                if line.startswith("pid "):
                    child_pid = int(line[4:])
        finally:
            os.close(status_r)
            # Once the launcher reaped it (its "exit" line), that pid is free for another
            # process of the host: never signal it then (its pid namespace died with it).
            reaped = any(ln.startswith("exit ") for ln in status_text.splitlines())
            self._kill(proc, None if reaped else child_pid, spec.get("uid"), spec.get("cgroup"))
        wall_ms = (time.monotonic() - t0) * 1000
        exit_code: int | None = None
        sig: int | None = None
        exits = [ln for ln in status_text.splitlines() if ln.startswith("exit ")]
        if exits:
            code = os.waitstatus_to_exitcode(int(exits[-1][5:]))
            exit_code, sig = (code, None) if code >= 0 else (None, -code)
        elif violation is None and child_pid is None:  # it never started the program
            err = out[2].decode(errors="replace").strip()[-300:]
            raise RuntimeError(f"the code sandbox's launcher failed (exit {proc.returncode}): {err}")
        elif violation is None:  # the launcher died before its child did: something killed it
            violation = "escaped"
        stderr = out[2].decode(errors="replace")
        failed = [ln[7:] for ln in status_text.splitlines() if ln.startswith("failed ")]
        if failed:  # the launcher says so, on its own pipe: never the program's exit code or stderr
            raise RuntimeError(f"the code sandbox could not start the program: {failed[-1][:300]}")
        if violation is None and sig is not None:
            violation = _SIGNAL_VIOLATIONS.get(sig)
        if violation is None and exit_code not in (0, None):
            tail = stderr[-2000:]  # Python turns the limits it meets into exceptions
            violation = next((v for k, v in _ERROR_VIOLATIONS.items() if k in tail), None)
        return RunResult(out[1].decode(errors="replace"), stderr, exit_code, sig, violation, wall_ms)

    def _collect(self, proc: subprocess.Popen, status_r: int, t0: float) -> tuple[dict[int, bytes], str | None, str]:
        """Read stdout, stderr and the launcher's status until all close, the deadline or too much output."""
        assert proc.stdout is not None and proc.stderr is not None
        lim = self.limits
        fds = {proc.stdout.fileno(): 1, proc.stderr.fileno(): 2, status_r: 0}
        got: dict[int, bytearray] = {0: bytearray(), 1: bytearray(), 2: bytearray()}
        deadline = t0 + lim.timeout_s
        violation = None
        open_fds = set(fds)
        while open_fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                violation = "timeout"
                break
            ready, _, _ = select.select(list(open_fds), [], [], remaining)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    open_fds.discard(fd)
                    continue
                which = fds[fd]
                got[which] += chunk
                if which and len(got[which]) > lim.max_output_bytes:
                    violation = "output_limit"
            if violation:
                break
        for which in (1, 2):
            del got[which][lim.max_output_bytes :]
        return {k: bytes(v) for k, v in got.items()}, violation, got[0].decode(errors="replace")

    def _kill(self, proc: subprocess.Popen, child_pid: int | None, uid: int | None, cgroup: str | None) -> None:
        """Everything the run started: its process group, its pid namespace (by killing its
        init), and every process of its uid (what left the group with setsid)."""
        if child_pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child_pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)  # the launcher reaps it and exits: no zombie left to init
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if uid is not None:
            kill_uid(uid)
        if cgroup:
            kill_cgroup(cgroup)
        proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
