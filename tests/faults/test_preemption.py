"""A scheduler's stop, on one demo job: SIGTERM to an elastic generator and then to the trainer
mid-run (each drains or checkpoints, stops what it started and exits 143, "requeue me"), and a
resume that finishes with the exactly-once ledger balanced. (A SIGKILLed trainer leaving no
orphan is checked in test_faults_during_a_run.py, phase 5, on a job that is there anyway.)

SIGTERM goes to the trainer's PID alone, as Kubernetes signals a container's first process and
Slurm's ``--signal=B:TERM@120`` the batch shell (docs/guide/clusters.md). One job serves every
check: each needs a run at step > 0 with engines up, and start-ups are the suite's cost.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from tests.support.job import elastic_generator_argv
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(1200)
GRACE = 90  # control.shutdown_grace_s: a loaded 2-core box must not need the hard exit


def _left(job_pids: set[int], since: dict[int, float], session: int, timeout: float = 60.0) -> list[str]:
    """What is still alive after `timeout`: processes seen (by PID and create time) and any
    process in the job's session or process group (the job runs in its own: pid == sid == pgid)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for p in psutil.process_iter(["pid", "create_time", "cmdline", "status"]):
            with_us = False
            with contextlib.suppress(OSError):
                with_us = os.getsid(p.pid) == session or os.getpgid(p.pid) == session
            seen = p.pid in job_pids and since.get(p.pid) == p.info["create_time"]
            if (seen or with_us) and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join((p.info['cmdline'] or [])[:3])}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _generator_groups(job, generator_id: str) -> int:
    from asyncrl.queue import RunState

    q = job.queue()
    try:
        beat = RunState.of(q).generators().get(generator_id)
        return 0 if beat is None else beat.groups
    finally:
        q.close()


def test_sigterm_to_generate_and_train_stops_everything_exits_143_and_the_resume_balances(train_job, tmp_path):
    job = train_job(
        "preempt", "control.total_steps=100000", "control.checkpoint_every=100", f"control.shutdown_grace_s={GRACE}"
    )
    job.start()
    # The elastic generator starts as soon as the job has published its config (a joiner needs
    # nothing more): its own start-up (vLLM's imports, its engine's) then overlaps the trainer's
    # learner and engine start-up instead of following it, with the trainer training at full
    # speed and writing checkpoints meanwhile.
    wait_for(lambda: "model_path" in job.state() or not job.running(), 500, "the job's published config")
    assert job.running(), job.diagnosis()

    # 1. An elastic generator joins, produces, and is SIGTERMed: it drains and leaves with 143,
    #    its engine processes stopped.
    gen_log = (tmp_path / "elastic.log").open("w")
    gen = subprocess.Popen(
        elastic_generator_argv(job.redis_url(), job.run_name, "elastic-1"),
        stdout=gen_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        job.wait_for_step(2, timeout=500)  # JobDied, with its log, if the job ends instead
        deadline = time.monotonic() + 400
        while _generator_groups(job, "elastic-1") < 1:
            assert gen.poll() is None and time.monotonic() < deadline, (tmp_path / "elastic.log").read_text()[-3000:]
            time.sleep(0.5)
        gen_tree = {p.pid: p.create_time() for p in psutil.Process(gen.pid).children(recursive=True)}
        assert gen_tree, "the elastic generator's engine processes"
        gen.send_signal(signal.SIGTERM)
        assert gen.wait(GRACE + 60) == 143, (tmp_path / "elastic.log").read_text()[-3000:]
    finally:
        if gen.poll() is None:
            gen.kill()
            gen.wait()
    gen_text = (tmp_path / "elastic.log").read_text()
    assert "shutdown grace" not in gen_text and "leaving run" in gen_text, gen_text[-3000:]
    assert not _left(set(gen_tree), gen_tree, gen.pid), "the elastic generator left processes"
    assert "elastic-1" not in json.dumps(list(_job_generators(job)))  # it left the job

    # 2. The trainer, SIGTERMed mid-run: a checkpoint at or after its step, the summary and the
    #    resume command, every process it started stopped, exit status 143.
    job.wait_for_step(job.trainer_step() + 2, timeout=300)
    job.processes()
    step = job.trainer_step()
    log_start = job.log_path.stat().st_size
    os.kill(job.pid, signal.SIGTERM)
    assert job.wait(GRACE + 60) == 143, job.log_tail()
    text = job.log_path.read_bytes()[log_start:].decode(errors="replace")
    assert "shutdown grace" not in text and "*** SIGTERM received" not in text, text[-4000:]
    assert "asyncrl train: stopped by SIGTERM at step" in text and f"--resume {job.run_dir}" in text, text[-3000:]
    assert "run preempted: " in text, text[-3000:]
    extra = job.final_extra()
    assert extra["step"] >= step, (extra["step"], step)
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["step"] == extra["step"]
    assert summary["resume"] == f"asyncrl train --resume {job.run_dir}"
    seen = dict(job._seen)
    left = _left(set(seen), seen, job.pid)
    assert not left, left
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"asyncrl-{job.run_name}-")]

    # 3. The resume finishes; every produced group is trained exactly once or accounted for.
    job.resume(f"control.total_steps={extra['step'] + 4}")
    assert job.wait(600) == 0, job.log_tail()
    audit = job.audit().check().summary
    assert audit["lost"] == 0 and audit["double_trained"] == 0
    assert audit["trained"] == (extra["step"] + 4) * 4  # FAST: 4 groups a step


def _job_generators(job) -> dict:
    from asyncrl.queue import RunState

    q = job.queue()
    try:
        return RunState.of(q).generators()
    finally:
        q.close()
