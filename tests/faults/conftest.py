"""Fault-suite fixtures: a supervised `asyncrl train` job (tests.support.job.TrainJob), always
cleaned up by PID (including a redis-server its restart_redis() started).

    def test_x(train_job):
        job = train_job("name", "control.total_steps=9")     # not started yet
        job.start(); job.wait_for_step(2, timeout=300)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.job import TrainJob

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
# Small steps so a fault lands between two checkpoints within seconds.
FAST = ["control.checkpoint_every=3", "control.groups_per_step=4", "rollout.n_samples=4", "control.batch_timeout_s=240"]


# Overrides after which the session's tiny model (seed 0) is not the one the job would write.
OWN_MODEL = ("rollout.model=", "control.seed=", "control.local_dir=")


@pytest.fixture
def train_job(tmp_path, tiny_model_dir):
    jobs: list[TrainJob] = []

    def make(name: str, *overrides: str, env: dict[str, str] | None = None, own_model: bool = False) -> TrainJob:
        """`own_model`: the job writes its tiny model itself (a test that checks the run dir's
        files, the model's included, as the trainer made them)."""
        job = TrainJob(DEMO, [*FAST, *overrides], run_dir=tmp_path / name, run_name=name, env=env)
        if not own_model and not any(o.startswith(OWN_MODEL) for o in overrides):
            # The demo's "tiny" model is deterministic (seed 0): a copy of the session's is the
            # files the trainer would write into its run dir, without the ~6 s of imports that
            # writing takes in each fresh job (the trainer's own writing is covered by every
            # in-process run; it skips a run dir that has the model).
            shutil.copytree(tiny_model_dir, job.run_dir / "tiny-model")
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.cleanup()
