"""The dashboard's /metrics: Prometheus text exposition of what the run pages show.

prometheus_text(source)   # any dashboard Source: a live Redis or a finished run dir
"""

from __future__ import annotations

import time

from asyncrl.monitor import metrics as M
from asyncrl.monitor.dashboard.sources import Source


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _prom_value(value: float | None) -> str:
    if value is None:
        return "NaN"
    value = float(value)
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def prometheus_text(source: Source) -> str:
    """Latest value of every metric per run as gauges, the counters as counters, generators.
    A counter a finished run did not record (no summary.json) is left out."""
    families: dict[str, tuple[str, str, list[str]]] = {}

    def add(name: str, kind: str, help_text: str, labels: dict[str, str], value: float | None) -> None:
        fam = families.setdefault(name, (kind, help_text, []))
        lab = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        fam[2].append(f"{name}{{{lab}}} {_prom_value(value)}")

    now = time.time()
    for run in source.runs():
        snap = source.snapshot(run, now)
        s, run_label = snap["summary"], {"run": run}
        for field in ("policy_version", "weights_version", "max_staleness"):
            if s[field] is not None:
                add(f"asyncrl_{field}", "gauge", f"run state: {field}", run_label, s[field])
        add("asyncrl_alerts", "gauge", "alerts currently raised", run_label, len(snap["alerts"]))
        for name, value in sorted(s["latest"].items()):
            doc = M.spec(name).doc if M.is_known(name) else "metric logged by the trainer"
            add(M.prometheus_name(name), "gauge", f"latest {name}: {doc}", run_label, value)
        for name, value in s["counters"].items():
            if value is None:
                continue
            add(f"asyncrl_{name}_total", "counter", f"counters hash: {name}", run_label, value)
        for g in snap["generators"]:
            labels = {"run": run, "generator": g["id"]}
            add("asyncrl_generator_version", "gauge", "policy version a generator runs", labels, g["version"])
            add("asyncrl_generator_lag", "gauge", "policy_version - generator version", labels, g["lag"])
            add(
                "asyncrl_generator_heartbeat_age_seconds",
                "gauge",
                "seconds since the last heartbeat",
                labels,
                g["heartbeat_age_s"],
            )
            add(
                "asyncrl_generator_up",
                "gauge",
                "1 if the heartbeat is fresh",
                labels,
                0.0 if g["status"] == "gone" else 1.0,
            )
    lines = []
    for name, (kind, help_text, samples) in families.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(lines) + "\n"
