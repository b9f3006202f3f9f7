"""A full sync directory during a publish pauses the job like a Redis outage instead of ending
it with a traceback: the trainer says what is full and how much one export needs, retries with
backoff while the engines keep their weights, and trains on once there is space; only
sync.publish_deadline_s ends it, with a checkpoint and the resume command. Real job (trainer,
learner, generator); sync.shm_dir is a small tmpfs this test mounts (needs root)."""

from __future__ import annotations

import contextlib
import errno
import re
import subprocess
import time
from pathlib import Path

import pytest

from asyncrl.control.train import latest_checkpoint

pytestmark = pytest.mark.timeout(900)
MOUNT_MB = 4  # the demo's weights file is ~0.33 MB: room for the files a run keeps


@pytest.fixture
def small_tmpfs(tmp_path):
    path = tmp_path / "shm"
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={MOUNT_MB}m", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.decode().strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the filesystem is full; return it."""
    filler = directory / "filler"
    chunk = b"\0" * 65536
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return filler


def test_a_full_sync_dir_pauses_publishing_and_only_the_deadline_ends_the_run(train_job, small_tmpfs):
    job = train_job(
        "full",
        "control.total_steps=200",
        "sync.backend=shm",
        f"sync.shm_dir={small_tmpfs}",
        "sync.publish_deadline_s=25",
    )
    try:
        job.start()
        job.wait_for_step(3, timeout=400)
        filler = fill(small_tmpfs)
        time.sleep(10)  # well inside the deadline
        assert job.running(), job.log_tail()
        stuck = job.trainer_step()
        version = job.policy_version()
        time.sleep(3)
        assert job.trainer_step() == stuck and job.policy_version() == version  # waiting in the publish
        log = job.log_tail(400_000)
        said = re.search(
            rf"weights v(\d+) cannot be written to {re.escape(str(small_tmpfs))}/asyncrl-full-v\d+\.safetensors: "
            rf"{re.escape(str(small_tmpfs))} has [\d.]+ MB free of [\d.]+ MB; one export needs 0\.3 MB "
            r"\(.*No space left on device.*\)\. Retrying with backoff; the engines keep v\d+ and admission holds "
            r"the staleness bound \(sync\.publish_deadline_s=25s\)",
            log,
        )
        assert said, log[-4000:]
        filler.unlink()
        job.wait_for_step(stuck + 3, timeout=300)
        assert re.search(
            rf"weights v{said.group(1)} written to \S+ after \d+s of waiting for space", job.log_tail(400_000)
        )

        filler = fill(small_tmpfs)  # for good this time: past the deadline the run ends
        t0 = time.monotonic()
        assert job.wait(300) != 0
        print(f"the job ended {time.monotonic() - t0:.0f} s after the directory filled up")
        log = job.log_tail(400_000)
        found = re.search(
            r"could not be written to \S+ for \d+s \(\d+ attempts, sync\.publish_deadline_s=25\): .*; checkpointed "
            r"step (\d+)\. Resume once there is space for the weights: asyncrl train --resume (\S+)",
            log,
        )
        assert found, log[-4000:]
        assert found.group(2) == str(job.run_dir)
        ckpt = latest_checkpoint(job.run_dir)
        assert ckpt is not None and ckpt.name == f"step_{int(found.group(1)):06d}"
        assert "Traceback" not in log.split("checkpointed step")[0][-2000:]  # said before any traceback
    finally:
        with contextlib.suppress(FileNotFoundError):
            (small_tmpfs / "filler").unlink()
