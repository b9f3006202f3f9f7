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
import threading
import time
from pathlib import Path

import pytest

from asyncrl.control.train import latest_checkpoint
from asyncrl.rundir import step_of
from tests.support.waiting import holds_for, wait_for

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


class Filler:
    """Keeps a filesystem full, as another process writing to it would: the run deletes older
    weight files after each publish, and that space is taken again at once."""

    def __init__(self, directory: Path):
        self.path = directory / "filler"
        self.stop = threading.Event()
        self.full = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.full.wait(30), "the filesystem never filled up"

    def _run(self) -> None:
        chunk = b"\0" * 4096
        with open(self.path, "ab", buffering=0) as f:
            while not self.stop.is_set():
                try:
                    f.write(chunk)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    self.full.set()
                    time.sleep(0.01)

    def free(self) -> None:
        self.stop.set()
        self.thread.join(10)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def test_a_full_sync_dir_pauses_publishing_and_only_the_deadline_ends_the_run(train_job, small_tmpfs):
    job = train_job(
        "full",
        "control.total_steps=1000",
        "sync.backend=shm",
        f"sync.shm_dir={small_tmpfs}",
        # Outlasts the first full spell (freed after a 3 s hold; written at the retry 7 s in, or
        # 15 s in on a slow box); the second spell is waited out to this deadline.
        "sync.publish_deadline_s=15",
    )
    filler: Filler | None = None
    try:
        job.start()
        job.wait_for_step(3, timeout=400)
        filler = Filler(small_tmpfs)
        # Once the trainer says it cannot write the weights it waits in the publish, well inside
        # the deadline: alive, and neither its step nor the policy version moves.
        wait_for(
            lambda: not job.running() or "cannot be written to" in job.log_tail(400_000),
            60,
            "the trainer reporting the full directory",
            interval=0.2,
        )
        assert job.running(), job.log_tail()
        stuck = job.trainer_step()
        version = job.policy_version()
        holds_for(
            lambda: job.running() and job.trainer_step() == stuck and job.policy_version() == version,
            3,
            "waiting in the publish",
            interval=0.2,
        )
        log = job.log_tail(400_000)
        said = re.search(
            rf"weights v(\d+) cannot be written to {re.escape(str(small_tmpfs))}/asyncrl-full-v\d+\.safetensors: "
            rf"{re.escape(str(small_tmpfs))} has [\d.]+ MB free of [\d.]+ MB; one export needs 0\.3 MB "
            r"\(.*No space left on device.*\)\. Retrying with backoff; the engines keep v\d+ and admission holds "
            r"the staleness bound \(sync\.publish_deadline_s=15s\)",
            log,
        )
        assert said, log[-4000:]
        filler.free()
        job.wait_for_step(stuck + 3, timeout=300)
        assert re.search(
            rf"weights v{said.group(1)} written to \S+ after \d+s of waiting for space", job.log_tail(400_000)
        )

        filler = Filler(small_tmpfs)  # for good this time: past the deadline the run ends
        t0 = time.monotonic()
        assert job.wait(300) != 0
        print(f"the job ended {time.monotonic() - t0:.0f} s after the directory filled up")
        log = job.log_tail(400_000)
        found = re.search(
            r"could not be written to \S+ for \d+s \(\d+ attempts, sync\.publish_deadline_s=15\): .*; checkpointed "
            r"step (\d+)\. Resume once there is space for the weights: asyncrl train --resume (\S+)",
            log,
        )
        assert found, log[-4000:]
        assert found.group(2) == str(job.run_dir)
        ckpt = latest_checkpoint(job.run_dir)
        assert ckpt is not None and step_of(ckpt) == int(found.group(1))  # step_N, or step_N.rK if saved again
        assert "Traceback" not in log.split("checkpointed step")[0][-2000:]  # said before any traceback
    finally:
        if filler is not None:
            filler.free()
