"""The dashboard token on a real server: `monitor.dashboard_token: generate` through the
trainer's own dashboard start-up (a random token in run_dir/dashboard_token, 0600, and the
served dashboard wants exactly it), and the cookie's Secure flag behind a local TLS proxy."""

from __future__ import annotations

import os
import stat
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

from asyncrl.config import load_config
from asyncrl.control.train import _start_dashboard
from asyncrl.monitor.dashboard.app import serve_in_thread


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _wait_up(url: str) -> None:
    deadline = time.monotonic() + 10
    while True:  # the server thread is up once it answers at all
        try:
            _status(url)
            return
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_generated_token_guards_the_trainers_dashboard(redis_url, tmp_path):
    cfg = load_config(None, ["monitor.dashboard_token=generate", "monitor.dashboard_port=0"])
    stops: list = []
    rt = SimpleNamespace(redis_url=redis_url, run_dir=tmp_path, local_dir=tmp_path, callback=lambda *a: stops.append(a))
    url = _start_dashboard(cfg, rt)  # type: ignore[arg-type]
    try:
        path = tmp_path / "dashboard_token"
        token = path.read_text().strip()
        assert len(token) >= 32 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        _wait_up(url)
        assert _status(url + "api/runs") == 401
        assert _status(url + "api/runs?token=" + "x" * len(token)) == 403
        assert _status(url + "api/runs?token=" + token) == 200
    finally:
        for fn, *args in stops:
            fn(*args)


def test_cookie_is_secure_behind_a_local_tls_proxy(redis_url):
    # A TLS terminator on this host tells uvicorn the scheme (it trusts 127.0.0.1's header).
    token = "t" * 20
    server = serve_in_thread(redis_url, host="127.0.0.1", port=0, token=token)
    try:
        url = f"http://127.0.0.1:{server.bound_port}/api/runs?token={token}"
        _wait_up(url)
        cookies = {}
        for proto in ("https", "http"):
            req = urllib.request.Request(url, headers={"X-Forwarded-Proto": proto})
            with urllib.request.urlopen(req, timeout=10) as r:
                cookies[proto] = r.headers["set-cookie"]
        assert "; Secure" in cookies["https"] and "Secure" not in cookies["http"]
    finally:
        server.should_exit = True
