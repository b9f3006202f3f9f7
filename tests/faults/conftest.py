"""Fault-suite fixtures: a supervised `asyncrl train` job (tests.support.job.TrainJob), always
cleaned up by PID (including a redis-server its restart_redis() started).

    def test_x(train_job):
        job = train_job("name", "control.total_steps=9")     # not started yet
        job.start(); job.wait_for_step(2, timeout=300)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.job import TrainJob

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
# Small steps so a fault lands between two checkpoints within seconds.
FAST = ["control.checkpoint_every=3", "control.groups_per_step=4", "rollout.n_samples=4", "control.batch_timeout_s=240"]


@pytest.fixture
def train_job(tmp_path):
    jobs: list[TrainJob] = []

    def make(name: str, *overrides: str, env: dict[str, str] | None = None) -> TrainJob:
        job = TrainJob(DEMO, [*FAST, *overrides], run_dir=tmp_path / name, run_name=name, env=env)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.cleanup()
