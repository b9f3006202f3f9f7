"""One secured CPU demo job (queue.password set, learner.num_ranks=2) fed a hostile user
environment, then hurt by killing a learner rank:

- prompts longer than the engine's max length are skipped and counted (`prompts_skipped`);
- a reward function that raises, returns None or returns NaN is recorded per sample (reward
  NaN, the error text) and the run goes on training;
- the embedded Redis binds 127.0.0.1 with protected mode on and refuses a client without
  the password; the dashboard listens on 127.0.0.1 only;
- the password and the dashboard token are in no Redis key, no dashboard answer (live and
  finished-run), no log and no file of the run dir but config.yaml and redis.conf, and the
  run's files are private (0600 / 0700);
- a Redis outage longer than queue.retry_deadline_s pauses the job instead of ending it: it
  says it waits, the heartbeats written before the outage do not get the generator killed once
  Redis is back, and it trains on (that check shares this job: it needs a running job and is
  independent of the others, which it precedes only in the rank kill);
- a SIGKILLed learner rank fails the step cleanly (LearnerError, non-zero exit, no hang,
  nothing left running), and `--resume` finishes the run with a balanced ledger.

The environment is user code named by import path: a module written to the test's tmp dir
and put on PYTHONPATH for the job (the trainer passes PYTHONPATH on to every Ray worker).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
import urllib.request

import psutil
import pytest
import redis
from starlette.testclient import TestClient

from asyncrl.config import REDACTED
from asyncrl.data.codec import RecordError, decode_group
from asyncrl.monitor.dashboard.app import create_run_dir_app
from asyncrl.queue.server import free_port
from asyncrl.rundir import CONFIG_FILE
from tests.support.leaks import assert_no_secret, check_run_dir, redis_values
from tests.support.waiting import holds_for, wait_for

pytestmark = pytest.mark.timeout(900)
GROUPS = 4
PASSWORD = "fault-suite-pw"
TOKEN = "fault-suite-dashboard-token"
LONG_PROMPT = "abc" * 27 + "="  # 82 characters, one token each: > engine_max_model_len=64

ENV_MODULE = f'''
"""A copy task with hostile prompts and a reward that fails three ways (fault-suite env)."""
import math

from asyncrl.rollout.envs.synthetic import CopyEnv


class FlakyCopy(CopyEnv):
    def make_prompt(self, rng):
        prompt, meta = super().make_prompt(rng)
        if rng.random() < 0.25:
            return {LONG_PROMPT!r}, {{"target": "abc"}}
        return prompt, meta

    def reward(self, prompt, response, metadata):
        bucket = sum(map(ord, response)) % 4
        if bucket == 0:
            raise ValueError("flaky reward")
        if bucket == 1:
            return None
        if bucket == 2:
            return math.nan
        return super().reward(prompt, response, metadata)
'''


def _queued_samples(job) -> list:
    """Samples of the groups now in the stream (read with XRANGE: nothing is consumed)."""
    out = []
    with job.client() as r:
        for _, fields in r.xrange(f"asyncrl:{job.run_name}:rollouts"):
            try:
                out += decode_group(fields[b"d"]).samples
            except RecordError:
                continue
    return out


def test_hostile_env_secured_job_and_a_killed_learner_rank(train_job, tmp_path):
    (tmp_path / "flaky_env.py").write_text(ENV_MODULE)
    dashboard_port = free_port()
    job = train_job(
        "hostile",
        "control.total_steps=1000",
        "rollout.env=flaky_env:FlakyCopy",
        "learner.num_ranks=2",
        f"queue.password={PASSWORD}",
        "monitor.dashboard=true",
        f"monitor.dashboard_port={dashboard_port}",
        f"monitor.dashboard_token={TOKEN}",
        "learner.collective_timeout_s=60",
        "queue.retry_deadline_s=2",
        # Shorter than the outage below: heartbeats written before it must not get the
        # generator killed once Redis is back (their age counts from its return).
        "rollout.heartbeat_timeout_s=6",
        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))},
        own_model=True,  # its model files are among the run's files checked private below
    )
    job.start()
    job.wait_for_step(2, timeout=500)

    # Long prompts: skipped and counted, never sent to the engine.
    assert job.counters().get("prompts_skipped", 0) > 0

    # Failed rewards: recorded per sample, NaN with the error text (poll: groups get acked).
    seen: dict[str, int] = {"raised": 0, "none": 0, "nan": 0}
    deadline = time.monotonic() + 120
    while min(seen.values()) == 0 and time.monotonic() < deadline:
        for s in _queued_samples(job):
            if s.error is None:
                assert math.isfinite(s.reward)
                continue
            assert math.isnan(s.reward), (s.reward, s.error)
            if "raised ValueError: flaky reward" in s.error:
                seen["raised"] += 1
            elif "returned None" in s.error:
                seen["none"] += 1
            elif "returned nan" in s.error:
                seen["nan"] += 1
            else:
                raise AssertionError(f"unexpected reward error text {s.error!r}")
        time.sleep(0.5)
    assert min(seen.values()) > 0, seen
    job.wait_for_step(job.trainer_step() + 1, timeout=120)  # still training

    # Bindings and the password.
    url = job.redis_url()
    assert f":{PASSWORD}@127.0.0.1:" in url
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with redis.Redis(host="127.0.0.1", port=port, socket_timeout=5) as anon, pytest.raises(redis.AuthenticationError):
        anon.ping()
    with (
        redis.Redis(host="127.0.0.1", port=port, password="wrong", socket_timeout=5) as wrong,
        pytest.raises(redis.AuthenticationError),
    ):
        wrong.ping()
    conf = (job.run_dir / "redis" / "redis.conf").read_text().splitlines()
    assert "bind 127.0.0.1" in conf and "protected-mode yes" in conf
    with job.client() as r:
        # Even with the password, nobody reconfigures the server or has it write files.
        for command in (("CONFIG", "SET", "dir", str(tmp_path)), ("MODULE", "LOAD", str(tmp_path / "x.so"))):
            with pytest.raises(redis.ResponseError, match=r"(?i)unknown command"):
                r.execute_command(*command)
        # The generators train through their own Redis user (the run's keys only).
        assert "asyncrl-generator" in {c["user"] for c in r.client_list()}
    listening = [
        c.laddr
        for c in psutil.Process(job.pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == dashboard_port
    ]
    assert [a.ip for a in listening] == ["127.0.0.1"], listening
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with urllib.request.urlopen(
        urllib.request.Request(f"http://127.0.0.1:{dashboard_port}/", headers=bearer), timeout=10
    ) as resp:
        assert resp.status == 200

    # Secrets: only the run's config.yaml holds them; Redis and the dashboard get them redacted.
    with job.client() as r:
        assert_no_secret(b"\n".join(redis_values(r)), "Redis", (PASSWORD, TOKEN))
    summary_url = f"http://127.0.0.1:{dashboard_port}/api/run/{job.run_name}/summary"
    with urllib.request.urlopen(urllib.request.Request(summary_url, headers=bearer), timeout=10) as resp:
        body = resp.read()
    assert_no_secret(body, "the dashboard's summary", (PASSWORD, TOKEN))
    assert json.loads(body)["config"]["queue"]["password"] == REDACTED

    # Redis is gone for longer than the retry deadline: the job waits instead of ending. The
    # outage lasts until the trainer has said it is waiting past its retry deadline, and at
    # least six retry deadlines and two heartbeat timeouts; the job must be alive all along.
    (gen,) = job.pids_named("ray::GeneratorActor")
    job.kill_redis()
    t0 = time.monotonic()
    waiting = re.compile(r"redis at \S+ unreachable for \d+s; waiting \(queue\.outage_deadline_s=none\)")
    wait_for(
        lambda: not job.running() or (waiting.search(job.log_tail(400_000)) and time.monotonic() - t0 >= 12),
        300,
        "the trainer waiting out the outage",
        interval=0.5,
    )
    assert job.running(), job.log_tail()
    job.start_redis()
    back = time.monotonic()
    job.wait_for_step(job.trainer_step() + 3, timeout=120)
    # Until a heartbeat timeout after Redis came back: the same generator (it waited; nothing
    # restarted it), and the watchdog never took the outage for a hang.
    holds_for(
        lambda: job.pids_named("ray::GeneratorActor") == [gen] and "no heartbeat for" not in job.log_tail(400_000),
        max(0.0, back + 8 - time.monotonic()),
        "the generator kept through the outage",
        interval=0.5,
    )

    # A learner rank dies: the step fails with LearnerError and the job exits non-zero, quickly.
    ranks = job.pids_named("ray::LearnerActor")
    assert len(ranks) == 2, job.processes()
    killed_at = job.trainer_step()
    os.kill(ranks[1], signal.SIGKILL)
    t0 = time.monotonic()
    rc = job.wait(180)
    assert rc != 0, job.log_tail()
    tail = job.log_tail(20_000)
    assert "LearnerError" in tail
    # The report names the dead rank on its live node (this one: no wait for a node to be declared dead).
    assert re.search(r"lost actor: learner rank 1 on node \w+ \(alive\): lost", tail), tail
    print(f"learner rank killed: job exited {rc} after {time.monotonic() - t0:.1f}s")

    # (The redis-server restarted after the outage is this harness's, not the job's.)
    def left() -> dict[int, str]:
        return {pid: cmd for pid, cmd in job.leftovers().items() if pid not in job.restarted_redis_pids()}

    deadline = time.monotonic() + 30
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left(), left()

    steps = killed_at + 3  # finish a few steps past the kill
    job.resume(f"control.total_steps={steps}")
    assert job.wait(600) == 0, job.log_tail()
    extra = job.final_extra()
    assert extra["step"] == steps
    summary = job.audit().check().summary
    print("ledger:", summary)
    assert summary["trained"] == steps * GROUPS
    assert summary["lost"] == 0 and summary["double_trained"] == 0

    # The finished run's files: private, and no secret outside config.yaml and redis.conf. The
    # job's output (job.log, made by this harness) has no secret either, but for the harness's
    # own "=====" lines: the command lines it ran, which carry queue.password=... as given.
    holders = {job.run_dir / CONFIG_FILE, job.run_dir / "redis" / "redis.conf"}
    searched = check_run_dir(job.run_dir, (PASSWORD, TOKEN), holders=holders, foreign=frozenset({job.log_path}))
    output = [line for line in job.log_path.read_bytes().splitlines() if not line.startswith(b"===== ")]
    assert len(output) > 20 and any(b"LearnerError" in line for line in output)
    assert_no_secret(b"\n".join(output), "the job's output", (PASSWORD, TOKEN))
    print(f"run dir: {searched} files without a secret")
    with TestClient(create_run_dir_app(job.run_dir)) as finished:
        body = finished.get(f"/api/run/{job.run_name}/summary").content
    assert_no_secret(body, "the finished-run dashboard's summary", (PASSWORD, TOKEN))
