"""SIGKILL the trainer two steps after its second checkpoint (steps trained into weights that die
with it), resume, and audit: every produced group is trained exactly once or accounted for.

The default run covers this fault inside test_faults_during_a_run.py (phase 5); this is the
same fault alone, at the demo's full batch size (16 groups a step), so it is marked slow.
"""

from __future__ import annotations

import signal

import pytest

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
STEPS, CKPT, GROUPS = 18, 5, 16


def test_sigkill_between_step_and_checkpoint_then_resume_trains_each_group_exactly_once(train_job):
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

    job.resume()
    assert job.wait(600) == 0, job.log_tail()
    assert f"resumed from {job.run_dir / 'checkpoints' / f'step_{2 * CKPT:06d}'}" in job.log_tail(200_000)
    extra = job.final_extra()
    # It had announced versions past the checkpoint: the resume numbered its weights past them.
    assert extra["step"] == STEPS and extra["version"] - extra["version_offset"] == STEPS
    assert extra["version_offset"] > 0
    summary = job.audit().check().summary
    assert summary["trained"] == STEPS * GROUPS
    assert summary["lost"] == 0 and summary["double_trained"] == 0
    assert summary["produced"] >= summary["trained"]
