"""A Redis outage past queue.outage_deadline_s ends a job, with a checkpoint and the resume
command, and the resume balances the exactly-once ledger. Real redis-server (SIGKILLed, started
again by the resume on its AOF), real trainer, generator and learner. (An outage longer than
queue.retry_deadline_s but without a deadline pauses a job instead of ending it: that check
runs inside tests/faults/test_bad_input_job.py's job, which needs no start of its own for it.)"""

from __future__ import annotations

import re
import time

import pytest

from asyncrl.control.train import latest_checkpoint
from asyncrl.rundir import step_of

pytestmark = pytest.mark.timeout(900)
GROUPS = 4  # tests/faults/conftest.py FAST: 4 groups a step, a checkpoint every 3


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
    assert ckpt is not None and step_of(ckpt) == step and step >= 4  # step_N, or step_N.rK if saved again

    # The resume brings the embedded server back on its AOF; the outage checkpoint acked
    # nothing, so its own groups are still pending and must be skipped, not trained again.
    job.resume()
    assert job.wait(600) == 0, job.log_tail()
    assert f"resumed from {ckpt}" in job.log_tail(200_000)
    summary = job.audit().check().summary
    assert summary["trained"] == STEPS * GROUPS
    assert summary["lost"] == 0 and summary["double_trained"] == 0
