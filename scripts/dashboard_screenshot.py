"""A picture of a run's dashboard, rendered by headless Chromium from the run directory alone.

    .venv/bin/python scripts/dashboard_screenshot.py runs/demo docs/dashboard.png

Serves the page `asyncrl dashboard RUN_DIR` serves, on a free loopback port, waits until it
shows the run's last step with every chart drawn, and saves a full-page PNG. Needs Chromium
on PATH (Debian's `chromium`) and Playwright (the `dev` extra).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a run directory (its metrics.jsonl)")
    p.add_argument("out", help="the PNG to write")
    p.add_argument("--width", type=int, default=1440, help="viewport width in pixels (default 1440)")
    args = p.parse_args(argv)

    import httpx
    import uvicorn
    from playwright.sync_api import sync_playwright

    from asyncrl.infra import free_port
    from asyncrl.monitor.dashboard.app import create_run_dir_app
    from asyncrl.monitor.dashboard.rundir import NotARunDir

    run_dir = Path(args.run_dir)
    try:
        app = create_run_dir_app(run_dir)
    except NotARunDir as e:
        print(e, file=sys.stderr)
        return 2
    if not Path(args.out).resolve().parent.is_dir():
        print(f"{args.out}: its directory does not exist", file=sys.stderr)
        return 2
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            print(f"the dashboard did not start on port {port}", file=sys.stderr)
            return 1
        time.sleep(0.05)
    try:
        base = f"http://127.0.0.1:{port}"
        # The page is ready once it shows the step the run ended at.
        last_step = httpx.get(f"{base}/api/run/{app.state.default_run}/summary", timeout=30).json()["step"]
        if last_step is None:  # the page would never show a step to wait for
            print(f"{run_dir}: metrics.jsonl holds no step yet: nothing to picture", file=sys.stderr)
            return 2
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium is None:
            print("chromium not found on PATH (apt-get install -y chromium)", file=sys.stderr)
            return 2
        with sync_playwright() as pw:
            # --no-sandbox: as root (CI, containers) Chromium's sandbox refuses to start.
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": args.width, "height": 1000})
            page.goto(f"{base}/")
            page.wait_for_function(
                f"document.getElementById('stat-step').textContent === '{last_step}'", timeout=30_000
            )
            # Every chart has its data (plotly sets .data on the element once drawn).
            page.wait_for_function(
                "[...document.querySelectorAll('#charts .js-plotly-plot')].length > 0 && "
                "[...document.querySelectorAll('#charts .js-plotly-plot')].every(e => e.data)",
                timeout=30_000,
            )
            page.wait_for_timeout(800)  # plotly's transitions
            page.screenshot(path=args.out, full_page=True)
            browser.close()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    print(f"{args.out}: {run_dir} at step {last_step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
