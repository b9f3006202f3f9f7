"""Metrics sinks against the real things: a redis-server, wandb offline, a rich console."""

from __future__ import annotations

import contextlib
import io
import logging
import socket

import msgpack
import psutil
import pytest
import redis
from rich.console import Console

from asyncrl.config import MonitorConfig
from asyncrl.monitor.dashboard import data
from asyncrl.monitor.sinks import (
    ConsoleSink,
    JsonlSink,
    MetricsLogger,
    RedisSink,
    TensorBoardSink,
    WandbSink,
    build_metrics_logger,
)
from asyncrl.queue import keys


def test_redis_sink_writes_entries_the_dashboard_reads(redis_url):
    client = redis.Redis.from_url(redis_url)
    sink = RedisSink(redis_url, "exp1")
    sink.log(0, {"reward/mean": 0.25, "staleness/mean": 0.0})
    sink.log(1, {"reward/mean": 0.5, "staleness/mean": 1.0, "note": "dropped: not a number"})
    sink.close()

    assert data.list_runs(client) == ["exp1"]
    entries = client.xrange(keys.metrics("exp1"))
    raw = msgpack.unpackb(entries[1][1][keys.RECORD_FIELD], raw=False)
    assert raw["step"] == 1 and raw["source"] == "trainer" and raw["time"] > 1.7e9
    assert raw["metrics"] == {"reward/mean": 0.5, "staleness/mean": 1.0}
    series = data.read_series(client, "exp1", ["reward/mean"])["series"]
    assert series["reward/mean"]["value"] == [0.25, 0.5] and series["reward/mean"]["step"] == [0, 1]
    latest, step = data.latest_metrics(client, "exp1")
    assert step == 1 and latest == {"reward/mean": 0.5, "staleness/mean": 1.0}
    client.close()


def test_redis_sink_trims_to_approximate_maxlen(redis_url):
    client = redis.Redis.from_url(redis_url)
    sink = RedisSink(client, "trim", maxlen=50)
    for step in range(1000):
        sink.log(step, {"reward/mean": float(step)})
    # '~' trims whole stream nodes (100 entries each by default): at least 50 kept, far fewer than 1000.
    assert 50 <= client.xlen(keys.metrics("trim")) <= 200
    latest, step = data.latest_metrics(client, "trim")
    assert step == 999 and latest["reward/mean"] == 999.0
    with pytest.raises(ValueError, match="run name 'a:b'"):
        RedisSink(client, "a:b")
    client.close()


def test_wandb_offline_writes_a_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink("offline", "asyncrl-test", "unit", {"control": {"max_staleness": 2}}, tmp_path)
    sink.log(0, {"reward/mean": 0.5, "drift/rollout_kl": 0.01})
    sink.log(1, {"reward/mean": 0.75})
    sink.close()
    # close() returns only once wandb's service has exited (finish() alone merely asks it to
    # close the stream, and CI once read the log before it had flushed a single record).
    assert not [name for name in child_process_names() if name.startswith("wandb-")]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    logs = list(runs[0].glob("run-*.wandb"))
    assert len(logs) == 1, f"no .wandb log in {runs[0]}"
    # The offline log is wandb's binary record format (synced later with `wandb sync`): the
    # config and every metric name must be in it.
    blob = logs[0].read_bytes()
    for text in (b"max_staleness", b"reward/mean", b"drift/rollout_kl", b"asyncrl-test"):
        assert text in blob, text
    with pytest.raises(ValueError, match="mode='offlin'"):
        WandbSink("offlin", "p", "r", {}, tmp_path)


def child_process_names() -> list[str]:
    names = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # one that exits meanwhile (a Ray worker)
            names.append(p.name())
    return names


def test_console_line():
    out = io.StringIO()
    sink = ConsoleSink(every=2, console=Console(file=out, width=200, color_system=None), target_length=3.0)
    m = {
        "reward/mean": 0.5,
        "response/length_mean": 6.75,
        "staleness/mean": 0.25,
        "staleness/max": 1.0,
        "drift/rollout_kl": 0.0123,
        "throughput/gen_tokens_per_s": 1234.4,
        "throughput/train_tokens_per_s": 800.0,
        "time/step": 1.5,
    }
    sink.log(1, m)  # skipped: every=2
    sink.log(2, m)
    assert out.getvalue().strip() == (
        "step 2  reward 0.5  len 6.8 (target 3+EOS)  staleness mean 0.25 max 1  rollout_kl 0.0123  "
        "gen 1234 tok/s  train 800 tok/s  step 1.50s"
    )
    sink.log(4, {**m, "queue/dead_lettered": 3.0})  # records refused at intake: said once there are any
    assert out.getvalue().strip().endswith("step 1.50s  dead-lettered 3")


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"


