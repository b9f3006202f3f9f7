"""Secrets stay in the run's config.yaml: a run whose config holds a Redis password and a
dashboard token publishes its state to a real redis-server (AOF on), logs metrics to Redis,
metrics.jsonl and wandb (offline), and writes summary.json; then no secret is in any Redis
key, in the live or the finished-run dashboard's answers, in wandb's files or in any file of
the run dir but config.yaml and the server's redis.conf (both 0600, both need them); a
generator joining the job gets a working config with its own password; the files are private.
The trainer's own path to the same channels is checked by the secured job of
tests/faults/test_bad_input_job.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import redis
import yaml
from starlette.testclient import TestClient

from asyncrl.config import REDACTED, load_config, redact_config
from asyncrl.control.allowlist import ImportAllowList
from asyncrl.control.elastic import job_config
from asyncrl.control.summary import write_summary_file
from asyncrl.monitor.dashboard.app import create_app, create_run_dir_app
from asyncrl.monitor.sinks import build_metrics_logger
from asyncrl.queue import RunState
from asyncrl.queue.server import EmbeddedRedis
from asyncrl.rundir import CONFIG_FILE, private_files
from tests.support.leaks import assert_no_secret, check_run_dir, redis_values

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "pw-Leak-Canary-7f3a"
TOKEN = "tok-Leak-Canary-9b1c-dashboard"
SECRETS = (PASSWORD, TOKEN)
ENDPOINTS = ("/api/runs", "/api/run/sec/summary", "/api/run/sec/alerts", "/api/run/sec/series", "/metrics")


def test_secrets_stay_in_config_yaml_and_run_files_are_private(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    # The password given on the command line, as `asyncrl train cfg.yaml queue.password=...` does.
    monkeypatch.setattr(sys, "argv", ["asyncrl", "train", f"queue.password={PASSWORD}"])
    run_dir = tmp_path / "run"
    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        [
            "control.run_name=sec",
            f"control.run_dir={run_dir}",
            f"queue.password={PASSWORD}",
            f"monitor.dashboard_token={TOKEN}",
            "monitor.wandb=offline",
            "monitor.console=false",
        ],
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with private_files(cfg.control.private_files):
        run_dir.mkdir()
        fd = os.open(run_dir / CONFIG_FILE, os.O_WRONLY | os.O_CREAT, 0o600)  # as the runtime writes it
        with os.fdopen(fd, "w") as f:
            f.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        server = EmbeddedRedis(run_dir / "redis", password=PASSWORD, aof=True).start()
        try:
            rs = RunState.connect(server.url, "sec", password=PASSWORD)
            rs.set_state(status="running", config=json.dumps(redact_config(cfg)), model_path="tiny", policy_version=1)
            logger = build_metrics_logger(cfg.monitor, server.url, "sec", run_dir, cfg.to_dict(), password=PASSWORD)
            logger.log(1, {"reward/mean": 0.5, "staleness/mean": 0.0})
            logger.close()
            write_summary_file(run_dir, {"run": "sec", "status": "finished", "step": 1, "policy_version": 1})

            # A generator joining the job: its own password in place of the redacted one.
            joined, model_path = job_config(rs, ImportAllowList(), redis_url=server.url, password=None)
            assert joined.queue.password == PASSWORD and joined.monitor.dashboard_token is None
            assert joined.rollout == cfg.rollout and joined.control == cfg.control and model_path == "tiny"

            with TestClient(create_app(server.url, run="sec", password=PASSWORD, token=TOKEN)) as live:
                summary = live.get("/api/run/sec/summary", headers=auth).json()
                assert summary["config"]["queue"]["password"] == REDACTED
                assert summary["config"]["monitor"]["dashboard_token"] == REDACTED
                assert summary["config"]["control"]["run_name"] == "sec"
                for path in ENDPOINTS:
                    resp = live.get(path, headers=auth)
                    assert resp.status_code == 200, (path, resp.text)
                    assert_no_secret(resp.content, f"the live dashboard's {path}", SECRETS)
            with redis.Redis.from_url(server.url) as client:
                values = redis_values(client)
            assert any(b"reward/mean" in v for v in values)  # the scan saw the data
            assert_no_secret(b"\n".join(values), "Redis", SECRETS)
            rs.close()
        finally:
            server.stop()  # flushes the AOF

    with TestClient(create_run_dir_app(run_dir)) as finished:
        summary = finished.get("/api/run/sec/summary").json()
        assert summary["config"]["queue"]["password"] == REDACTED
        for path in ENDPOINTS[:-1]:
            assert_no_secret(finished.get(path).content, f"the finished-run dashboard's {path}", SECRETS)

    assert list((run_dir / "wandb").rglob("*.wandb")), "wandb wrote no offline run"
    assert list((run_dir / "redis").rglob("*.aof")), "redis-server wrote no AOF"
    holders = {run_dir / CONFIG_FILE, run_dir / "redis" / "redis.conf"}
    assert check_run_dir(run_dir, SECRETS, holders=holders) >= 5
