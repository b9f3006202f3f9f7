"""The first process of a code sandbox: isolates itself, then runs the model's program as its child.

Run by ``asyncrl.rollout.envs.sandbox`` as ``python -I -S sandbox_launcher.py SPEC`` in a new
session, in the sandbox's empty directory, with a minimal environment. Standard library only
(it runs without site-packages or asyncrl on the path). SPEC is a JSON object:

    {"argv": [...], "rlimits": {"RLIMIT_CPU": [soft, hard], ...}, "unshare": flags,
     "uid": int | null, "gid": int | null, "userns": bool, "status_fd": int,
     "hide": [path, ...], "keep": [path, ...], "nproc": int, "parent": pid,
     "scratch": {"bytes": int, "inodes": int, "dirs": [path, ...]}}

Steps: ``unshare`` the namespaces asked for (network, pid, mount; a user namespace first when
not root), fork (the child is pid 1 of the new pid namespace: when it exits the kernel kills
every process left in it), and in the child: hide ``hide`` under an empty read-only tmpfs with
the ``keep`` paths bound back (so the interpreter outside world-readable directories stays
reachable for an unprivileged uid), mount the pid namespace's own /proc and private tmpfs
mounts over ``scratch["dirs"]`` and its own directory, set the resource limits, drop to
``uid``/``gid`` (root only), no new privileges, and exec ``argv``. The launcher and its child
die with their parent (PR_SET_PDEATHSIG): a crashed reward worker leaves nothing running.
The launcher writes ``pid N`` (the child's pid as the parent sees it), ``failed WHY`` when it
could not start the program, and ``exit STATUS`` (its raw wait status) to ``status_fd``;
``probe`` in SPEC checks that all of this works and exits without running anything.
"""

import ctypes
import json
import os
import resource
import select
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1,
    2,
    4,
    8,
    32,
    4096,
    16384,
    1 << 18,
)

PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
SIGKILL = 9
_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = [s.encode() if isinstance(s, str) else s for s in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _hide(hide: list, keep: list) -> None:
    """Cover each ``hide`` directory with an empty tmpfs, then bind each ``keep`` path (read-only)
    back at its own path, through a descriptor opened before the tmpfs covered it."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    held = [(os.open(path, os.O_PATH | os.O_DIRECTORY), path) for path in keep]
    for path in hide:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    old = os.umask(0o022)  # the directories made here must let other users through (Ray's workers run with 077)
    try:
        for fd, path in held:
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_REC)
            os.close(fd)
    finally:
        os.umask(old)
    for path in hide:  # nothing more is written there
        _mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    # This pid namespace's own /proc: the host's would show every process's command line.
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _scratch(scratch: dict, uid) -> None:
    """Its writable places as private tmpfs mounts of ``scratch["bytes"]`` each, gone with its
    mount namespace: the world-writable directories (else it could fill the host's disk or
    memory for good, or delete other users' files in a world-writable directory without the
    sticky bit, such as Ray's session directory) and its own directory (main.py copied in)."""
    cwd = os.getcwd()
    with open("main.py", "rb") as f:
        program = f.read()
    opts = f"size={scratch['bytes']},nr_inodes={scratch['inodes']}"
    old = os.umask(0o022)
    try:
        for path in scratch["dirs"]:
            if os.path.isdir(path) and not os.path.islink(path):
                _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,{opts}")
        os.makedirs(cwd, mode=0o755, exist_ok=True)  # under /tmp it was just covered
        owner = f",uid={uid},gid={uid}" if uid is not None else ""
        _mount("tmpfs", cwd, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700{owner},{opts}")
        os.chdir(cwd)
        fd = os.open("main.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(program)
    finally:
        os.umask(old)


def _die_with_parent(alive_r: int) -> None:
    """SIGKILL when the launcher dies (the reward worker crashed): else a program that sleeps
    outlives it for good. Set after the last change of identity (which clears it); ``alive_r``
    at EOF means the launcher died before that."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(SIGKILL), 0, 0, 0), "pdeathsig")
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(125)
    os.close(alive_r)


def _child(spec: dict, alive_r: int) -> None:
    """In the new namespaces: limits, identity, then the program (never returns)."""
    if spec.get("cgroup"):  # its pids cgroup (root without a uid of its own): pids.max bounds it
        _write(os.path.join(spec["cgroup"], "cgroup.procs"), str(os.getpid()))
    if spec.get("keep") is not None:  # a mount namespace of its own (root)
        _hide(spec["hide"], spec["keep"])
    if spec.get("scratch"):
        _scratch(spec["scratch"], spec.get("uid"))
    for name, (soft, hard) in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if spec.get("uid") is not None:
        os.setgroups([])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
    else:
        if os.geteuid() == 0:  # root without a uid of its own: no capabilities after exec
            _drop_capabilities()  # RLIMIT_NPROC counts every process of this uid: leave room for those running now
        mine = sum(1 for p in os.listdir("/proc") if p.isdigit() and _owned(p))
        n = mine + spec["nproc"]
        resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
    # No setuid binary raises it back (its own uid included).
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), 0, 0, 0), "no_new_privs")
    _die_with_parent(alive_r)
    if spec.get("probe"):
        os._exit(0)
    os.execv(spec["argv"][0], spec["argv"])


def _drop_capabilities() -> None:
    """Empty the bounding set (root's capabilities after exec are its bounding set): then
    RLIMIT_NPROC binds root, and it cannot override file permissions, ptrace, mount or
    change its uid. No new privileges either (no setuid binaries)."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) != 0 and ctypes.get_errno() != 22:
            _check(-1, f"dropping capability {cap}")  # EINVAL: past the kernel's last capability


def _owned(pid: str) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def main() -> None:
    spec = json.loads(sys.argv[1])
    # Dies with the reward worker (a crash must not leave the program running): the worker's
    # thread waits on this process for the whole run, so its exit means the worker is gone.
    _check(_libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(SIGKILL), 0, 0, 0), "pdeathsig")
    if spec.get("parent") is not None and os.getppid() != spec["parent"]:
        os._exit(125)  # it died before the line above
    status = os.fdopen(spec["status_fd"], "w", buffering=1)
    os.set_inheritable(spec["status_fd"], False)
    flags = spec["unshare"]
    if flags:
        uid, gid = os.getuid(), os.getgid()
        if spec.get("userns"):
            flags |= CLONE_NEWUSER
        _check(_libc.unshare(ctypes.c_int(flags)), "unshare")
        if spec.get("userns"):  # map our own ids only: no privilege beyond our own inside
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
    alive_r, alive_w = os.pipe()  # the child sees EOF on alive_r once this process is gone
    # Why the program never ran, on a pipe that its exec closes (close-on-exec): an exit
    # status or stderr the program can forge would let it pass for the sandbox's failure.
    failed_r, failed_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            status.close()
            os.close(alive_w)
            os.close(failed_r)
            _child(spec, alive_r)
        except BaseException as e:  # the program never ran: say why
            why = f"{type(e).__name__}: {e}".replace("\n", " ")
            os.write(failed_w, why.encode())
            os.write(2, f"asyncrl sandbox: {why}\n".encode())
            os._exit(125)
    os.close(alive_r)
    os.close(failed_w)
    status.write(f"pid {pid}\n")
    failure = b"".join(iter(lambda: os.read(failed_r, 4096), b""))  # EOF: it ran (or exited in probe)
    if failure:
        status.write(f"failed {failure.decode(errors='replace')}\n")
    _, wait_status = os.waitpid(pid, 0)
    status.write(f"exit {wait_status}\n")
    status.close()


if __name__ == "__main__":
    main()
