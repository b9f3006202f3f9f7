"""Redis reads behind every dashboard panel. Plain functions over a redis-py client; msgpack only.

    client = redis.Redis.from_url("redis://127.0.0.1:6379")
    list_runs(client)                                  # ['demo', ...]
    run_summary(client, "demo", now=time.time())       # state + counters + latest metrics
    read_series(client, "demo", ["reward/mean"], since="0-0")  # points newer than a stream id

Every value returned is JSON-ready: NaN/inf become None (JSON has no NaN), bytes become str.
The key layout is asyncrl/queue/keys.py; the metrics stream entry is
``{"step", "time", "source", "metrics": {name: float}}`` under field b"d".
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from typing import Any

import msgpack

from asyncrl.config import redact_config
from asyncrl.monitor.alerts import Thresholds, evaluate_alerts, state_alerts
from asyncrl.monitor.metrics import DEFAULT_HEARTBEAT_TIMEOUT_S
from asyncrl.queue import keys
from asyncrl.queue.readback import count, parse_heartbeat
from asyncrl.queue.records import unpack_small
from asyncrl.queue.runstate import RUN_COUNTERS

STATE_INT_FIELDS = ("policy_version", "weights_version", "max_staleness", "groups_per_step")
STATE_FLOAT_FIELDS = (
    "started_at",
    "alert_rollout_kl",
    "alert_masked_frac",
    "alert_staleness_frac",
    "alert_logprob_diff_max",
    "alert_reward_failure_rate",
)
COUNTER_FIELDS = RUN_COUNTERS
LATEST_WINDOW = 500
"""Stream entries scanned (newest first) to find each metric's latest value."""
SERIES_LIMIT = 20_000
"""Most stream entries one series request returns; the client pages on with `since`."""


class UnknownRun(LookupError):
    """The run is neither in keys.RUNS nor has any state or metrics in this Redis."""


