"""What this host lets the code sandbox enforce, probed once per process, and the reapers it needs.

    iso = isolation()       # Isolation(netns=True, pidns=True, own_uid=True, ...), logged once
    iso.describe()          # "network namespace yes, pid namespace yes, own uid yes"

The probe runs ``sandbox_launcher.py`` with nothing to run, first with everything (root: a
network, pid and mount namespace and a uid of its own), then each part alone, and keeps what
worked; ``reason`` says why a part is missing. Root without a uid of its own gets a pids
cgroup per slot when the cgroup file system is writable (RLIMIT_NPROC never binds uid 0).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("asyncrl.rollout.envs.sandbox")

LAUNCHER = str(Path(__file__).with_name("sandbox_launcher.py"))
CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWIPC = 0x00020000, 0x40000000, 0x20000000, 0x08000000
NET_FLAGS = CLONE_NEWNET | CLONE_NEWIPC
"""With the network its own System V IPC and POSIX message queues: the host's would keep a
shared memory segment it made (host memory) after it ended."""
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
"""The usual world-writable directories, each a private tmpfs in its mount namespace."""
SCRATCH_INODES = 4096
SLOT_UID_BASE = 1_900_000_000
"""Root runs slot i as uid/gid SLOT_UID_BASE + i: ids no account uses, one per concurrent run."""


@dataclass(frozen=True)
class Isolation:
    """What this host lets the sandbox enforce beyond resource limits (probed once per process)."""

    netns: bool
    pidns: bool
    own_uid: bool
    """Runs as a uid of its own (root only). Otherwise root runs it as root with every
    capability dropped; RLIMIT_NPROC never binds uid 0, so a pids cgroup bounds it if it can."""
    userns: bool
    reason: str = ""
    """Why something is missing, for the log line and the docs' claims."""
    mountns: bool = False
    """A mount namespace of its own (root): its own /proc, the interpreter reachable by its uid."""
    pids_cgroup: bool = False
    """Root without a uid of its own: each slot's processes go in a pids cgroup (pids.max)."""

    def describe(self) -> str:
        yes = {True: "yes", False: "NO"}
        line = (
            f"network namespace {yes[self.netns]}, pid namespace {yes[self.pidns]}, "
            f"own uid {yes[self.own_uid]}{', namespaces via a user namespace' if self.userns else ''}"
            f"{', a pids cgroup' if self.pids_cgroup else ''}"
        )
        return f"{line}; {self.reason}" if self.reason else line


_probe_lock = threading.Lock()
_isolation: Isolation | None = None


def hidden_ancestor(path: str) -> str | None:
    """The top directory above ``path`` that other users cannot enter (None if all can)."""
    parts = Path(path).resolve().parts
    for i in range(2, len(parts) + 1):
        d = os.path.join(*parts[:i])
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return d
    return None


def interpreter() -> tuple[str, str]:
    """The real interpreter behind this one (a venv's python is a symlink) and its prefix."""
    exe = os.path.realpath(sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


def spec_flags(iso: Isolation) -> int:
    flags = (NET_FLAGS if iso.netns else 0) | (CLONE_NEWPID if iso.pidns else 0)
    return flags | (CLONE_NEWNS if iso.mountns else 0)


def _try(spec: dict, workdir: str) -> str | None:
    """Run the launcher in probe mode; None if it worked, else why not."""
    r, w = os.pipe()
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", LAUNCHER, json.dumps({**spec, "status_fd": w, "probe": True})],
            cwd=workdir,
            env=minimal_env(workdir),
            pass_fds=(w,),
            capture_output=True,
            timeout=30,
            start_new_session=True,
        )
    finally:
        os.close(w)
        os.close(r)
    return None if proc.returncode == 0 else (proc.stderr.decode(errors="replace").strip()[-300:] or "failed")


def isolation() -> Isolation:
    """What the host allows, probed once per process and logged once."""
    global _isolation
    with _probe_lock:
        if _isolation is None:
            _isolation = _probe()
            log.info("code sandbox isolation: %s", _isolation.describe())
        return _isolation


