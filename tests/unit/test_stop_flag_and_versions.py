"""The trainer's signal handling and its version bookkeeping across a resume, without a job.

StopFlag is installed by train() and again by TrainLoop.run() on the same flag, exactly as
below; the handlers are real (os.kill to this process)."""

from __future__ import annotations

import os
import signal

import pytest

from asyncrl.control.state import LoopState, StopFlag
from tests.support.sigint import sigint_state


def test_a_stop_flag_installed_twice_hands_the_second_signal_on_and_restores_on_exit():
    seen = []

    def outer(signum, frame):
        seen.append(signum)

    original = signal.signal(signal.SIGINT, outer)
    try:
        stop = StopFlag()
        stop.install()  # train()
        stop.install()  # TrainLoop.run()
        os.kill(os.getpid(), signal.SIGINT)  # first Ctrl-C: finish the step
        assert stop.is_set and seen == []
        os.kill(os.getpid(), signal.SIGINT)  # second Ctrl-C: what was there before us
        assert seen == [signal.SIGINT]
        stop.restore()  # TrainLoop.run() returns: train() still owns the handlers
        stop.restore()  # train() returns
        assert signal.getsignal(signal.SIGINT) is outer
        assert signal.getsignal(signal.SIGTERM) is not stop._handle
    finally:
        signal.signal(signal.SIGINT, original)


def test_after_train_returns_sigint_no_longer_belongs_to_the_flag():
    """From the handler an interactive Python has: a suite started in the background by a
    non-interactive shell (`pytest ... &`) inherits SIGINT ignored, and restoring that is right
    but would not show Ctrl-C working again."""
    user = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stop = StopFlag()
        stop.install()
        stop.install()
        assert signal.getsignal(signal.SIGINT) == stop._handle
        stop.restore()
        assert signal.getsignal(signal.SIGINT) == stop._handle  # the inner restore leaves it installed
        stop.restore()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        stop.restore()  # one too many: nothing to undo
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        # Below Python too: the kernel calls Python's handler and this thread takes the signal
        # (the suite's guard in conftest puts both back after any test that changed them).
        assert sigint_state() == ("python", False), sigint_state().describe()
        with pytest.raises(KeyboardInterrupt):  # Python's own handler is back
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, user)


def test_a_resume_continues_versions_past_every_announced_one_and_keeps_the_offset():
    state = LoopState(step=50, version=50, trained_count=800)
    assert state.continue_past(50, max_staleness=2) == 0 and state.version == 50  # nothing past the checkpoint
    assert state.continue_past(57, max_staleness=2) == 10
    # Every label up to 57 is now older than the staleness window of the first resumed step.
    assert state.version == 60 and state.version_offset == 10 and state.version - 2 > 57
    state.step, state.version = 53, 63
    again = LoopState.from_extra(state.to_extra())
    assert again.version == 63 and again.version_offset == 10 and again.version - again.version_offset == 53
    assert again.continue_past(70, max_staleness=0) == 8 and again.version_offset == 18
    assert LoopState.from_extra({"step": 3, "version": 3, "trained_count": 12}).version_offset == 0  # older checkpoints


SIGTERMED = """
import os, signal, subprocess, sys, time
from asyncrl.control.state import StopFlag
stop = StopFlag(grace_s=float(sys.argv[1]))
stop.install()
child = subprocess.Popen(["sleep", "300"], start_new_session=True)   # its own session, as Redis
print(child.pid, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
assert stop.is_set and stop.preempted, "the first SIGTERM only asks for a stop"
print("stopping", flush=True)
if sys.argv[2] == "twice":
    os.kill(os.getpid(), signal.SIGTERM)
time.sleep(60)    # a stop that hangs: the grace must end it
print("not reached", flush=True)
"""


@pytest.mark.parametrize(("grace", "how"), [(0.5, "once"), (300.0, "twice")])
def test_sigterm_stops_within_the_grace_or_at_a_second_one_with_status_143_and_stops_children(grace, how):
    """A stop that overruns control.shutdown_grace_s, or a second SIGTERM, exits at once with
    the requeue status, and still stops what the process started (a child in its own session,
    which neither a group signal nor our exit would reach)."""
    import subprocess
    import sys

    import psutil

    proc = subprocess.run(
        [sys.executable, "-c", SIGTERMED, str(grace), how], capture_output=True, text=True, timeout=120
    )
    out = proc.stdout.split()
    assert proc.returncode == 143, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert out[1:] == ["stopping"], proc.stdout
    reason = "a second SIGTERM" if how == "twice" else "shutdown grace of 0.5 s passed"
    assert reason in proc.stderr, proc.stderr[-2000:]
    child = int(out[0])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