def json_float(value: Any) -> float | None:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def json_safe(value: Any) -> Any:
    """Replace NaN/inf anywhere in a decoded JSON tree by None (a browser's JSON.parse rejects them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _decode_entry(fields: dict[bytes, bytes]) -> dict[str, Any] | None:
    """One metrics-stream entry, or None if it is not a valid record (skipped, never raised)."""
    raw = fields.get(keys.RECORD_FIELD)
    if raw is None:
        return None
    try:
        entry = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError, TypeError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("metrics"), dict):
        return None
    return entry


def list_runs(client: Any) -> list[str]:
    """The runs this Redis names; a name no run could have (empty, with ':', or past 200
    characters: some other client added it) is left out, so no page fails on it."""
    names = (_text(r) for r in client.smembers(keys.RUNS))
    return sorted(n for n in names if n and ":" not in n and len(n) <= 200)


def run_exists(client: Any, run: str) -> bool:
    try:
        state_key = keys.state(run)
    except ValueError:
        return False
    if client.sismember(keys.RUNS, run):
        return True
    return bool(client.exists(state_key, keys.metrics(run)))


def require_run(client: Any, run: str) -> None:
    if not run_exists(client, run):
        raise UnknownRun(f"run {run!r} not found in this Redis (known runs: {', '.join(list_runs(client)) or 'none'})")


def read_state(client: Any, run: str) -> dict[str, Any]:
    """The run state hash with ints/floats parsed and `config` decoded from JSON."""
    raw = {_text(k): _text(v) for k, v in client.hgetall(keys.state(run)).items()}
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if name in STATE_INT_FIELDS:
            try:
                out[name] = count(int(value), name)
            except ValueError:
                out[name] = None
        elif name in STATE_FLOAT_FIELDS:
            out[name] = json_float(value)
        elif name == "parity_gate":
            try:  # too deep to parse or to copy is as unreadable as not JSON
                gate = json.loads(value)
                out[name] = json_safe(gate) if isinstance(gate, dict) else None
            except (ValueError, RecursionError):
                out[name] = None
        elif name == "config":
            # The trainer publishes it redacted; redacted here too, so that no viewer sees a
            # secret an older trainer (or anyone who can write to Redis) put there. Too deep
            # to parse or copy is as unreadable as not JSON.
            try:
                config = json.loads(value)
                out[name] = json_safe(redact_config(config)) if isinstance(config, dict) else None
            except (ValueError, RecursionError):
                out[name] = None
        else:
            out[name] = value
    return out


def read_counters(client: Any, run: str) -> dict[str, int]:
    raw = {_text(k): _text(v) for k, v in client.hgetall(keys.counters(run)).items()}
    out = {name: 0 for name in COUNTER_FIELDS}
    for name, value in raw.items():
        try:
            out[name] = count(int(value), name)
        except ValueError:  # not a count: some other client wrote it
            continue
    return out


def heartbeat_timeout_of(state: dict[str, Any]) -> float:
    """The run's rollout.heartbeat_timeout_s, from the config the trainer put in its state (the
    default where there is none): the silence after which its watchdog kills a generator."""
    config = state.get("config")
    rollout = config.get("rollout") if isinstance(config, dict) else None
    value = rollout.get("heartbeat_timeout_s") if isinstance(rollout, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return DEFAULT_HEARTBEAT_TIMEOUT_S


def read_generators(
    client: Any,
    run: str,
    *,
    now: float,
    policy_version: int | None,
    max_staleness: int | None,
    heartbeat_timeout_s: float,
) -> list[dict[str, Any]]:
    """Each generator: id, version, lag (policy_version - version), heartbeat age, groups, tok/s, status.

    status: 'ok', 'lagging' (lag > max_staleness: everything it makes would be dropped) or 'gone'
    (no heartbeat for the run's heartbeat_timeout_s: crashed, hung or scaled down).
    """
    out = []
    for gid, raw in client.hgetall(keys.generators(run)).items():
        try:  # checked as the trainer checks it (asyncrl.queue.readback); a bad one is not shown
            beat = parse_heartbeat(unpack_small(raw))
        except Exception:
            continue
        version, heartbeat = beat.version, beat.heartbeat
        lag = policy_version - version if policy_version is not None else None
        age = now - heartbeat
        if age > heartbeat_timeout_s:
            status = "gone"
        elif lag is not None and max_staleness is not None and lag > max_staleness:
            status = "lagging"
        else:
            status = "ok"
        out.append(
            {
                "id": _text(gid),
                "version": version,
                "lag": lag,
                "heartbeat": heartbeat,
                "heartbeat_age_s": age,
                "groups": beat.groups,
                "tokens_per_s": beat.tokens_per_s,
                "reward_failure_rate": beat.reward_failure_rate,
                "reward_last_failure": beat.reward_last_failure[:300],
                "status": status,
            }
        )
    return sorted(out, key=lambda g: g["id"])


def latest_metrics(client: Any, run: str, window: int = LATEST_WINDOW) -> tuple[dict[str, float | None], int | None]:
    """Latest value of each metric from the trainer (other sources fill names it never logs), and its step."""
    latest: dict[str, float | None] = {}
    from_trainer: set[str] = set()
    step = None
    for _, fields in client.xrevrange(keys.metrics(run), count=window):
        entry = _decode_entry(fields)
        if entry is None:
            continue
        is_trainer = entry.get("source", "trainer") == "trainer"
        if is_trainer and step is None and isinstance(entry.get("step"), int):
            step = entry["step"]
        for name, value in entry["metrics"].items():
            name = _text(name)
            if name in from_trainer or (name in latest and not is_trainer):
                continue
            latest[name] = json_float(value)
            if is_trainer:
                from_trainer.add(name)
    return latest, step


def matches_names(name: str, wanted: list[str] | None) -> bool:
    if wanted is None:
        return True
    return any(name.startswith(w[:-1]) if w.endswith("*") else name == w for w in wanted)


def read_series(
    client: Any, run: str, names: Iterable[str] | None, *, since: str | None = None, limit: int = SERIES_LIMIT
) -> dict[str, Any]:
    """Points of the named metrics in stream entries after stream id `since` (exclusive).

    `names`: exact names or prefixes ending in '*' ('staleness/*'); None = all.
    Returns {"last_id", "series": {name: {"step": [], "time": [], "value": [], "source": []}}}.
    Pass last_id back as `since` to get only what is new.
    """
    wanted = list(names) if names is not None else None
    start = f"({since}" if since and since not in ("0", "0-0") else "-"
    series: dict[str, dict[str, list]] = {}
    last_id = since or "0-0"
    for entry_id, fields in client.xrange(keys.metrics(run), min=start, max="+", count=limit):
        last_id = _text(entry_id)
        entry = _decode_entry(fields)
        if entry is None:
            continue
        for name, value in entry["metrics"].items():
            name = _text(name)
            if not matches_names(name, wanted):
                continue
            s = series.setdefault(name, {"step": [], "time": [], "value": [], "source": []})
            step = entry.get("step")
            s["step"].append(step if isinstance(step, int) and not isinstance(step, bool) else None)
            s["time"].append(json_float(entry.get("time")))
            s["value"].append(json_float(value))
            s["source"].append(_text(entry.get("source", "trainer")))
    return {"last_id": last_id, "series": series}


def thresholds_of(state: dict[str, Any]) -> Thresholds:
    """Alert thresholds from the run state, MonitorConfig's defaults where the trainer wrote none."""
    d = Thresholds()

    def written_or(key: str, default: float) -> float:
        value = state.get(key)
        return default if value is None else value

    return Thresholds(
        rollout_kl=written_or("alert_rollout_kl", d.rollout_kl),
        masked_frac=written_or("alert_masked_frac", d.masked_frac),
        staleness_frac=written_or("alert_staleness_frac", d.staleness_frac),
        logprob_diff_max=written_or("alert_logprob_diff_max", d.logprob_diff_max),
        reward_failure_rate=written_or("alert_reward_failure_rate", d.reward_failure_rate),
    )


def run_snapshot(client: Any, run: str, now: float | None = None) -> dict[str, Any]:
    """Everything but the series: summary, generators and alerts of one run, read together."""
    require_run(client, run)
    now = time.time() if now is None else now
    state = read_state(client, run)
    latest, step = latest_metrics(client, run)
    policy_version = state.get("policy_version")
    max_staleness = state.get("max_staleness")
    heartbeat_timeout_s = heartbeat_timeout_of(state)
    generators = read_generators(
        client,
        run,
        now=now,
        policy_version=policy_version,
        max_staleness=max_staleness,
        heartbeat_timeout_s=heartbeat_timeout_s,
    )
    thresholds = thresholds_of(state)
    alerts = evaluate_alerts(
        {k: v for k, v in latest.items() if v is not None},
        thresholds=thresholds,
        max_staleness=max_staleness,
        policy_version=policy_version,
        generators={g["id"]: g for g in generators},
        now=now,
        heartbeat_timeout_s=heartbeat_timeout_s,
    ) + state_alerts(state.get("parity_gate"), state.get("weights_unloadable"))
    started = state.get("started_at")
    summary = {
        "run": run,
        "status": state.get("status", "unknown"),
        "policy_version": policy_version,
        "weights_version": state.get("weights_version"),
        "max_staleness": max_staleness,
        "groups_per_step": state.get("groups_per_step"),
        "started_at": started,
        "uptime_s": (now - started) if started is not None else None,
        "step": step,
        "counters": read_counters(client, run),
        "thresholds": {
            "rollout_kl": thresholds.rollout_kl,
            "masked_frac": thresholds.masked_frac,
            "staleness_frac": thresholds.staleness_frac,
            "logprob_diff_max": thresholds.logprob_diff_max,
            "reward_failure_rate": thresholds.reward_failure_rate,
        },
        "latest": latest,
        "parity_gate": state.get("parity_gate"),
        "config": state.get("config"),
    }
    return {"summary": summary, "generators": generators, "alerts": alerts, "time": now}
