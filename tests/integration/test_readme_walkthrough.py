"""The README followed literally, in a fresh copy of the repository, as a new user would: the CPU
demo, the own reward function, the own environment, then the finished demo's dashboard.

The copy is what a clone holds: the tracked files and the untracked ones git does not ignore
(`git ls-files -co --exclude-standard`), so nothing a developer's checkout has lying about
(runs/, caches) helps. Its `.venv` is a link to this checkout's, already installed:
scripts/setup_venv.sh compares its stamp with pyproject.toml and installs nothing (a
fresh-machine install needs the network, which CI lacks; `.ci/run` covers that path). The
package the commands import is the copy's own (PYTHONPATH=<copy>, as an editable install of
the clone would give).

The commands are read out of README.md, not copied here, so a README whose commands stop
working, or stop doing what it says, fails this test:

- "Install and run the CPU demo": its `bash heavy` block, run as is; the run must end with the
  reward the README promises ("from about A to near B"), all of the config's steps trained.
- "Your own reward" and "Your own environment": their `bash heavy` blocks (the training
  commands), run in the activated virtualenv as the README says to type `asyncrl`; each run
  finishes in its own directory and its reward rises. Their `--check` commands are run by
  tests/unit/test_doc_commands.py.
- "First commands": `asyncrl dashboard RUN_DIR`, started on the demo's directory (plus
  `--port`, a free one, as the guide's dashboard page shows), read through its HTTP API.

Cost: three training jobs, each its own process with its own start-up (the demo's 200 steps,
then 100 steps each), and one dashboard start. Measured 256 s on a 2-core box other jobs
shared (runs of 113, 62 and 59 s with start-ups of 33-35 s; idle, a start-up is about 24 s).
No other test runs these jobs; the dashboard command's own start on a synthetic run was
dropped for this one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from asyncrl.queue.server import free_port
from tests.support.job import stop_process_tree

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(1200)

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)


def readme_sections() -> dict[str, str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def heavy_commands(section: str) -> list[str]:
    """The command lines of a README section's `bash heavy` blocks, as written."""
    lines = []
    for m in FENCE.finditer(section):
        if m.group(1).split()[:2] == ["bash", "heavy"]:
            lines += [line for line in m.group(2).replace("\\\n", " ").splitlines() if line.strip()]
    return lines


def fresh_copy(dest: Path) -> Path:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for rel in filter(None, files.split("\0")):
        src = ROOT / rel
        if not src.is_file() or src.is_symlink():
            continue  # deleted in the work tree, or the .venv link itself
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    (dest / ".venv").symlink_to((ROOT / ".venv").resolve())
    return dest


def venv_is_installed_for(copy: Path) -> bool:
    """What scripts/setup_venv.sh checks before installing: its stamp names this pyproject.toml."""
    import hashlib

    stamp = copy / ".venv" / ".asyncrl-installed"
    extras = os.environ.get("ASYNCRL_EXTRAS", "cpu,dev")
    want = f"{hashlib.sha256((copy / 'pyproject.toml').read_bytes()).hexdigest()} {extras}"
    return stamp.is_file() and stamp.read_text().strip() == want


class Shell:
    """Runs README lines in the copy, in bash, the virtualenv activated as the README says."""

    def __init__(self, copy: Path, logs: Path):
        self.copy, self.logs = copy, logs
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
        self.env["PYTHONPATH"] = str(copy)
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.n = 0

    def script(self, line: str) -> str:
        return f"source .venv/bin/activate && {line}" if not line.startswith("bash scripts/") else line

    def popen(self, line: str) -> tuple[subprocess.Popen, Path]:
        self.n += 1
        log = self.logs / f"{self.n:02d}.log"
        proc = subprocess.Popen(
            ["bash", "-c", self.script(line)],
            cwd=self.copy,
            env=self.env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: cleaned up by PID if it hangs
        )
        return proc, log

    def run(self, line: str, timeout: float = 600) -> str:
        proc, log = self.popen(line)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc, signal.SIGINT)
            pytest.fail(f"{line!r} ran past {timeout} s: {log.read_text()[-3000:]}")
        out = log.read_text()
        assert rc == 0, f"{line!r} exited {rc}: {out[-4000:]}"
        return out


