"""SIGKILL the trainer two steps after its second checkpoint (steps trained into weights that die
with it), resume, and audit: every produced group is trained exactly once or accounted for.
Then Ctrl-C (SIGINT to the whole process group) the resumed job: it checkpoints, stops its
engines, actors and embedded Redis, and exits 0; nothing it started survives.

The default run covers the crash inside test_faults_during_a_run.py (phase 5); this is the
same fault alone, at the demo's full batch size (16 groups a step), so it is marked slow.
The two checks are independent and each needs a job at the demo's size, so one job serves
both: the SIGINT check is about the job it is sent to, which here is the resumed one.
"""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest

from asyncrl.rundir import complete_checkpoints, step_of
from tests.support.job import pid_running

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
STEPS, CKPT, GROUPS = 1000, 5, 16


def test_sigkill_between_step_and_checkpoint_then_resume_trains_each_group_exactly_once_and_sigint_leaves_nothing(
    train_job,
):
    job = train_job(
        "crash",
        f"control.total_steps={STEPS}",
        f"control.checkpoint_every={CKPT}",
        f"control.groups_per_step={GROUPS}",
        "rollout.n_samples=8",
    )
    job.start()
    killed_at = job.wait_for_step(2 * CKPT + 2, timeout=500)
    job.signal(signal.SIGKILL)
    job.wait(30)
    assert 2 * CKPT + 2 <= killed_at < 3 * CKPT, f"killed at step {killed_at}"

    # Resumed with the console on (the SIGINT check reads it) and no periodic checkpoint to
    # come, so the last checkpoint is the one SIGINT writes.
    shm_before = set(os.listdir("/dev/shm"))
    log_start = job.log_path.stat().st_size
    job.resume("monitor.console=true", "monitor.console_every=1", "control.checkpoint_every=100")
    job.wait_for_step(killed_at + 2, timeout=500)  # past the steps that died with the trainer
    started = {p.pid for p in psutil.Process(job.pid).children(recursive=True)}
    started.add(int((job.run_dir / "redis" / "redis.pid").read_text()))
    job.signal(signal.SIGINT)
    assert job.wait(180) == 0, job.log_tail()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(pid_running(p) for p in started):
        time.sleep(0.5)
    alive = [p for p in started if pid_running(p)]
    assert not alive, [psutil.Process(p).cmdline()[:3] for p in alive]
    leaked = {f for f in set(os.listdir("/dev/shm")) - shm_before if f.startswith(("psm_", "asyncrl-"))}
    assert not leaked, leaked

    # The resume started from the last checkpoint before the crash.
    assert f"resumed from {job.run_dir / 'checkpoints' / f'step_{2 * CKPT:06d}'}" in job.log_tail(200_000)
    extra = job.final_extra()
    # The SIGINT checkpoint (the resume's first): complete, past the crash.
    ckpts = complete_checkpoints(job.run_dir / "checkpoints")
    assert step_of(ckpts[-1]) == extra["step"]
    assert extra["step"] >= killed_at + 2, (extra["step"], killed_at)
    # It had announced versions past the checkpoint: the resume numbered its weights past them.
    assert extra["version"] - extra["version_offset"] == extra["step"]
    assert extra["version_offset"] > 0
    summary = job.audit().check().summary
    assert summary["trained"] == extra["step"] * GROUPS
    assert summary["lost"] == 0 and summary["double_trained"] == 0
    assert summary["produced"] >= summary["trained"]

    # A console people can read: asyncrl's own lines and the summary; no Ray worker or vLLM
    # output (it is in the Ray logs linked from the run dir), no progress bar redrawn into a file.
    console = job.log_path.read_bytes()[log_start:].decode(errors="replace")
    assert "run stopped: " in console and "resume          asyncrl train --resume" in console
    step_lines = [line for line in console.splitlines() if re.match(r"step \d+  reward", line)]
    # One line per step (rich wraps at 80 columns where there is no terminal, unless told not to).
    assert step_lines and all(re.search(r" step [\d.]+s$", line.rstrip()) for line in step_lines), console
    for noise in ("(GeneratorActor pid=", "(LearnerActor pid=", "Triton is not installed", "━"):
        assert noise not in console, (noise, console[-3000:])
    worker_logs = [p for p in (job.run_dir / "logs" / "ray").iterdir() if p.name.startswith("worker-")]
    assert any("Triton is not installed" in p.read_text(errors="replace") for p in worker_logs), worker_logs
