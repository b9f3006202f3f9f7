"""Monitoring: the metric catalogue, the sinks that log it, and the live dashboard.

    from asyncrl.monitor import build_metrics_logger, staleness_summary
    logger = build_metrics_logger(cfg.monitor, redis_client, run, run_dir, cfg.to_dict())
    logger.log(step, {**staleness_summary(staleness, cfg.control.max_staleness), "reward/mean": r})

The dashboard (``asyncrl.monitor.dashboard``) reads only Redis, so it can be started and
stopped at any time, for a live run or a finished one.
"""

from asyncrl.monitor.alerts import evaluate_alerts
from asyncrl.monitor.metrics import CATALOGUE, MetricSpec, spec, staleness_summary
from asyncrl.monitor.sinks import ConsoleSink, MetricsLogger, RedisSink, WandbSink, build_metrics_logger

__all__ = [
    "CATALOGUE",
    "ConsoleSink",
    "MetricSpec",
    "MetricsLogger",
    "RedisSink",
    "WandbSink",
    "build_metrics_logger",
    "evaluate_alerts",
    "spec",
    "staleness_summary",
]
