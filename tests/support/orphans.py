"""What a block of a test left running, told apart from whatever else runs on the box (the
suite's other lane, other users): this process becomes a child subreaper for the block, so an
orphan of anything the block started is re-parented to it instead of to init, and "left
behind" is exactly its new descendants still alive.

    with adopting() as left:
        sandbox.run(fork_bomb)
    assert left == []            # pids (alive after a grace) the block started and left behind

Use it only around code that this thread alone starts children in: a new child of this process
that has exited by the end is reaped here, which would take the exit status from another
thread's subprocess.Popen.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Iterator

import psutil

PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37


def _prctl(option: int, arg: int | ctypes._Pointer) -> None:  # type: ignore[type-arg]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def is_subreaper() -> bool:
    flag = ctypes.c_int(0)
    _prctl(PR_GET_CHILD_SUBREAPER, ctypes.pointer(flag))
    return bool(flag.value)


def _descendants() -> dict[int, psutil.Process]:
    return {p.pid: p for p in psutil.Process().children(recursive=True)}


def _reap(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _alive(procs: dict[int, psutil.Process]) -> list[int]:
    out = []
    for pid, p in procs.items():
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return sorted(out)


@contextlib.contextmanager
def adopting(grace_s: float = 10.0) -> Iterator[list[int]]:
    """Subreaper for the block; on exit the yielded list holds the pids of new descendants
    still alive after `grace_s` (those are then SIGKILLed, so no test inherits them). The
    previous subreaper setting is restored."""
    was = is_subreaper()
    before = set(_descendants())
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    left: list[int] = []
    try:
        yield left
    finally:
        deadline = time.monotonic() + grace_s
        while True:
            new = {pid: p for pid, p in _descendants().items() if pid not in before}
            _reap({pid for pid, p in new.items() if p.ppid() == os.getpid()})
            alive = _alive(new)
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        left[:] = alive
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in alive:  # ours now (adopted): wait for each, so none stays a zombie
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, 0)
        _prctl(PR_SET_CHILD_SUBREAPER, int(was))