def _probe() -> Isolation:
    root = os.geteuid() == 0
    reasons = []
    own_uid = False
    with tempfile.TemporaryDirectory(prefix="asyncrl-sandbox-probe-") as d:
        base = {"rlimits": {}, "argv": [], "nproc": 64, "userns": not root}
        if root:
            _exe, prefix = interpreter()
            hidden = hidden_ancestor(prefix)
            own = {"uid": SLOT_UID_BASE, "gid": SLOT_UID_BASE, "hide": [hidden] if hidden else [], "keep": [prefix]}
            Path(d, "main.py").write_text("")  # the private tmpfs mounts copy it in
            scratch = {"bytes": 1 << 20, "inodes": 64, "dirs": list(SCRATCH_DIRS)}
            full = _try({**base, **own, "scratch": scratch, "unshare": NET_FLAGS | CLONE_NEWPID | CLONE_NEWNS}, d)
            if full is None:
                return Isolation(True, True, True, False, mountns=True)
            reasons.append(f"namespaces as root: {full}")
            # Without a mount namespace a uid of its own works only if it can reach the interpreter.
            own_uid = hidden is None and _try({**base, **own, "hide": None, "keep": None, "unshare": 0}, d) is None
            if not own_uid:
                reasons.append(f"runs as root without capabilities ({hidden or 'the interpreter'} unreachable)")
        net = _try({**base, "unshare": NET_FLAGS}, d) is None
        pid = _try({**base, "unshare": CLONE_NEWPID}, d) is None
        if not (net and pid):
            reasons.append("unshare refused (no CAP_SYS_ADMIN, or unprivileged user namespaces disabled)")
        if not root:
            reasons.append("not root: runs as the caller's uid (RLIMIT_NPROC counts all its processes)")
        probe_cgroup = pids_cgroup("probe", 1) if root and not own_uid else None
        cgroup = probe_cgroup is not None
        if probe_cgroup:
            with contextlib.suppress(OSError):
                os.rmdir(probe_cgroup)
        if root and not own_uid and not cgroup:
            reasons.append("no writable pids cgroup: nothing bounds its process count (RLIMIT_NPROC spares uid 0)")
        return Isolation(net, pid, root and own_uid, not root and (net or pid), "; ".join(reasons), pids_cgroup=cgroup)


PIDS_CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")
"""cgroup v1's pids hierarchy, else cgroup v2's root (when it delegates the pids controller)."""


def pids_cgroup(name: str, max_pids: int) -> str | None:
    """A pids cgroup of that name with pids.max set (made if missing), or None if none can be."""
    for root in PIDS_CGROUP_ROOTS:
        if root == "/sys/fs/cgroup":
            try:
                if "pids" not in Path(root, "cgroup.subtree_control").read_text().split():
                    continue
            except OSError:
                continue
        path = os.path.join(root, f"asyncrl-sandbox-{name}")
        try:
            os.makedirs(path, exist_ok=True)
            Path(path, "pids.max").write_text(str(max_pids))
            return path
        except OSError:
            continue
    return None


def kill_cgroup(path: str) -> None:
    """SIGKILL every process in the cgroup until it is empty (pids.max bounds new ones)."""
    for _ in range(100):
        try:
            pids = [int(p) for p in Path(path, "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def minimal_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}


def kill_uid(uid: int) -> None:
    """SIGKILL every process running as ``uid`` until none is left (RLIMIT_NPROC bounds how
    many it can start meanwhile, so this ends)."""
    for _ in range(100):
        found = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if entry.stat().st_uid != uid or _zombie(entry.path):
                    continue
                found = True
                os.kill(int(entry.name), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        if not found:
            return
        time.sleep(0.005)


def _zombie(proc_dir: str) -> bool:
    """Dead, waiting for its parent to reap it: nothing left to kill."""
    with open(os.path.join(proc_dir, "stat")) as f:
        return f.read().rpartition(")")[2].split()[0] == "Z"
