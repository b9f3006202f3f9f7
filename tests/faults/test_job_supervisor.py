"""TrainJob's own contract, without a real training run: where it finds Redis, how it reads the
last complete checkpoint, and that a job which dies is reported at once (JobDied with the
log), not waited on until a timeout."""

from __future__ import annotations

import re
import time

import msgpack
import pytest

from asyncrl.queue.server import EmbeddedRedis
from tests.support.job import JobDied, TrainJob

ROOT_CFG = "configs/demo.yaml"


def test_redis_url_comes_from_the_embedded_servers_config_with_its_password(tmp_path):
    job = TrainJob(ROOT_CFG, run_dir=tmp_path / "r", run_name="r")
    assert job.redis_url() is None  # nothing started yet
    with EmbeddedRedis(tmp_path / "r" / "redis", password="p@ss/word") as server:
        assert job.redis_url() == f"redis://:p%40ss%2Fword@127.0.0.1:{server.port}/0"
        with job.client() as r:
            assert r.ping() is True
            r.hset("asyncrl:r:state", mapping={"policy_version": 7, "trainer_step": 8, "checkpoint_step": 5})
            r.hset("asyncrl:r:counters", mapping={"groups_trained": 28, "prompts_skipped": 3})
        assert (job.policy_version(), job.trainer_step(), job.checkpoint_step()) == (7, 8, 5)
        assert job.counters() == {"groups_trained": 28, "prompts_skipped": 3}
        assert job.processes() == {server.pid: job.processes()[server.pid]}
        assert "redis-server" in job.processes()[server.pid]
    assert job.state() == {}  # unreachable server: empty, not an exception


def test_final_trained_ids_skip_an_incomplete_checkpoint(tmp_path):
    job = TrainJob(ROOT_CFG, run_dir=tmp_path / "r", run_name="r")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        job.final_trained_ids()
    from asyncrl.control.ledger import record_trained

    for step, ids, complete in ((3, ["a", "b"], True), (6, ["c", "d"], False)):
        d = tmp_path / "r" / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        extra = {"step": step, "version": step, "trained_count": 2 * step // 3, "checkpoint_ids": ids}
        (d / "extra.msgpack").write_bytes(msgpack.packb(extra))
        if complete:
            (d / ".complete").touch()
        record_trained(tmp_path / "r", step, ids)
    record_trained(tmp_path / "r", 3, ["a", "b"])  # a resume from step 3 writes its line again
    assert job.final_trained_ids() == ["a", "b"]  # step 6 never finished writing
    assert job.final_extra()["step"] == 3
    with open(tmp_path / "r" / "trained_ids.jsonl", "a") as f:
        f.write('{"step": 9, "ids": ["e"')  # cut short by a crash: ignored
    assert job.final_trained_ids() == ["a", "b"]


def test_a_job_that_exits_is_reported_at_once_with_its_log(tmp_path):
    job = TrainJob(ROOT_CFG, ["learner.lr=-1"], run_dir=tmp_path / "bad", run_name="bad")
    job.start()
    t0 = time.monotonic()
    with pytest.raises(JobDied, match=re.escape("learner.lr")):
        job.wait_for_step(1, timeout=120)
    assert time.monotonic() - t0 < 60
    assert job.wait(10) == 2  # a config error
    job.cleanup()
    assert job.leftovers() == {}


def test_diagnosis_shows_the_runs_redis_state_and_folds_retry_warnings(tmp_path):
    from asyncrl.queue import RolloutQueue, RunState

    job = TrainJob(ROOT_CFG, run_dir=tmp_path / "d", run_name="d")
    retry = "Redis at redis://127.0.0.1:1/0: ConnectionError: refused.; retry {} in 0.05s"
    job.log_path.parent.mkdir(parents=True)
    job.log_path.write_text(
        "\n".join(["step 9 trained", *[retry.format(i) for i in range(1, 41)], "generator loop died", retry.format(1)])
        + "\n"
    )
    with EmbeddedRedis(tmp_path / "d" / "redis") as server:
        q = RolloutQueue.connect(server.url, "d")
        rs = RunState.of(q)
        rs.set_state(trainer_step=10)
        rs.heartbeat("gen-0", {"version": 9, "groups": 40})
        assert rs.admit_prompt("gen-0", "p1", b"note") is False  # no admission configured yet
        rs.configure_admission(max_staleness=1, groups_per_step=4)
        assert rs.admit_prompt("gen-0", "p1", b"note") is True
        text = job.diagnosis()
        q.close()
    assert "'trainer_step': '10'" in text and "'groups_started': 1" in text
    assert "stream length 0, pending 0" in text
    assert "generator gen-0: heartbeat" in text and "version 9, groups 40, 1 prompts noted in flight" in text
    assert text.endswith(
        "log tail:\nstep 9 trained\n... 40 Redis retry warnings ...\n"
        "generator loop died\n... 1 Redis retry warnings ..."
    )
    assert "(Redis state unreadable" in job.diagnosis()  # the server is gone: said, not raised
