"""Connecting to Redis and retrying its calls: one small wrapper every queue call goes through.

    client = open_client("redis://127.0.0.1:6379/0", password=None)
    retry = Retrier(redact_url(url), deadline_s=30.0)
    retry(client.xlen, "asyncrl:demo:rollouts")

Connection errors (server restarting, loading its AOF, network blip) are retried with
exponential backoff (50 ms, doubling, at most 2 s a wait) until `deadline_s`, each retry
logged. Past that the outage is waited out (a days-long job pauses rather than ending), with
one line a minute, until `outage_deadline_s` (None: for ever; the default 0 gives up at
`deadline_s`); then `QueueUnavailable`. A rejected password is never retried: `QueueAuthError`
names the URL with the password removed. Retrying a write whose reply was lost can apply
it twice; the queue's callers are written for that (the consumer drops duplicate group ids).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncrl.infra import ExpectedFailure, Unreachable, redact_url

log = logging.getLogger("asyncrl.queue")


class QueueAuthError(ConnectionError, ExpectedFailure):
    """Redis refused our credentials (wrong or missing password)."""


class QueueUnavailable(ConnectionError, Unreachable):
    """Redis could not be reached within the retry deadline."""


class BadRedisUrl(ValueError, ExpectedFailure):
    """A Redis URL of a scheme redis-py cannot open."""


def _is_auth_error(e: Exception) -> bool:
    if isinstance(e, (redis.AuthenticationError, redis.AuthenticationWrongNumberOfArgsError)):
        return True
    msg = str(e)
    return isinstance(e, redis.ResponseError) and msg.startswith(("NOAUTH", "WRONGPASS", "AUTH"))


def open_client(url: str, *, password: str | None = None, socket_timeout: float = 30.0) -> redis.Redis:
    """A redis-py client for redis://, rediss:// (TLS, handled by redis-py) or unix:// URLs.

    Responses stay bytes (records are binary). A password in the URL wins over `password`.
    """
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise BadRedisUrl(f"Redis URL {redact_url(url)!r}: must start with redis://, rediss:// or unix://")
    # redis-py's own retry (10 tries, ~2 s) is switched off: it would re-send a command whose
    # reply was lost without telling the caller (a re-sent XREADGROUP hides the entries the
    # lost reply delivered), and it cut a longer outage short for calls not wrapped in ours.
    # Retrier is the one retry layer, and its on_retry hooks repair what a lost reply did.
    kwargs: dict[str, Any] = dict(
        socket_connect_timeout=5.0,
        socket_timeout=socket_timeout,
        socket_keepalive=True,
        health_check_interval=30,
        retry=Retry(NoBackoff(), 0),
    )
    if password is not None:
        kwargs["password"] = password
    return client_from_url(url, **kwargs)


def client_from_url(url: str, **kwargs: Any) -> redis.Redis:
    """``redis.Redis.from_url``, whose errors on a URL it cannot read quote the URL's pieces
    (an unescaped "/", "?" or "#" in a password makes redis-py read its start as the port):
    BadRedisUrl names the URL without its password instead."""
    try:
        return redis.Redis.from_url(url, **kwargs)
    except ValueError:
        raise BadRedisUrl(
            f"Redis URL {redact_url(url)!r} cannot be read: percent-encode a password's special "
            "characters ('/' as %2F, '?' as %3F, '#' as %23, '@' as %40, ':' as %3A)"
        ) from None


OUTAGE_LOG_S = 60.0
"""While an outage is waited out, how often that is said."""


def _duration(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 60 else f"{seconds // 60:.0f}m"


class Retrier:
    """Call `fn(*args)`; on a connection error back off and retry until `deadline_s`, then wait
    the outage out until `outage_deadline_s` (None: no limit; 0: give up at `deadline_s`)."""

    def __init__(
        self,
        safe_url: str,
        *,
        deadline_s: float = 30.0,
        outage_deadline_s: float | None = 0.0,
        first_wait: float = 0.05,
        max_wait: float = 2.0,
    ):
        self.safe_url = safe_url
        self.deadline_s = deadline_s
        self.outage_deadline_s = outage_deadline_s
        self.first_wait = first_wait
        self.max_wait = max_wait
        self.recovered_at = 0.0
        """time.time() when a call last succeeded after failing: heartbeats older than that
        were not written for the outage's length, not because their writer hung."""
        self.outages = 0
        """Outages this client lived through: a call that failed, then went through (calls
        failing together are one outage, from the first failure to the first recovery)."""
        self.outage_s = 0.0
        """Their seconds, all together (queue/outage_s, marked on the dashboard's charts)."""
        self._down_since: float | None = None
        self._back_at = 0.0  # monotonic time of the last recovery
        self._lock = threading.Lock()

    def _give_up_after(self) -> float:
        if self.outage_deadline_s is None:
            return float("inf")
        return max(self.deadline_s, self.outage_deadline_s)

    def __call__(
        self, fn: Callable[..., Any], *args: Any, on_retry: Callable[[], None] | None = None, **kwargs: Any
    ) -> Any:
        t0 = time.monotonic()
        give_up = t0 + self._give_up_after()
        quiet_after = t0 + self.deadline_s  # past this, one line a minute instead of one a retry
        next_say = quiet_after
        wait = self.first_wait
        attempt = 0
        while True:
            tried = time.monotonic()
            try:
                out = fn(*args, **kwargs)
                if attempt:
                    self.recovered_at = time.time()
                    self._recovered()
                    if time.monotonic() > quiet_after:
                        log.warning("Redis at %s is back after %s", self.safe_url, _duration(time.monotonic() - t0))
                return out
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as e:
                if _is_auth_error(e):
                    raise QueueAuthError(
                        f"Redis at {self.safe_url} rejected the credentials ({type(e).__name__}: {e}); "
                        "check queue.password or the password in queue.redis_url"
                    ) from None
                if isinstance(e, redis.ResponseError):
                    raise
                attempt += 1
                now = time.monotonic()
                with self._lock:
                    # An attempt made before the last recovery failed in the outage already counted.
                    if self._down_since is None and tried >= self._back_at:
                        self._down_since = max(t0, self._back_at)
                if now >= give_up:
                    raise QueueUnavailable(
                        f"Redis at {self.safe_url} unreachable after {attempt} attempts over "
                        f"{now - t0:.1f}s: {type(e).__name__}: {e}"
                        + (f" (queue.outage_deadline_s={self.outage_deadline_s:g})" if self.outage_deadline_s else "")
                    ) from e
                if now < quiet_after:
                    log.warning(
                        "Redis at %s: %s: %s; retry %d in %.2fs", self.safe_url, type(e).__name__, e, attempt, wait
                    )
                elif now >= next_say:
                    limit = "none" if self.outage_deadline_s is None else f"{self.outage_deadline_s:g}"
                    log.warning(
                        "redis at %s unreachable for %s; waiting (queue.outage_deadline_s=%s)",
                        self.safe_url,
                        _duration(now - t0),
                        limit,
                    )
                    next_say = now + OUTAGE_LOG_S
                time.sleep(min(wait, give_up - now))
                wait = min(wait * 2, self.max_wait)
                if on_retry is not None:
                    on_retry()

    def _recovered(self) -> None:
        with self._lock:
            if self._down_since is not None:
                self._back_at = time.monotonic()
                self.outages += 1
                self.outage_s += self._back_at - self._down_since
                self._down_since = None


def transaction(client: redis.Redis, retry: Retrier, build: Callable[[Any], None]) -> list:
    """Run the commands `build` queues on a pipeline as one MULTI/EXEC, retried as a whole.

    The pipeline is rebuilt on each attempt: redis-py empties it when execute() fails.
    """

    def attempt() -> list:
        pipe = client.pipeline(transaction=True)
        build(pipe)
        return pipe.execute() if len(pipe) else []

    return retry(attempt)