def test_a_failing_sink_never_raises_and_others_keep_logging(caplog):
    out = io.StringIO()
    console = ConsoleSink(console=Console(file=out, width=200, color_system=None))
    dead = RedisSink(_dead_url(), "demo")
    logger = MetricsLogger([dead, console])
    with caplog.at_level(logging.WARNING, logger="asyncrl.monitor.sinks"):
        for step in range(3):
            logger.log(step, {"reward/mean": 1.0})
        logger.close()
    assert logger.failures == {"RedisSink": 3}
    warnings = [r for r in caplog.records if "RedisSink failed" in r.getMessage()]
    assert len(warnings) == 1 and "ConnectionError" in warnings[0].getMessage()  # warned once, with the reason
    assert out.getvalue().count("reward 1") == 3


def test_build_metrics_logger_from_config(redis_url, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    client = redis.Redis.from_url(redis_url)
    logger = build_metrics_logger(MonitorConfig(wandb="disabled", console=True), client, "cfgrun", tmp_path, {})
    assert [type(s) for s in logger.sinks] == [JsonlSink, RedisSink, ConsoleSink]
    logger.log(0, {"reward/mean": 0.5})
    assert data.latest_metrics(client, "cfgrun") == ({"reward/mean": 0.5}, 0)
    logger.close()
    logger = build_metrics_logger(MonitorConfig(wandb="offline", console=False), None, "cfgrun", tmp_path, {})
    assert [type(s) for s in logger.sinks] == [JsonlSink, WandbSink]
    logger.close()
    assert list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    client.close()


def test_metrics_jsonl_outlives_the_run_one_object_per_step(tmp_path):
    """Every step's metrics in run_dir/metrics.jsonl, flushed per step (a killed run keeps them),
    non-finite values as null, appended to by a resumed run."""
    import json
    import math

    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log(1, {"reward/mean": 0.25, "staleness/max": 2, "drift/rollout_kl": math.nan, "note": "dropped"})
    # Read before close(): what a crash right now would leave on disk.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["reward/mean"] == 0.25 and rows[0]["staleness/max"] == 2.0
    assert rows[0]["drift/rollout_kl"] is None and "note" not in rows[0] and rows[0]["time"] > 0
    sink.close()
    again = JsonlSink(tmp_path / "metrics.jsonl")  # a resumed run
    again.log(2, {"reward/mean": float("inf")})
    again.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["reward/mean"] is None


def read_tensorboard(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under `log_dir`, as TensorBoard itself reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_sink_writes_scalars_tensorboard_reads(tmp_path):
    """One scalar per catalogue name and step under run_dir/tensorboard; non-finite values and
    non-numbers are left out; close() flushes (the flush interval is far longer than the test)."""
    import math

    sink = TensorBoardSink(tmp_path / "tensorboard", flush_secs=3600)
    sink.log(1, {"reward/mean": 0.25, "staleness/max": 2, "drift/rollout_kl": math.nan, "note": "dropped"})
    sink.log(2, {"reward/mean": 0.5, "staleness/max": 1, "drift/rollout_kl": 0.0625, "eval/reward_mean": -math.inf})
    sink.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    scalars = read_tensorboard(tmp_path / "tensorboard")
    assert set(scalars) == {"reward/mean", "staleness/max", "drift/rollout_kl"}
    assert scalars["reward/mean"] == [(1, 0.25), (2, 0.5)]
    assert scalars["staleness/max"] == [(1, 2.0), (2, 1.0)]
    assert scalars["drift/rollout_kl"] == [(2, 0.0625)]


def test_build_metrics_logger_adds_tensorboard_when_asked(tmp_path):
    logger = build_metrics_logger(MonitorConfig(console=False, tensorboard=True), None, "tb", tmp_path, {})
    assert [type(s) for s in logger.sinks] == [JsonlSink, TensorBoardSink]
    for step in range(1, 4):
        logger.log(step, {"reward/mean": step / 4, "time/step": 0.5})
    logger.close()
    assert logger.failures == {}
    scalars = read_tensorboard(tmp_path / "tensorboard")
    assert scalars["reward/mean"] == [(1, 0.25), (2, 0.5), (3, 0.75)] and len(scalars["time/step"]) == 3
    off = build_metrics_logger(MonitorConfig(console=False), None, "tb", tmp_path / "off", {})
    assert [type(s) for s in off.sinks] == [JsonlSink]
    off.close()
    assert not (tmp_path / "off" / "tensorboard").exists()
