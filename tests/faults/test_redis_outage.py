"""A Redis outage longer than queue.retry_deadline_s pauses a job instead of ending it; only
queue.outage_deadline_s ends it, with a checkpoint and the resume command. Real redis-server
(SIGKILLed, started again later on its AOF), real trainer, generator and learner; the
exactly-once ledger must balance either way."""

from __future__ import annotations

import re
import time

import pytest

from asyncrl.control.train import latest_checkpoint
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(900)
GROUPS = 4  # tests/faults/conftest.py FAST: 4 groups a step, a checkpoint every 3


def test_an_outage_past_the_retry_deadline_pauses_the_job_and_it_trains_on(train_job):
    STEPS = 60  # still running a few steps after Redis is back, for the generator check
    job = train_job(
        "pause",
        f"control.total_steps={STEPS}",
        "queue.retry_deadline_s=2",
        # Shorter than the outage: heartbeats written before it must not get the generator
        # killed once Redis is back (their age counts from its return).
        "rollout.heartbeat_timeout_s=6",
    )
    job.start()
    job.wait_for_step(3, timeout=400)
    (gen,) = job.pids_named("ray::GeneratorActor")
    job.kill_redis()
    t0 = time.monotonic()
    # The outage lasts until the trainer has said it is waiting past its retry deadline, and at
    # least six retry deadlines and two heartbeat timeouts; the job must be alive all along.
    waiting = re.compile(r"redis at \S+ unreachable for \d+s; waiting")
    wait_for(
        lambda: not job.running() or (waiting.search(job.log_tail(400_000)) and time.monotonic() - t0 >= 12),
        300,
        "the trainer waiting out the outage",
        interval=0.5,
    )
    assert job.running(), job.log_tail()
    job.start_redis()
    before = job.trainer_step()
    job.wait_for_step(before + 3, timeout=120)
    assert job.pids_named("ray::GeneratorActor") == [gen]  # it waited; nothing restarted it
    assert job.wait(400) == 0, job.log_tail()

    log = job.log_tail(400_000)
    assert re.search(r"redis at \S+ unreachable for \d+s; waiting \(queue\.outage_deadline_s=none\)", log), log[-3000:]
    assert "no heartbeat for" not in log  # the watchdog did not take the outage for a hang
    assert job.final_extra()["step"] == STEPS
    summary = job.audit().check().summary
    assert summary["trained"] == STEPS * GROUPS
    assert summary["lost"] == 0 and summary["double_trained"] == 0


def test_an_outage_past_outage_deadline_checkpoints_prints_the_resume_command_and_resumes(train_job):
    STEPS = 24
    job = train_job("deadline", f"control.total_steps={STEPS}", "queue.retry_deadline_s=1", "queue.outage_deadline_s=4")
    job.start()
    job.wait_for_step(4, timeout=400)
    job.kill_redis()
    t0 = time.monotonic()
    assert job.wait(300) != 0
    print(f"the job ended {time.monotonic() - t0:.0f} s into the outage")
    log = job.log_tail(400_000)
    found = re.search(
        r"outage_deadline_s=4\); checkpointed step (\d+)\. Resume once Redis is back: asyncrl train --resume (\S+)", log
    )
    assert found, log[-4000:]
    step = int(found.group(1))
    assert found.group(2) == str(job.run_dir)
    ckpt = latest_checkpoint(job.run_dir)
    assert ckpt is not None and ckpt.name == f"step_{step:06d}" and step >= 4

    # The resume brings the embedded server back on its AOF; the outage checkpoint acked
    # nothing, so its own groups are still pending and must be skipped, not trained again.
    job.resume()
    assert job.wait(600) == 0, job.log_tail()
    assert f"resumed from {ckpt}" in job.log_tail(200_000)
    summary = job.audit().check().summary
    assert summary["trained"] == STEPS * GROUPS
    assert summary["lost"] == 0 and summary["double_trained"] == 0
