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
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_smoke(name: str, *args: str, timeout: float = 300) -> dict:
    """Run bench/NAME.py --smoke; return its last stdout line, parsed, after the common checks."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--smoke", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    where = f"bench/{name}.py --smoke exited {proc.returncode}; stderr ends:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, where
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no stdout\n{where}"
    result = json.loads(lines[-1])  # the contract: the last stdout line is the JSON
    failed = [k for k, ok in result.get("checks", {}).items() if not ok]
    assert result.get("checks") and not failed, f"{name}: checks failed: {failed}\n{result}"
    return result


def test_simulate_smoke():
    r = run_smoke("simulate")
    assert set(r["speedups"]) == {"demo_like", "long_tail", "cluster_7b"}
    assert all(t["async_s2"] > 0 for t in r["speedups"].values())


def test_queue_smoke():
    r = run_smoke("queue")
    assert {"groups_per_s", "ratio_vs_raw_loop", "configs"} <= set(r)
    assert {c["kind"] for c in r["configs"]} == {"ours", "raw"}
    assert r["groups_per_s"] > 0 and r["ratio_vs_raw_loop"] > 0


def test_learner_smoke():
    r = run_smoke("learner")
    assert r["ratio"] > 0 and r["packing"]["ratio"] > 0
    assert 0 <= r["packing"]["padding_frac_packed"] <= r["packing"]["padding_frac_padded"] < 1
    assert {"peak_ratio", "step_peak_ratio", "step_time_ratio"} <= set(r["ac"])


@pytest.mark.vllm
def test_sync_smoke():
    """The shm path: publish -> applied in a running engine, which then samples with exactly
    the published weights (checked against a Hugging Face forward pass)."""
    r = run_smoke("sync")
    assert r["sizes"][0]["size"] == "tiny" and r["ratio"] > 0
    assert r["sizes"][0]["engine_load_s"] > 0


@pytest.mark.vllm
def test_generate_smoke():
    r = run_smoke("generate")
    assert r["generator_tokens_per_s"] > 0 and r["bare_tokens_per_s"] > 0 and r["ratio"] > 0
    assert r["reward_errors"] == 0


@pytest.mark.vllm
def test_e2e_smoke(tmp_path):
    r = run_smoke("e2e", "--out", str(tmp_path), timeout=600)
    assert set(r["by_workload"]["demo"]) == {"sync", "async_s1"}
    assert r["speedup"] > 0 and r["simulator_max_rel_error"] >= 0
    assert (tmp_path / "e2e.json").exists() and (tmp_path / "e2e.png").exists()


@pytest.mark.vllm
def test_soak_smoke(tmp_path):
    r = run_smoke("soak", "--run-dir", str(tmp_path / "soak"), timeout=600)
    assert r["faults_injected"] == 1 and r["faults"]["connection_drop"] == 1
    assert r["lost"] == 0 and r["double_trained"] == 0


@pytest.mark.vllm
def test_peers_smoke(tmp_path):
    r = run_smoke("peers", "--out", str(tmp_path), "--plot", "", timeout=600)
    ours = r["by_workload"]["demo"]["trainers"]["asyncrl_async"]
    assert ours["error"] is None and ours["completions_per_s"] > 0
    assert ours["useful_tokens_per_s"] == ours["tokens_per_s"] > 0
    assert r["by_workload"]["demo"]["role"] == "engine overhead"
