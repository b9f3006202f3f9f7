"""A finished run's dashboard data, read from its run directory: no Redis (it went with the run).

    src = RunDirSource("runs/demo")        # NotARunDir if there is no metrics.jsonl
    src.snapshot(src.run)["summary"]       # the live page's summary, from the files
    src.series(src.run, ["reward/*"], since=None)

What each number comes from: the charts and latest values from ``metrics.jsonl`` (the
JsonlSink rows: {"step", "time", name: value or null}); status, wall time, policy version and
queue counters from ``summary.json`` (written when the run ends, asyncrl/control/summary.py);
without it (a killed run) the latest checkpoint's ``extra`` gives the policy version; alert
thresholds and the staleness bound from ``config.yaml``. A resumed run appends to
metrics.jsonl and repeats the steps after its checkpoint: the later rows replace them, so
the charts show the trajectory the final weights came from. Stream ids here are row counts
("120": rows after the 120th), in the same ``since``/``last_id`` protocol as Redis's.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from asyncrl.config import redact_config
from asyncrl.infra import ExpectedFailure
from asyncrl.monitor.alerts import Thresholds, evaluate_alerts, staleness_bound, state_alerts
from asyncrl.monitor.dashboard import data
from asyncrl.rundir import CHECKPOINTS_DIR, CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, complete_checkpoints, read_extra
from asyncrl.rundir.store import ObjectPath, RunPath, run_path


class NotARunDir(FileNotFoundError, ExpectedFailure):
    """The directory given has no metrics.jsonl."""


def _row_of(line: str) -> dict[str, Any] | None:
    """One metrics.jsonl line, or None for a line a killed run cut short (skipped, never raised)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        return None
    return row


def _read_rows(path: RunPath) -> tuple[list[dict[str, Any]], int, list[int]]:
    """The rows of the final trajectory (a resumed run's repeats replace the rows they redo), how
    many lines were not valid rows, and the steps the run resumed after (a row whose step does
    not follow the one before it starts a resumed session)."""
    rows: list[dict[str, Any]] = []
    bad = 0
    resumed: list[int] = []
    with contextlib.ExitStack() as stack:
        if isinstance(path, ObjectPath):  # one GET of the whole object
            lines: Iterable[str] = path.read_text(errors="replace").splitlines()
        else:
            lines = stack.enter_context(path.open(encoding="utf-8", errors="replace"))
        for line in lines:
            if not line.strip():
                continue
            row = _row_of(line)
            if row is None:
                bad += 1
                continue
            if rows and rows[-1]["step"] >= row["step"]:
                resumed = [r for r in resumed if r < row["step"] - 1] + [row["step"] - 1]
            while rows and rows[-1]["step"] >= row["step"]:
                rows.pop()
            rows.append(row)
    return rows, bad, resumed