def stop(proc: subprocess.Popen, sig: int) -> None:
    """Signal the command's process group (bash and what it runs), then kill what is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    stop_process_tree(proc, signal.SIGKILL, timeout=10)


def rewards(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return [r["reward/mean"] for r in rows]


def run_dir_of(line: str, default: str) -> Path:
    found = [w.partition("=")[2] for w in shlex.split(line) if w.startswith("control.run_dir=")]
    return Path(found[-1] if found else default)


def steps_of(line: str, default: int) -> int:
    found = [int(w.partition("=")[2]) for w in shlex.split(line) if w.startswith("control.total_steps=")]
    return found[-1] if found else default


def test_the_readme_followed_in_a_fresh_copy(tmp_path):
    from asyncrl.config import load_config

    sections = readme_sections()
    copy = fresh_copy(tmp_path / "asyncrl")
    if not venv_is_installed_for(copy):
        pytest.fail(".venv is not installed for this pyproject.toml: run `bash scripts/setup_venv.sh` first")
    assert not (copy / "runs").exists()
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = Shell(copy, logs)
    demo_cfg = load_config(copy / "configs" / "demo.yaml")

    # The CPU demo, exactly as the README gives it.
    demo_section = sections["Install and run the CPU demo"]
    assert heavy_commands(demo_section) == ["bash scripts/demo.sh"], heavy_commands(demo_section)
    out = sh.run("bash scripts/demo.sh")
    assert "[setup]" not in out, out[:2000]  # the linked .venv was taken as installed
    assert re.search(r"dashboard: http://127\.0\.0\.1:\d+/", out), out[-3000:]
    promise = re.search(r"mean reward goes from about (\S+) to near (\d\.\d+)", demo_section)
    assert promise, "the README no longer states the demo's outcome"
    start, end = (float(v.replace("\u2212", "-")) for v in promise.groups())
    demo_dir = copy / demo_cfg.control.run_dir
    demo_rewards = rewards(demo_dir)
    assert len(demo_rewards) == demo_cfg.control.total_steps
    first, last = statistics.fmean(demo_rewards[:10]), statistics.fmean(demo_rewards[-10:])
    assert abs(first - start) < 0.2 and last > end - 0.2, f"the demo's reward went {first:.3f} -> {last:.3f}"
    assert f"run finished: {demo_cfg.control.total_steps} steps in " in out, out[-3000:]

    # Your own reward, then your own environment: each a run of its own that learns.
    for title in ("Your own reward", "Your own environment"):
        commands = heavy_commands(sections[title])
        assert len(commands) == 1 and commands[0].startswith("PYTHONPATH=. asyncrl train "), commands
        line = commands[0]
        out = sh.run(line)
        run_dir = copy / run_dir_of(line, demo_cfg.control.run_dir)
        assert run_dir != demo_dir, f"{title}: its run would mix into the demo's directory"
        got = rewards(run_dir)
        assert len(got) == steps_of(line, demo_cfg.control.total_steps), f"{title}: {out[-3000:]}"
        first, last = statistics.fmean(got[:10]), statistics.fmean(got[-10:])
        assert last > first + 0.25, f"{title}: reward {first:.3f} -> {last:.3f} over {len(got)} steps"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "finished", summary
    assert len(rewards(demo_dir)) == demo_cfg.control.total_steps  # the demo's directory untouched

    # The finished demo's dashboard, as "First commands" gives it, read through its API.
    dashboard = re.findall(r"`(asyncrl dashboard [^`]+)`", sections["First commands"])
    assert dashboard == [f"asyncrl dashboard {demo_cfg.control.run_dir}"], dashboard
    summary_file = (demo_dir / "summary.json").read_bytes()
    port = free_port()
    proc, log = sh.popen(f"{dashboard[0]} --port {port}")
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                runs = httpx.get(f"{base}/api/runs", timeout=5).json()["runs"]
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.3)
        name = demo_cfg.control.run_name
        assert [r["run"] for r in runs] == [name]
        s = httpx.get(f"{base}/api/run/{name}/summary", timeout=10).json()
        assert s["mode"] == "finished" and s["status"] == "finished", s
        assert s["step"] == demo_cfg.control.total_steps and s["counters"]["groups_trained"] == (
            demo_cfg.control.total_steps * demo_cfg.control.groups_per_step
        )
        assert s["latest"]["reward/mean"] == pytest.approx(demo_rewards[-1])
        series = httpx.get(f"{base}/api/run/{name}/series?names=reward/mean", timeout=10).json()["series"]
        assert series["reward/mean"]["step"] == list(range(1, len(demo_rewards) + 1))
        assert series["reward/mean"]["value"] == pytest.approx(demo_rewards)
        assert httpx.get(f"{base}/run/{name}", timeout=10).status_code == 200
    finally:
        stop(proc, signal.SIGTERM)
    said = re.search(rf"{re.escape(base)}/ \(finished run '{name}' from (\S+)\)", log.read_text())
    assert said and (copy / said[1]).resolve() == demo_dir.resolve(), log.read_text()[-2000:]
    assert (demo_dir / "summary.json").read_bytes() == summary_file  # it only reads the run
