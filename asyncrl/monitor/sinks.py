"""Metrics sinks: the Redis metrics stream (the dashboard reads it), run_dir/metrics.jsonl
(outlives the run), TensorBoard event files, wandb and the console.

    logger = MetricsLogger([RedisSink("redis://127.0.0.1:6379", run="demo"), ConsoleSink(every=10)])
    logger.log(step, {"reward/mean": 0.5, "staleness/mean": 0.25})
    logger.close()

or, from the config tree: ``build_metrics_logger(cfg.monitor, redis_client, run, run_dir, cfg.to_dict())``
(wandb gets the config with its secrets redacted, asyncrl.config.secrets).

A sink that fails (Redis gone, wandb crashed, a closed terminal) must never stop training:
`MetricsLogger` catches the error, warns once per sink with the reason, and carries on; the
other sinks keep logging. Nothing is pickled: the stream entry is msgpack
``{"step", "time", "source", "metrics"}`` under field b"d" (see asyncrl/queue/keys.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import msgpack

from asyncrl.config import redact_config
from asyncrl.monitor.metrics import clean
from asyncrl.queue import keys
from asyncrl.rundir import METRICS_FILE
from asyncrl.rundir.store import ObjectPath, RunPath, run_path

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"


class Sink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class RedisSink:
    """XADD one msgpack entry per step to ``keys.metrics(run)``, trimmed to ~`maxlen` entries.

    The approximate MAXLEN (``~``) lets Redis trim whole macro-nodes, which is O(1) amortised;
    100k entries of ~60 metrics is ~150 MB at worst, ~10^5 steps of history.
    """

    def __init__(
        self, redis: Any, run: str, *, source: str = "trainer", maxlen: int = 100_000, password: str | None = None
    ):
        if maxlen < 1:
            raise ValueError(f"RedisSink maxlen={maxlen}: must be >= 1")
        self._key = keys.metrics(run)  # validates the run name
        self._run = run
        self._source = source
        self._maxlen = maxlen
        if isinstance(redis, str):
            from asyncrl.queue.connection import client_from_url

            self._client = client_from_url(redis, password=password, socket_timeout=5, socket_connect_timeout=5)
            self._owns_client = True
        else:
            self._client = redis
            self._owns_client = False
        self._registered = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        entry = {"step": int(step), "time": time.time(), "source": self._source, "metrics": clean(metrics)}
        payload = msgpack.packb(entry, use_bin_type=True)
        pipe = self._client.pipeline(transaction=False)
        if not self._registered:
            pipe.sadd(keys.RUNS, self._run)  # so the dashboard's runs page finds it
        pipe.xadd(self._key, {keys.RECORD_FIELD: payload}, maxlen=self._maxlen, approximate=True)
        pipe.execute()
        self._registered = True

    def close(self) -> None:
        if self._owns_client:
            self._client.close()


class WandbSink:
    """Weights & Biases: ``offline`` writes a run directory under `dir` and needs no network.

    Metric names are already wandb-style sections ("drift/rollout_kl" shows under "drift").
    """

    def __init__(
        self,
        mode: Literal["disabled", "offline", "online"],
        project: str,
        run_name: str,
        config: Mapping[str, Any],
        dir: str | Path,
    ):
        if mode not in ("disabled", "offline", "online"):
            raise ValueError(f"WandbSink mode={mode!r}: must be 'disabled', 'offline' or 'online'")
        import wandb

        Path(dir).mkdir(parents=True, exist_ok=True)
        # wandb keeps the config on its servers and in its files: never the secrets. Its run
        # metadata is off because it holds the command line, and `asyncrl train cfg.yaml
        # queue.password=...` would send the password with it.
        self.run = wandb.init(
            mode=mode,
            project=project,
            name=run_name,
            config=redact_config(config),
            dir=str(dir),
            reinit="create_new",
            settings=wandb.Settings(x_disable_meta=True),
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(clean(metrics), step=int(step))

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() only *publishes* "this run is done" to the wandb-core service; the service
        # closes the run's stream, and flushes its .wandb log, whenever it gets to it. Readers
        # of the offline log right after close() (a test, `wandb sync` in a follow-up job step)
        # would race that, so when no other run of this process is live we shut the service
        # down too: teardown waits for it to exit, by which time every record is on disk.
        if wandb.run is None:
            wandb.teardown()


class JsonlSink:
    """One JSON object per step appended to `path` (``run_dir/metrics.jsonl``): {"step", "time",
    then the catalogue's names}. The run's Redis goes when the run ends; this file stays, and
    ``pandas.read_json(path, lines=True)`` reads it. Non-finite values are written as null
    (JSON has no NaN). Lines are flushed per step, so a killed run keeps every step it logged;
    a resumed run appends, and its steps after the checkpoint repeat the ones logged before it.

    With `upload_to` (run_dir/metrics.jsonl on an object store, which cannot append) `path` is a
    local spool: the whole file is uploaded at most every `upload_every_s` (one PUT replaces
    the object atomically) and at close. A spool shorter than the object (a resume on another
    machine) starts from the object's rows."""

    def __init__(self, path: str | Path, upload_to: RunPath | None = None, upload_every_s: float = 30.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.upload_to = upload_to
        self.upload_every_s = upload_every_s
        self._uploaded_at = time.monotonic()
        if upload_to is not None and upload_to.exists():
            size = self.path.stat().st_size if self.path.exists() else 0
            if size < upload_to.stat().st_size:
                self.path.write_bytes(upload_to.read_bytes())
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        import json

        row: dict[str, float | None] = {"step": int(step), "time": round(time.time(), 3)}
        row.update({k: (v if math.isfinite(v) else None) for k, v in clean(metrics).items()})
        self._file.write(json.dumps(row, separators=(",", ":")) + "\n")
        self._file.flush()
        if self.upload_to is not None and time.monotonic() - self._uploaded_at >= self.upload_every_s:
            self.upload()

    def upload(self) -> None:
        """The spool to `upload_to` now (a no-op without one)."""
        if self.upload_to is not None:
            self._uploaded_at = time.monotonic()
            self.upload_to.write_bytes(self.path.read_bytes())

    def close(self) -> None:
        self._file.close()
        self.upload()


class TensorBoardSink:
    """Scalar event files under `log_dir` (``run_dir/tensorboard``), one scalar per catalogue
    name and step: ``tensorboard --logdir run_dir/tensorboard``. Non-finite values are left
    out (the point is missing, as null is in metrics.jsonl). Events are flushed every
    `flush_secs` and on close; a resumed run adds an event file next to the old one."""

    def __init__(self, log_dir: str | Path, flush_secs: int = 10):
        from torch.utils.tensorboard import SummaryWriter  # imported here: tensorboard is slow to import

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in clean(metrics).items():
            if math.isfinite(value):
                self._writer.add_scalar(name, value, global_step=int(step))

    def close(self) -> None:
        self._writer.close()  # flushes what is pending


def _fmt(value: float | None, spec: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def console_line(step: int, m: Mapping[str, float], target_length: float | None = None) -> str:
    """The compact one-line summary (rich markup) ConsoleSink prints. ``target_length``: the
    task's correct answer in characters (+ EOS), shown next to the mean response length."""
    # Both labelled: "1.00/1" read as value/bound.
    stale = f"mean {_fmt(m.get('staleness/mean'), '.2f')} max {_fmt(m.get('staleness/max'), '.0f')}"
    target = f" (target {target_length:.3g}+EOS)" if target_length is not None else ""
    # Records refused at intake (asyncrl.queue.intake) are rare and matter: shown once there are any.
    dead = m.get("queue/dead_lettered") or 0.0
    refused = f"  [red]dead-lettered {dead:.0f}[/red]" if dead > 0 else ""
    return (
        f"[bold]step {step}[/bold]  reward [green]{_fmt(m.get('reward/mean'))}[/green]"
        f"  len {_fmt(m.get('response/length_mean'), '.1f')}{target}"
        f"  staleness {stale}"
        f"  rollout_kl {_fmt(m.get('drift/rollout_kl'))}"
        f"  gen {_fmt(m.get('throughput/gen_tokens_per_s'), '.0f')} tok/s"
        f"  train {_fmt(m.get('throughput/train_tokens_per_s'), '.0f')} tok/s"
        f"  step {_fmt(m.get('time/step'), '.2f')}s{refused}"
    )


class ConsoleSink:
    """Print `console_line` every `every` steps with rich (plain text when not a terminal)."""

    def __init__(self, every: int = 1, console: Any = None, target_length: float | None = None):
        if every < 1:
            raise ValueError(f"ConsoleSink every={every}: must be >= 1")
        from rich.console import Console

        self._every = every
        self._target_length = target_length
        # soft_wrap: a log file or CI console (80 columns by default) gets one line per step.
        self._console = console or Console(highlight=False, soft_wrap=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if step % self._every == 0:
            self._console.print(console_line(step, metrics, self._target_length))

    def close(self) -> None:
        return None


class MetricsLogger:
    """Fan one step's metrics out to every sink; a failing sink is warned about once, never raised."""

    def __init__(self, sinks: Sequence[Sink]):
        self.sinks = list(sinks)
        self._warned: set[int] = set()
        self.failures: dict[str, int] = {}
        """Failed calls per sink class name, for tests and the final run summary."""

    def _guard(self, sink: Sink, what: str, *args: Any) -> None:
        try:
            getattr(sink, what)(*args)
        except Exception as e:  # a monitoring failure must never take the training loop down
            name = type(sink).__name__
            self.failures[name] = self.failures.get(name, 0) + 1
            if id(sink) not in self._warned:
                self._warned.add(id(sink))
                log.warning(
                    "metrics sink %s failed in %s(): %s: %s (further failures are counted, not logged)",
                    name,
                    what,
                    type(e).__name__,
                    e,
                )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            self._guard(sink, "log", step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            self._guard(sink, "close")


def build_metrics_logger(
    monitor_cfg: Any,
    redis_client: Any,
    run: str,
    run_dir: str | Path | RunPath,
    config_dict: Mapping[str, Any],
    *,
    password: str | None = None,
    target_length: float | None = None,
    local_dir: Path | None = None,
) -> MetricsLogger:
    """The sinks a MonitorConfig asks for. run_dir/metrics.jsonl is always written; Redis is
    always on (the dashboard reads it) if a client is given; run_dir/tensorboard with
    monitor.tensorboard. With run_dir on an object store, metrics.jsonl is spooled in
    `local_dir` (JsonlSink) and TensorBoard and wandb write there (they append to their files).

    A sink that cannot even start (e.g. wandb online without a login) is warned about and left
    out, for the same reason sinks never raise: monitoring must not stop a run.
    """
    root = run_path(run_dir)
    if isinstance(root, ObjectPath):
        if local_dir is None:
            raise ValueError(f"run_dir {root} is on an object store: build_metrics_logger needs a local_dir")
        sinks: list[Sink] = [JsonlSink(local_dir / METRICS_FILE, upload_to=root / METRICS_FILE)]
    else:
        local_dir = root
        sinks = [JsonlSink(local_dir / METRICS_FILE)]
    if monitor_cfg.tensorboard:
        try:
            sinks.append(TensorBoardSink(local_dir / TENSORBOARD_DIR))
        except Exception as e:
            log.warning("tensorboard sink could not start, continuing without it: %s: %s", type(e).__name__, e)
    if redis_client is not None:
        sinks.append(RedisSink(redis_client, run, password=password))
    if monitor_cfg.wandb != "disabled":
        try:
            sinks.append(WandbSink(monitor_cfg.wandb, monitor_cfg.wandb_project, run, config_dict, local_dir / "wandb"))
        except Exception as e:
            log.warning(
                "wandb sink (mode=%s) could not start, continuing without it: %s: %s",
                monitor_cfg.wandb,
                type(e).__name__,
                e,
            )
    if monitor_cfg.console:
        sinks.append(ConsoleSink(every=monitor_cfg.console_every, target_length=target_length))
    return MetricsLogger(sinks)
