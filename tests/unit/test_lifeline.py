"""The lifeline (asyncrl.lifeline): once the run's process is SIGKILLed, what it started (exec'd
with its token, or forked and registered) is stopped, and what it did not start is left alone.
Real processes: a parent script that starts a lifeline, children, then kills itself."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from asyncrl.lifeline import TOKEN_ENV, Lifeline, marked_processes

PARENT = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    import psutil
    from asyncrl.lifeline import Lifeline
    line = Lifeline.start(shm_globs=[sys.argv[1] + "/weights-*"])
    open(sys.argv[1] + "/weights-v3", "w").write("x")
    # exec'd: carries the token; its own session, as redis-server's is
    execd = subprocess.Popen(["sleep", "300"], start_new_session=True)
    # forked: keeps the parent's exec-time environment (no token): registered instead
    pid = os.fork()
    if pid == 0:
        os.setsid()
        time.sleep(300)
        os._exit(0)
    line.register([[pid, psutil.Process(pid).create_time()]])
    # exec'd with its environment wiped (as a setproctitle wipes what /proc shows): no token,
    # never registered by hand; the lifeline's watcher must register it as a descendant
    blank = subprocess.Popen(["sleep", "300"], env={}, start_new_session=True)
    deadline = time.monotonic() + 30
    while blank.pid not in [p for p, _ in line.registered] and time.monotonic() < deadline:
        time.sleep(0.1)
    print(execd.pid, pid, line.proc.pid, blank.pid, flush=True)
    sys.stdin.read()             # until the test has looked
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_a_sigkilled_run_leaves_nothing_it_started_and_spares_what_it_did_not(tmp_path):
    unrelated = subprocess.Popen(["sleep", "300"], start_new_session=True)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    execd = forked = lifeline = blank = 0
    try:
        execd, forked, lifeline, blank = map(int, parent.stdout.readline().split())
        with open(f"/proc/{execd}/environ", "rb") as f:
            token = f.read().split(b"\0")
        assert any(e.startswith(f"{TOKEN_ENV}=".encode()) for e in token)
        assert psutil.Process(lifeline).is_running() and (tmp_path / "weights-v3").exists()
        parent.stdin.close()  # the parent SIGKILLs itself
        parent.wait(30)
        assert parent.returncode == -signal.SIGKILL
        assert _gone(execd) and _gone(forked), "the lifeline left the run's processes running"
        assert _gone(blank), "a descendant without the token (a retitled process) outlived the run"
        assert _gone(lifeline), "the lifeline did not exit after its sweep"
        assert not (tmp_path / "weights-v3").exists()
        assert unrelated.poll() is None, "the lifeline killed a process the run did not start"
    finally:
        for pid in (execd, forked, lifeline, blank):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        unrelated.kill()
        unrelated.wait()
        parent.kill()
        parent.wait()


def test_a_clean_close_sweeps_nothing_and_restores_the_environment(tmp_path):
    before = os.environ.get(TOKEN_ENV)
    line = Lifeline.start()
    try:
        assert os.environ[TOKEN_ENV] == line.token and Lifeline.current is line
        child = subprocess.Popen(["sleep", "300"])
        assert marked_processes(TOKEN_ENV, line.token) == [child.pid]
        child.kill()
        child.wait()
    finally:
        line.close()
    assert line.proc.returncode == 0 and Lifeline.current is None
    assert os.environ.get(TOKEN_ENV) == before


def test_what_ran_before_the_lifeline_started_is_not_its_to_sweep(monkeypatch):
    """A process that calls `asyncrl generate` in-process (a test session with its own Redis and
    Ray, a notebook) already has children: the watcher registers only what the run started, so
    a clean close (or the run's death) leaves the caller's own children running."""
    monkeypatch.setattr("asyncrl.lifeline.WATCH_S", 0.05)
    before = subprocess.Popen(["sleep", "300"], env={})  # no token either way
    line = Lifeline.start()
    after = None
    try:
        after = subprocess.Popen(["sleep", "300"], env={})
        deadline = time.monotonic() + 30
        while after.pid not in [p for p, _ in line.registered] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert after.pid in [p for p, _ in line.registered], "the watcher missed the run's own child"
        assert before.pid not in [p for p, _ in line.registered]
    finally:
        if after is not None:  # ours to reap (the lifeline would wait out a zombie's grace)
            after.kill()
            after.wait()
        line.close()
        alive = before.poll() is None
        before.kill()
        before.wait()
    assert alive, "the lifeline swept a process its caller had started before the run"


def test_short_lived_children_do_not_pile_up_in_the_registry(monkeypatch):
    """A run whose rewards start a process per sample registers thousands that are gone a
    second later: the registry keeps only the living (hard_exit walks it, the lifeline holds
    it for the whole run), and what is still alive stays registered."""
    monkeypatch.setattr("asyncrl.lifeline.WATCH_S", 0.05)
    line = Lifeline.start()
    keep = None
    try:
        keep = subprocess.Popen(["sleep", "300"], env={})
        for _ in range(10):
            subprocess.Popen(["sleep", "0.15"], env={}).wait()
        deadline = time.monotonic() + 30
        while keep.pid not in [p for p, _ in line.registered] and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # a few more passes, every short-lived child gone
        assert [p for p, _ in line.registered] == [keep.pid]
    finally:
        if keep is not None:
            keep.kill()
            keep.wait()
        line.close()
    from asyncrl.lifeline import _prune_dead  # the lifeline's own registry, pruned the same way

    gone = [(keep.pid, 1.0), (2**22 + 1, 2.0)]
    me = (os.getpid(), psutil.Process().create_time())
    assert _prune_dead({me, *gone}) == {me}


def test_a_zombie_is_not_counted_as_left_running():
    """A process that has ended but is not yet reaped (Ray's idle workers as the raylet goes) is
    nothing to stop: the sweep neither signals nor reports it as one the run left."""
    from asyncrl.lifeline import _alive

    child = subprocess.Popen(["true"])
    try:
        proc = psutil.Process(child.pid)
        record = (child.pid, proc.create_time())
        deadline = time.monotonic() + 30
        while proc.status() != psutil.STATUS_ZOMBIE:  # ended; not reaped, since we do not wait yet
            assert time.monotonic() < deadline, "the child never ended"
            time.sleep(0.01)
        assert _alive([record]) == []
    finally:
        child.wait()


def test_a_process_whose_main_thread_exited_is_still_swept():
    """A process whose main thread ended (pthread_exit) while another runs shows as a zombie, yet
    runs on: it is still one the run left, and the sweep stops it."""
    from asyncrl.lifeline import _alive

    code = (
        "import ctypes, threading, time; threading.Thread(target=time.sleep, args=(300,)).start(); "
        "ctypes.CDLL(None).pthread_exit(None)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, TOKEN_ENV: "main-thread-exited"})
    try:
        proc = psutil.Process(child.pid)
        record = (child.pid, proc.create_time())
        deadline = time.monotonic() + 30
        while proc.status() != psutil.STATUS_ZOMBIE:  # the main thread has exited
            assert time.monotonic() < deadline, "the main thread never exited"
            time.sleep(0.01)
        assert proc.num_threads() == 2  # the sleeping thread runs on
        assert _alive([record]) == [child.pid]
        # exec'd with the run's token, it is found by it too (the leader's environ is gone)
        assert child.pid in marked_processes(TOKEN_ENV, "main-thread-exited")
    finally:
        child.kill()
        child.wait()
