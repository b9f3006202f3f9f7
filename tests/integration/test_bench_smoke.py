"""Benchmarks that cannot rot: every bench under bench/ runs in its smoke mode (`--smoke`: tiny
sizes, seconds), as a subprocess the way a user runs it, and must exit 0 with its JSON as the
last stdout line (whatever Ray and vLLM print meanwhile), carrying its headline keys and its
own checks, all passed.

The suite's budget for these is ~45 s on 2 cores. Measured one after another on a loaded
2-core box (2026-11-25): simulate 1.2 s, queue 3.6 s, sync 21.5 s and generate 21.9 s (each
one vLLM engine start) run by default, 48 s together (60 s in a second, busier run). The rest
run with
ASYNCRL_BENCH_SMOKE_ALL=1: learner 28 s (Ray, three learner groups, two ac processes), peers
32 s and soak 38 s (one training job each) and e2e 72 s (three jobs); each alone would take
the suite's share for these past its budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.job import stop_process_tree

ROOT = Path(__file__).resolve().parents[2]
# The benches past simulate and queue, in two lanes that run side by side, each lane's benches
# one after another. Two at a time: a job's start-up is mostly one process importing
# (vLLM, torch) while the other core idles, and at most two engines are in memory at once.
LANES = (("e2e", "sync", "generate"), ("learner", "soak", "peers"))
LANE_TIMEOUT_S = 600  # per bench; a bench beside another one on two cores takes longer


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}


def _command(name: str, *args: str) -> list[str]:
    return [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--smoke", *args]


def parse_smoke(name: str, returncode: int | None, stdout: str, stderr: str) -> dict:
    """The common checks on a finished bench/NAME.py --smoke: exit 0, its last stdout line is
    JSON with `checks`, all true. Returns that JSON."""
    where = f"bench/{name}.py --smoke exited {returncode}; stderr ends:\n{stderr[-4000:]}"
    assert returncode == 0, where
    lines = stdout.strip().splitlines()
    assert lines, f"no stdout\n{where}"
    result = json.loads(lines[-1])  # the contract: the last stdout line is the JSON
    failed = [k for k, ok in result.get("checks", {}).items() if not ok]
    assert result.get("checks") and not failed, f"{name}: checks failed: {failed}\n{result}"
    return result


def run_smoke(name: str, *args: str, timeout: float = 300) -> dict:
    """Run bench/NAME.py --smoke alone, now; its JSON after the common checks."""
    proc = subprocess.run(_command(name, *args), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    return parse_smoke(name, proc.returncode, proc.stdout, proc.stderr)


@dataclass
class Smoke:
    """One bench's smoke run in a lane: its command, and once `done` is set, what it gave."""

    name: str
    args: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    proc: subprocess.Popen | None = None
    stdout: str = ""
    stderr: str = ""
    error: str | None = None


