"""One redactor for Redis URLs (asyncrl.infra.redact_url), used by the queue's logs
and errors and by the live dashboard: no password reaches a log line, an error or a page."""

from __future__ import annotations

import pytest

from asyncrl.infra import redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),  # nothing to hide: unchanged
        ("redis://:s3cret@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://alice:s3cret@10.0.0.5:6380/2", "redis://alice@10.0.0.5:6380/2"),  # the account stays
        ("redis://alice@10.0.0.5:6380/2", "redis://alice@10.0.0.5:6380/2"),  # a user name alone is no secret
        ("rediss://:p@ss@word@cache.example:6379/0", "rediss://cache.example:6379/0"),  # unescaped "@"s
        ("redis://:p%40ss@[::1]:6379/0", "redis://[::1]:6379/0"),
        ("unix:///run/redis.sock?db=1&password=s3cret", "unix:///run/redis.sock?db=1"),
        ("redis://127.0.0.1:6379/0?password=s3cret", "redis://127.0.0.1:6379/0"),
        # Unescaped "/", "?", "#" in a password (base64 holds "/"): the user info ends at the last "@".
        ("redis://:ab/Cd+ef==@host:6379/0", "redis://host:6379/0"),
        ("redis://alice:a?b=c#d/e@host:6379/0", "redis://alice@host:6379/0"),
        ("rediss://:x#y@host:6379/0?ssl_password=keypass", "rediss://host:6379/0"),
        ("rediss://h:1/0?ssl_password=keypass&db=2", "rediss://h:1/0?db=2"),
        ("redis://h:1/0?password=a@b", "redis://<redacted>"),  # the "@" is the password's: hide it all
    ],
)
def test_redact_url_removes_every_password_and_keeps_the_rest(url, shown):
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "redis://:Top/Secret+Base64==@127.0.0.1:6379/0",
        "redis://:TopSecret?x@127.0.0.1:6379/0",
        "redis://user:Top#Secret@127.0.0.1:6379/0",
    ],
)
def test_a_url_redis_py_cannot_read_is_refused_without_its_password(url):
    """redis-py reads the start of such a password as the port, and says so: the error quotes it."""
    from asyncrl.monitor.sinks import RedisSink
    from asyncrl.queue.connection import BadRedisUrl, open_client

    for connect in (lambda: open_client(url), lambda: RedisSink(url, run="r")):
        with pytest.raises(BadRedisUrl) as bad:
            connect()
        assert "Top" not in str(bad.value) and "Secret" not in str(bad.value)
        assert "127.0.0.1:6379" in str(bad.value) and "%2F" in str(bad.value)


def test_the_dashboard_shows_and_reports_urls_through_the_same_redactor():
    from asyncrl.monitor.dashboard import create_app

    app = create_app("redis://alice:p@ss@127.0.0.1:1/0", run=None)  # a client, not yet a connection
    assert app.state.source.display == "redis://alice@127.0.0.1:1/0"
    with pytest.raises(ValueError) as bad:
        create_app("http://:s3cret@127.0.0.1:1/0", run=None)
    assert "s3cret" not in str(bad.value) and "127.0.0.1:1" in str(bad.value)
