"""SIGKILL the trainer between an optimizer step and the next checkpoint, resume, and audit:
every produced group is trained exactly once or accounted for (dropped-stale, dead-lettered,
still queued); nothing is lost, nothing trained twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import redis

from asyncrl.control.ledger import audit
from asyncrl.queue import RolloutQueue
from asyncrl.queue.server import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)
STEPS, CKPT_EVERY, GROUPS = 18, 5, 16


def _train(run_dir: Path, log: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "train", *extra], cwd=ROOT, start_new_session=True,
        stdout=log.open("a"), stderr=subprocess.STDOUT,
    )


def _policy_version(run_dir: Path, run: str) -> int:
    conf = run_dir / "redis" / "redis.conf"
    if not conf.exists():
        return 0
    port = next(int(x.split()[1]) for x in conf.read_text().splitlines() if x.startswith("port "))
    try:
        return int(redis.Redis(port=port, socket_timeout=2).hget(f"asyncrl:{run}:state", "policy_version") or 0)
    except redis.RedisError:
        return 0


def test_sigkill_between_step_and_checkpoint_then_resume_trains_each_group_exactly_once(tmp_path):
    run, run_dir, log = "crash", tmp_path / "crash", tmp_path / "train.log"
    proc = _train(run_dir, log, str(ROOT / "configs" / "demo.yaml"), f"control.run_dir={run_dir}",
                  f"control.run_name={run}", f"control.total_steps={STEPS}",
                  f"control.checkpoint_every={CKPT_EVERY}", "queue.ledger=true", "monitor.dashboard=false")
    try:
        # Kill two steps after the second checkpoint: those steps' groups are trained into
        # weights that die with the process, and must come back.
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and _policy_version(run_dir, run) < 2 * CKPT_EVERY + 2:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.3)
        killed_at = _policy_version(run_dir, run)
        assert 2 * CKPT_EVERY + 2 <= killed_at < 3 * CKPT_EVERY, f"killed at version {killed_at}"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    resumed = _train(run_dir, log, "--resume", str(run_dir))
    assert resumed.wait(timeout=600) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{2 * CKPT_EVERY:06d}'}" in text

    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    extra = msgpack.unpackb((final / "extra.msgpack").read_bytes(), raw=False)
    assert extra["step"] == STEPS and extra["version"] == STEPS
    with EmbeddedRedis(run_dir / "redis", aof=True) as server:
        q = RolloutQueue.connect(server.url, run, ledger=True)
        ledger = audit(q, extra["trained_ids"]).check()
        q.close()
    summary = ledger.summary
    assert summary["trained"] == STEPS * GROUPS
    assert summary["lost"] == 0 and summary["double_trained"] == 0
    assert summary["produced"] >= summary["trained"]
