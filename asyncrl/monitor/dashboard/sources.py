"""Where the dashboard's data comes from: one small interface, two implementations.

    RedisSource(redis.Redis.from_url(url), "redis://127.0.0.1:6379")  # a live run (asyncrl/monitor/dashboard/data.py)
    RunDirSource("runs/demo")                                          # a finished one (rundir.py)

The app and the page only ever see what a `Source` returns, so the live page and the
finished-run page are the same code. Every method returns JSON-ready values (no NaN).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import redis

from asyncrl.monitor.dashboard import data


class Source(Protocol):
    mode: str
    """'live' (the page follows the stream) or 'finished' (the page loads once)."""
    display: str
    """Where the data is read from, for messages (no password in it)."""
    read_errors: tuple[type[Exception], ...]
    """Errors that mean the store cannot be read right now (503), not a bad request."""

    def check(self) -> None:
        """Raise one of `read_errors` if the store cannot be read at all."""

    def runs(self) -> list[str]: ...

    def require(self, run: str) -> None:
        """Raise data.UnknownRun if there is no such run."""

    def snapshot(self, run: str, now: float | None = None) -> dict[str, Any]:
        """{"summary", "generators", "alerts", "time"}: see data.run_snapshot."""

    def series(self, run: str, names: list[str] | None, since: str | None) -> dict[str, Any]:
        """{"last_id", "series": {name: {"step", "time", "value", "source"}}} after `since`."""

    def unreachable_hint(self) -> str:
        """What to check when a read fails, for the 503 page."""

    def close(self) -> None: ...


class RedisSource:
    """A run's live keys in Redis (the trainer's embedded server or an external one)."""

    mode = "live"
    read_errors: tuple[type[Exception], ...] = (redis.RedisError,)

    def __init__(self, client: redis.Redis, display: str):
        self.client = client
        self.display = display

    def check(self) -> None:
        self.client.ping()

    def runs(self) -> list[str]:
        return data.list_runs(self.client)

    def require(self, run: str) -> None:
        data.require_run(self.client, run)

    def snapshot(self, run: str, now: float | None = None) -> dict[str, Any]:
        snap = data.run_snapshot(self.client, run, time.time() if now is None else now)
        snap["summary"]["mode"] = self.mode
        return snap

    def series(self, run: str, names: list[str] | None, since: str | None) -> dict[str, Any]:
        data.require_run(self.client, run)
        return data.read_series(self.client, run, names, since=since)

    def unreachable_hint(self) -> str:
        return "Is the trainer's redis-server running, and is --redis right?"

    def close(self) -> None:
        self.client.close()