def _latest(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each metric's last non-null value (None if it was only ever null)."""
    latest: dict[str, float | None] = {}
    for row in reversed(rows):
        for name, value in row.items():
            if name in ("step", "time"):
                continue
            value = data.json_float(value)
            if latest.get(name) is None:
                latest[name] = value
    return latest


class RunDirSource:
    """The dashboard Source of one finished run directory (see asyncrl/monitor/dashboard/sources.py)."""

    mode = "finished"
    read_errors: tuple[type[Exception], ...] = (OSError,)

    def __init__(self, run_dir: str | Path | RunPath):
        root = run_path(run_dir)
        # A URL is read with its filesystem's standard credentials (for S3 the AWS_* variables).
        self.run_dir: RunPath = root if isinstance(root, ObjectPath) else root.expanduser().resolve()
        self.metrics_path = self.run_dir / METRICS_FILE
        if not self.run_dir.is_dir():
            raise NotARunDir(f"run_dir={str(run_dir)!r}: not a directory")
        if not self.metrics_path.is_file():
            raise NotARunDir(
                f"run_dir={str(run_dir)!r} is not a run directory: it has no {METRICS_FILE} "
                "(a run writes one line per step there; give the run's control.run_dir)"
            )
        self.display = str(self.run_dir)
        self.config = self._read_config()
        name = self._setting("control", "run_name")
        self.run = name if isinstance(name, str) and name and "/" not in name else self.run_dir.name
        self._lock = threading.Lock()
        self._key: tuple[int, int] | None = None
        self._rows: list[dict[str, Any]] = []
        self._latest: dict[str, float | None] = {}
        self._bad_lines = 0
        self._resumed: list[int] = []

    # ------------------------------------------------------------------ files

    def _read_config(self) -> dict[str, Any]:
        path = self.run_dir / CONFIG_FILE
        if not path.is_file():
            return {}
        try:
            cfg = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            return {}
        # config.yaml is the one file that holds the secrets: the pages get the redacted copy.
        return data.json_safe(redact_config(cfg)) if isinstance(cfg, dict) else {}

    def _summary_file(self) -> dict[str, Any]:
        path = self.run_dir / SUMMARY_FILE
        try:
            record = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return data.json_safe(record) if isinstance(record, dict) else {}

    def _checkpoint_extra(self) -> tuple[str | None, dict[str, Any]]:
        """The newest complete checkpoint's name and its `extra` (LoopState.to_extra)."""
        found = complete_checkpoints(self.run_dir / CHECKPOINTS_DIR)
        if not found:
            return None, {}
        try:
            extra = read_extra(found[-1])
        except (OSError, ValueError):
            return found[-1].name, {}
        return found[-1].name, extra if isinstance(extra, dict) else {}

    def _load(self) -> tuple[list[dict[str, Any]], dict[str, float | None]]:
        """metrics.jsonl, parsed again only when it changed (size or mtime)."""
        st = self.metrics_path.stat()
        key = (st.st_mtime_ns, st.st_size)
        with self._lock:
            if key != self._key:
                self._rows, self._bad_lines, self._resumed = _read_rows(self.metrics_path)
                self._latest = _latest(self._rows)
                self._key = key
            return self._rows, self._latest

    # ------------------------------------------------------------------ Source

    def check(self) -> None:
        self.metrics_path.stat()

    def runs(self) -> list[str]:
        return [self.run]

    def require(self, run: str) -> None:
        if run != self.run:
            raise data.UnknownRun(f"run {run!r} not found in {self.run_dir} (it holds run {self.run!r})")

    def _setting(self, section: str, name: str) -> Any:
        part = self.config.get(section)
        return part.get(name) if isinstance(part, dict) else None

    def _thresholds(self) -> Thresholds:
        """monitor.alert_* from config.yaml; MonitorConfig's defaults where it has none."""

        def pick(name: str, default: float) -> float:
            value = self._setting("monitor", f"alert_{name}")
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default

        d = Thresholds()
        return Thresholds(
            rollout_kl=pick("rollout_kl", d.rollout_kl),
            masked_frac=pick("masked_frac", d.masked_frac),
            staleness_frac=pick("staleness_frac", d.staleness_frac),
            logprob_diff_max=pick("logprob_diff_max", d.logprob_diff_max),
        )

    def snapshot(self, run: str, now: float | None = None) -> dict[str, Any]:
        self.require(run)
        now = time.time() if now is None else now
        rows, latest = self._load()
        summary_file = self._summary_file()
        checkpoint, extra = self._checkpoint_extra()
        last_step = rows[-1]["step"] if rows else summary_file.get("step")
        version = summary_file.get("policy_version", extra.get("version"))
        logged_version = latest.get("learner/version")
        if version is None and logged_version is not None:
            version = int(logged_version)
        max_staleness = staleness_bound(summary_file.get("max_staleness", self._setting("control", "max_staleness")))
        thresholds = self._thresholds()
        alerts = evaluate_alerts(
            {k: v for k, v in latest.items() if v is not None},
            thresholds=thresholds,
            max_staleness=max_staleness,
            policy_version=version,
            generators={},
            now=now,
        ) + state_alerts(summary_file.get("parity_gate"))
        counters = summary_file.get("counters")
        # A summary.json's counters omit the ones never counted (before every counter was
        # written): 0, not unknown. No summary.json (a killed run): unknown.
        counters = {name: 0 for name in data.COUNTER_FIELDS} | counters if isinstance(counters, dict) else {}
        first_time = data.json_float(rows[0].get("time")) if rows else None
        last_time = data.json_float(rows[-1].get("time")) if rows else None
        summary = {
            "run": run,
            "mode": self.mode,
            # No summary.json: the run ended without reaching its summary (killed or crashed).
            "status": summary_file.get("status", "ended"),
            "policy_version": version,
            "weights_version": extra.get("published_version"),
            "max_staleness": max_staleness,
            "groups_per_step": None,
            "started_at": summary_file.get("started_at", first_time),
            "uptime_s": None,
            "step": last_step,
            "counters": {name: counters.get(name) for name in data.COUNTER_FIELDS},
            "thresholds": vars(thresholds),
            "latest": latest,
            "parity_gate": summary_file.get("parity_gate"),
            "config": self.config or None,
            "finished": {
                "run_dir": str(self.run_dir),
                "final_step": last_step,
                "steps_logged": len(rows),
                "wall_s": summary_file.get("wall_s"),
                "startup_s": summary_file.get("startup_s"),
                "ended_at": summary_file.get("ended_at", last_time),
                "has_summary": bool(summary_file),
                "checkpoint": checkpoint,
                "bad_lines": self._bad_lines,
                "resumed_after": list(self._resumed),  # the steps its resumes went on from
                # A run dir is read as it is: one still being written shows its steps so far.
                "metrics_age_s": max(0.0, now - self.metrics_path.stat().st_mtime),
            },
        }
        return {"summary": summary, "generators": [], "alerts": alerts, "time": now}

    def series(self, run: str, names: list[str] | None, since: str | None) -> dict[str, Any]:
        self.require(run)
        rows, _ = self._load()
        start = int(since.partition("-")[0]) if since else 0
        series: dict[str, dict[str, list]] = {}
        for row in rows[start:]:
            t = data.json_float(row.get("time"))
            for name, value in row.items():
                if name in ("step", "time") or not data.matches_names(name, names):
                    continue
                s = series.setdefault(name, {"step": [], "time": [], "value": [], "source": []})
                s["step"].append(row["step"])
                s["time"].append(t)
                s["value"].append(data.json_float(value))
                s["source"].append("trainer")
        return {"last_id": str(max(start, len(rows))), "series": series}

    def unreachable_hint(self) -> str:
        return f"Is {self.metrics_path} still there and readable?"

    def close(self) -> None:
        return None
