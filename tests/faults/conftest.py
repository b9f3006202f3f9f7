"""Fault-suite fixtures: a supervised `asyncrl train` job (asyncrl.control.job.TrainJob) that
is always cleaned up by PID, and helpers to hurt its Redis.

    def test_x(train_job):
        job = train_job("name", "control.total_steps=9")     # not started yet
        job.start(); job.wait_for_step(2, timeout=300)
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from asyncrl.control.job import TrainJob

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
# Small steps so a fault lands between two checkpoints within seconds.
FAST = ["control.checkpoint_every=3", "control.groups_per_step=4", "rollout.n_samples=4",
        "control.batch_timeout_s=240"]


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


@pytest.fixture
def redis_restarter():
    """restart(job, down_s): see _restart_redis; the servers it starts are killed at the end."""
    started: list[subprocess.Popen] = []

    def restart(job: TrainJob, down_s: float = 1.0) -> subprocess.Popen:
        proc = _restart_redis(job, down_s)
        started.append(proc)
        return proc

    yield restart
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _restart_redis(job: TrainJob, down_s: float = 1.0) -> subprocess.Popen:
    """SIGKILL the job's redis-server (a crash, no shutdown) and start a new one on the same
    config: same port, same AOF. Returns the new server; the job's next resume (or the test)
    stops it, by PID."""
    from asyncrl.queue.server import find_redis_server

    redis_dir = job.run_dir / "redis"
    old = int((redis_dir / "redis.pid").read_text())
    os.kill(old, 9)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.waitpid(old, os.WNOHANG)
        except ChildProcessError:
            pass
        if not os.path.exists(f"/proc/{old}") or open(f"/proc/{old}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    time.sleep(down_s)
    proc = subprocess.Popen([find_redis_server(), str(redis_dir / "redis.conf")], cwd=redis_dir,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with job.client() as r:
                if r.info("server")["process_id"] == proc.pid and r.info("persistence")["loading"] == 0:
                    return proc
        except Exception:
            pass
        time.sleep(0.05)
    raise RuntimeError("restarted redis-server did not come up")
