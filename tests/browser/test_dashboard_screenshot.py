"""scripts/dashboard_screenshot.py, the command docs/guide/dashboard.md gives for its picture:
a finished run's page, rendered by headless Chromium, saved whole."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[2]


def test_the_screenshot_script_saves_a_finished_runs_whole_page(finished_run_dir, tmp_path):
    if shutil.which("chromium") is None and shutil.which("chromium-browser") is None:
        pytest.skip("chromium not found on PATH (apt-get install -y chromium)")
    from PIL import Image

    run_dir, _ = finished_run_dir
    out = tmp_path / "dashboard.png"
    done = subprocess.run(
        [sys.executable, "scripts/dashboard_screenshot.py", str(run_dir), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.strip() == f"{out}: {run_dir} at step 30"  # it waited for the last step
    width, height = Image.open(out).size
    assert width == 1440 and height > 2000  # the whole page: every chart, not the first screen


def test_it_refuses_a_directory_that_is_not_a_run(tmp_path):
    done = subprocess.run(
        [sys.executable, "scripts/dashboard_screenshot.py", str(tmp_path), str(tmp_path / "x.png")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "is not a run directory: it has no metrics.jsonl" in done.stderr, done.stderr
    assert not (tmp_path / "x.png").exists()


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/dashboard_screenshot.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_it_refuses_a_run_with_no_step_yet_at_once(tmp_path):
    """An empty metrics.jsonl (a run that has not logged): no step to wait for, so a clear
    refusal, not a 30 s wait for the page to show step None."""
    (tmp_path / "metrics.jsonl").write_text("")
    done = _run(str(tmp_path), str(tmp_path / "x.png"))
    assert done.returncode == 2, done.stderr
    assert f"{tmp_path}: metrics.jsonl holds no step yet: nothing to picture" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "x.png").exists()


def test_it_refuses_an_output_in_a_missing_directory(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    done = _run(str(tmp_path), str(tmp_path / "nope" / "x.png"))
    assert done.returncode == 2 and "its directory does not exist" in done.stderr, done.stderr
