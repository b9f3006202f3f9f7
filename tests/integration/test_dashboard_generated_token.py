"""`monitor.dashboard_token: generate` through the trainer's own dashboard start-up: a random
token in run_dir/dashboard_token (0600), and the served dashboard wants exactly it."""

from __future__ import annotations

import os
import stat
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

from asyncrl.config import load_config
from asyncrl.control.train import _start_dashboard


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_generated_token_guards_the_trainers_dashboard(redis_url, tmp_path):
    cfg = load_config(None, ["monitor.dashboard_token=generate", "monitor.dashboard_port=0"])
    stops: list = []
    rt = SimpleNamespace(redis_url=redis_url, run_dir=tmp_path, callback=lambda *a: stops.append(a))
    url = _start_dashboard(cfg, rt)  # type: ignore[arg-type]
    try:
        path = tmp_path / "dashboard_token"
        token = path.read_text().strip()
        assert len(token) >= 32 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        deadline = time.monotonic() + 10
        while True:  # the server thread is up once it answers at all
            try:
                code = _status(url + "api/runs")
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert code == 401
        assert _status(url + "api/runs?token=" + "x" * len(token)) == 403
        assert _status(url + "api/runs?token=" + token) == 200
    finally:
        for fn, *args in stops:
            fn(*args)
