"""Dashboard tokens: long enough, generated on request into a 0600 file, and their cookie kept
off plain HTTP when the dashboard is reached over TLS."""

from __future__ import annotations

import logging
import os
import stat

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from asyncrl.config import ConfigError, load_config
from asyncrl.monitor.dashboard.guard import TOKEN_COOKIE, TokenAuth, check_host, resolve_token

TOKEN = "a-token-of-24-characters"


def test_short_tokens_are_refused_at_config_load_and_by_the_server():
    with pytest.raises(ConfigError, match=r"monitor\.dashboard_token: 5 characters; give at least 16") as err:
        load_config(None, ["monitor.dashboard_token=s3cr3"])
    assert "s3cr3" not in str(err.value)  # the secret itself is never echoed
    assert load_config(None, [f"monitor.dashboard_token={TOKEN}"]).monitor.dashboard_token == TOKEN
    cfg = load_config(None, ["monitor.dashboard_host=0.0.0.0", "monitor.dashboard_token=generate"])
    assert cfg.monitor.dashboard_token == "generate"
    # `asyncrl dashboard --token` goes through check_host.
    with pytest.raises(ValueError, match="15 characters; give at least 16"):
        check_host("127.0.0.1", "x" * 15)
    check_host("0.0.0.0", "x" * 16)


def test_generate_writes_a_random_token_to_a_0600_file_and_logs_only_its_path(tmp_path, caplog):
    assert resolve_token(TOKEN, tmp_path) == TOKEN and resolve_token(None, tmp_path) is None
    assert not (tmp_path / "dashboard_token").exists()
    with caplog.at_level(logging.INFO, logger="asyncrl.monitor.dashboard.guard"):
        first = resolve_token("generate", tmp_path)
    path = tmp_path / "dashboard_token"
    assert path.read_text().strip() == first and len(first) >= 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert str(path) in caplog.text and first not in caplog.text
    os.chmod(path, 0o644)  # a resumed run's older file
    second = resolve_token("generate", tmp_path)
    assert second != first and stat.S_IMODE(os.stat(path).st_mode) == 0o600


def _app() -> Starlette:
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
    app.add_middleware(TokenAuth, token=TOKEN)
    return app


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_cookie_is_secure_exactly_when_served_over_tls(scheme):
    with TestClient(_app(), base_url=f"{scheme}://testserver") as c:
        r = c.get("/", params={"token": TOKEN})
    assert r.status_code == 200
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{TOKEN_COOKIE}={TOKEN};") and "HttpOnly" in cookie
    assert ("Secure" in cookie) == (scheme == "https")


def test_an_empty_token_in_the_link_keeps_the_cookie():
    """`?token=` (empty) with a valid cookie is the cookie's request: it must not set an empty
    cookie over the valid one (a logout by link)."""
    with TestClient(_app(), base_url="http://testserver") as c:
        c.cookies.set(TOKEN_COOKIE, TOKEN)
        r = c.get("/", params={"token": ""})
        assert r.status_code == 200 and "set-cookie" not in r.headers
        c.cookies.clear()
        assert c.get("/", params={"token": ""}).status_code == 401  # and no cookie: no token at all


def test_a_tokenless_dashboard_answers_only_requests_that_name_loopback_and_its_port():
    """DNS rebinding: a page at evil.example whose name resolves to 127.0.0.1 sends Host:
    evil.example:PORT. The real server (uvicorn on loopback) refuses it; loopback names pass."""
    import http.client
    import time

    from asyncrl.monitor.dashboard.app import serve_in_thread

    server = serve_in_thread("redis://127.0.0.1:1/0", host="127.0.0.1", port=0)  # no Redis needed
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        port = server.bound_port

        def status(host: str, path: str = "/static/style.css") -> int:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.putrequest("GET", path, skip_host=True)
            conn.putheader("Host", host)
            conn.endheaders()
            code = conn.getresponse().status
            conn.close()
            return code

        for ok in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", f"LOCALHOST:{port}"):
            assert status(ok) == 200, ok
        elsewhere = (f"evil.example:{port}", "evil.example", f"127.0.0.1:{port + 1}", f"localhost.evil.example:{port}")
        for bad in (*elsewhere, ""):
            assert status(bad) == 403, bad
        assert status(f"evil.example:{port}", "/api/runs") == 403
    finally:
        server.should_exit = True
