"""Benchmarks that cannot rot: every bench under bench/ runs in its smoke mode (`--smoke`: tiny
sizes, seconds), as a subprocess the way a user runs it, and must exit 0 with its JSON as the
last stdout line (whatever Ray and vLLM print meanwhile), carrying its headline keys and its
own checks, all passed. All nine run in the default suite.

Their cost is start-ups, not work: a vLLM engine, a training job, Ray and learner actors.
A job's start-up (measured 2026-11-27, `asyncrl train` of the soak smoke on the loaded 2-core
box: ready after 24.1 s: Ray up at 3.9 s, the learner at 12.6 s, the generator at 24.1 s) is mostly one
process importing vLLM, then its engine process importing it again, while the other core
idles once the learner is up. So simulate and queue run first, alone (queue times 1 s
windows), and the other seven run as two lanes side by side (LANES: e2e, sync, generate | learner,
soak, peers, staleness), each lane one bench after another: never more than two engines in memory.
staleness starts no Ray, engine or job (one process, six 3-step cells of a tiny model: 11.7 s
alone, 2026-11-28); it rides at the end of the shorter lane, so it adds a few seconds at most.
Where the suite itself runs as two lanes (scripts/test.sh sets ASYNCRL_TEST_LANE), the seven run
one after another instead: the other lane is the second.

Measured one after another (2026-11-27, the 2-core box shared with other work): learner 28.0 s,
e2e 77.2 s (three job start-ups on one Ray), soak 39.8 s, peers 36.5 s; a second run 38.7,
80.8, 43.1 and 37.2 s; with simulate, queue, sync and generate (48-60 s) ~230-260 s in all.
Side by side (2026-11-27, same box, `pytest tests/integration/test_bench_smoke.py`): all eight
passed in 138 s (simulate 1.2 s, queue 4.4 s, the lanes done ~132 s later; a job's start-up
beside another bench 26-34 s). pytest's per-test durations here are waits, not bench times.
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
LANES = (("e2e", "sync", "generate"), ("learner", "soak", "peers", "staleness"))
if os.environ.get("ASYNCRL_TEST_LANE"):
    # The suite runs as two lanes already (scripts/test.sh): one bench at a time here, so the
    # box holds two lanes' work, not three.
    LANES = (tuple(name for lane in LANES for name in lane),)
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
        "staleness": ["--out", str(out / "staleness")],
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
    # The wall-clock summary ran on the real record: no budget, so the horizon is the run's last
    # step, where the run has a rolling reward; its one seed is recorded.
    t = r["by_workload"]["demo"]["time"]
    ours_t = t["trainers"]["asyncrl_async"]
    assert t["budget_s"] is None and t["horizon_s"] > 0 and ours_t["runs"] == 1 and ours_t["seeds"] == [0]
    assert ours_t["reward_at"][f"{t['times_s'][-1]:g}"]["n"] == 1
    assert ours_t["time_to_threshold_s"] is not None and t["best_peer"] is None and t["ratio"] is None


def test_staleness_smoke(lanes):
    """The study's harness ran a synchronous and a stale cell per task and correction: at k = 0
    the sampler's log-probs were the learner's, at k = 2 the learner saw off-policy data."""
    r = lanes.result("staleness")
    assert set(r["summary"]) == {"reverse", "arithmetic"}
    for task in r["summary"].values():
        for row in task["corrections"].values():
            assert row["0"]["abs_logp_diff"] < 1e-4 < row["2"]["abs_logp_diff"]
    out = lanes.out / "staleness"
    assert (out / "staleness.png").exists() and (out / "staleness.md").exists()
