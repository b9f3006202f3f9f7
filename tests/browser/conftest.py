"""Browser fixtures: Debian's headless Chromium driven by Playwright, and the dashboard on a real
uvicorn server on a free loopback port. Skips (with the reason) only when Chromium is missing or
cannot start; everything is stopped at the end, the server thread by its own exit flag."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from asyncrl.queue.server import free_port


@pytest.fixture(scope="module")
def chromium():
    """A launched headless Chromium (Playwright browser object)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium not found on PATH (apt-get install -y chromium)")
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    try:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = pw.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox"])
    except PlaywrightError as e:
        pw.stop()
        pytest.skip(f"chromium at {path} could not be launched: {str(e).splitlines()[0]}")
    yield browser
    browser.close()
    pw.stop()


@pytest.fixture
def serve_dashboard():
    """serve_dashboard(app) -> base URL; runs uvicorn in a thread until the test ends."""
    import uvicorn

    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(app) -> str:
        port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name=f"dashboard-{port}", daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"dashboard server on port {port} did not start")
            time.sleep(0.02)
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)