class Lanes:
    """The lane benches this session selected, started together when the first of their tests
    asks; each test then waits for its own bench and checks it (a failure is that bench's)."""

    def __init__(self, smokes: dict[str, Smoke], out: Path):
        self.smokes = smokes
        self.out = out
        """Where e2e, soak and peers write (e2e/, soak/soak, peers/)."""
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._run_lane, args=(names,), name=f"smoke-lane-{i}", daemon=True)
            for i, names in enumerate(LANES)
        ]
        for t in self._threads:
            t.start()

    def _run_lane(self, names: tuple[str, ...]) -> None:
        for name in names:
            smoke = self.smokes.get(name)
            if smoke is None:
                continue
            try:
                if self._stopping:
                    smoke.error = "not run: the module was torn down first"
                    continue
                smoke.proc = subprocess.Popen(
                    _command(name, *smoke.args),
                    cwd=ROOT,
                    env=_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                smoke.stdout, smoke.stderr = smoke.proc.communicate(timeout=LANE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                smoke.error = f"timed out after {LANE_TIMEOUT_S} s"
                if smoke.proc is not None:
                    stop_process_tree(smoke.proc, timeout=30)
            except Exception as e:  # reported by the bench's own test
                smoke.error = f"{type(e).__name__}: {e}"
            finally:
                smoke.done.set()

    def result(self, name: str) -> dict:
        smoke = self.smokes[name]
        smoke.done.wait()
        assert smoke.error is None, f"bench/{name}.py --smoke: {smoke.error}\n{smoke.stderr[-4000:]}"
        assert smoke.proc is not None
        return parse_smoke(name, smoke.proc.returncode, smoke.stdout, smoke.stderr)

    def stop(self) -> None:
        """Start no further bench; stop (SIGINT, then SIGKILL of the tree) any still running."""
        self._stopping = True
        for smoke in self.smokes.values():
            if smoke.proc is not None and not smoke.done.is_set():
                stop_process_tree(smoke.proc, timeout=60)
        for t in self._threads:
            t.join(timeout=120)


@pytest.fixture(scope="module")
def lanes(request, tmp_path_factory):
    """Starts the lane benches whose tests this session runs (the others never start)."""
    selected = {
        item.name.removeprefix("test_").removesuffix("_smoke")
        for item in request.session.items
        if getattr(item, "module", None) is request.module
    }
    out = tmp_path_factory.mktemp("bench-smoke")
    args = {
        "e2e": ["--out", str(out / "e2e")],
        "soak": ["--run-dir", str(out / "soak" / "soak")],
        "peers": ["--out", str(out / "peers"), "--plot", ""],
    }
    names = [n for lane in LANES for n in lane if n in selected]
    running = Lanes({n: Smoke(n, args.get(n, [])) for n in names}, out)
    yield running
    running.stop()


def test_simulate_smoke():
    r = run_smoke("simulate")
    assert set(r["speedups"]) == {"demo_like", "long_tail", "cluster_7b"}
    assert all(t["async_s2"] > 0 for t in r["speedups"].values())


def test_queue_smoke():
    r = run_smoke("queue")
    assert {"groups_per_s", "ratio_vs_raw_loop", "configs"} <= set(r)
    assert {c["kind"] for c in r["configs"]} == {"ours", "raw"}
    assert r["groups_per_s"] > 0 and r["ratio_vs_raw_loop"] > 0


def test_learner_smoke(lanes):
    r = lanes.result("learner")
    assert r["ratio"] > 0 and r["packing"]["ratio"] > 0
    assert 0 <= r["packing"]["padding_frac_packed"] <= r["packing"]["padding_frac_padded"] < 1
    assert {"peak_ratio", "step_peak_ratio", "step_time_ratio"} <= set(r["ac"])


@pytest.mark.vllm
def test_sync_smoke(lanes):
    """The shm path: publish -> applied in a running engine, which then samples with exactly
    the published weights (checked against a Hugging Face forward pass)."""
    r = lanes.result("sync")
    assert r["sizes"][0]["size"] == "tiny" and r["ratio"] > 0
    assert r["sizes"][0]["engine_load_s"] > 0


@pytest.mark.vllm
def test_generate_smoke(lanes):
    r = lanes.result("generate")
    assert r["generator_tokens_per_s"] > 0 and r["bare_tokens_per_s"] > 0 and r["ratio"] > 0
    assert r["reward_errors"] == 0


@pytest.mark.vllm
def test_e2e_smoke(lanes):
    r = lanes.result("e2e")
    assert set(r["by_workload"]["demo"]) == {"sync", "async_s1"}
    assert r["speedup"] > 0 and r["simulator_max_rel_error"] >= 0
    out = lanes.out / "e2e"
    assert (out / "e2e.json").exists() and (out / "e2e.png").exists()


@pytest.mark.vllm
def test_soak_smoke(lanes):
    r = lanes.result("soak")
    assert r["faults_injected"] == 1 and r["faults"]["connection_drop"] == 1
    assert r["lost"] == 0 and r["double_trained"] == 0


@pytest.mark.vllm
def test_peers_smoke(lanes):
    r = lanes.result("peers")
    ours = r["by_workload"]["demo"]["trainers"]["asyncrl_async"]
    assert ours["error"] is None and ours["completions_per_s"] > 0
    assert ours["useful_tokens_per_s"] == ours["tokens_per_s"] > 0
    assert r["by_workload"]["demo"]["role"] == "engine overhead"
