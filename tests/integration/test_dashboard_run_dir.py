"""`asyncrl dashboard RUN_DIR`: the dashboard's endpoints over a finished run's files, no Redis.
The command itself is started on a real finished run by tests/integration/test_readme_walkthrough.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from asyncrl.monitor.dashboard.app import create_run_dir_app
from asyncrl.monitor.dashboard.rundir import NotARunDir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def api(finished_run_dir):
    with TestClient(create_run_dir_app(finished_run_dir[0])) as c:
        yield c


def test_summary_is_marked_finished_with_the_run_files_facts(api, finished_run_dir):
    run_dir, reward = finished_run_dir
    s = api.get("/api/run/fin/summary").json()
    assert s["mode"] == "finished" and s["status"] == "finished" and s["run"] == "fin"
    assert s["step"] == 30 and s["policy_version"] == 30 and s["max_staleness"] == 2
    assert s["finished"]["final_step"] == 30 and s["finished"]["wall_s"] == 56.0
    assert s["finished"]["ended_at"] == 1_790_000_056.0 and s["finished"]["run_dir"] == str(run_dir)
    assert s["finished"]["has_summary"] is True and s["finished"]["bad_lines"] == 0
    assert s["finished"]["resumed_after"] == [15]  # steps 16-20 logged twice: resumed from step 15
    assert s["started_at"] == 1_790_000_000.0 and s["uptime_s"] is None
    assert s["counters"]["groups_trained"] == 240 and s["counters"]["dropped_stale"] == 4
    # summary.json omits a counter never counted: 0 on the tiles, not unknown
    assert s["counters"]["dropped_uniform"] == 0 and s["counters"]["weight_load_failures"] == 0
    assert s["latest"]["reward/mean"] == reward[30] == 1.0
    assert s["latest"]["eval/reward_mean"] == pytest.approx(0.85)
    # Step 30's NaN was written as null: the latest real value is step 29's.
    assert s["latest"]["drift/tis_ratio_max"] == pytest.approx(1.79)
    assert s["thresholds"] == {
        "rollout_kl": 0.05,
        "masked_frac": 0.2,
        "staleness_frac": 1.0,
        "logprob_diff_max": 0.5,
        "reward_failure_rate": 0.5,
    }
    assert s["config"]["control"]["eval_every"] == 5
    alerts = api.get("/api/run/fin/alerts").json()["alerts"]
    assert [a["kind"] for a in alerts] == ["rollout_kl"]
    assert api.get("/api/run/fin/generators").json()["generators"] == []


def test_series_follow_the_final_trajectory_of_a_resumed_run(api, finished_run_dir):
    _, reward = finished_run_dir
    body = api.get("/api/run/fin/series").json()
    r = body["series"]["reward/mean"]
    # Steps 16-20 were logged twice (before and after the resume): the resumed rows count.
    assert r["step"] == list(range(1, 31)) and r["value"] == [reward[s] for s in range(1, 31)]
    assert r["value"][15] == pytest.approx(16 / 40 + 0.25) and set(r["source"]) == {"trainer"}
    assert body["last_id"] == "30"
    ev = api.get("/api/run/fin/series?names=eval/*").json()["series"]
    assert set(ev) == {
        "eval/reward_mean",
        "eval/reward_std",
        "eval/response_length_mean",
        "eval/reward_errors",
        "eval/prompts",
    }
    assert ev["eval/reward_mean"]["step"] == [5, 10, 15, 20, 25, 30]
    assert ev["eval/reward_mean"]["value"][-1] == pytest.approx(0.85)
    newer = api.get("/api/run/fin/series?names=reward/mean&since=25").json()
    assert newer["series"]["reward/mean"]["step"] == [26, 27, 28, 29, 30] and newer["last_id"] == "30"
    assert api.get("/api/run/fin/series?since=30").json()["series"] == {}
    tis = api.get("/api/run/fin/series?names=drift/tis_ratio_max").json()["series"]["drift/tis_ratio_max"]
    assert tis["value"][-1] is None  # JSON has no NaN


def test_pages_listing_prometheus_and_unknown_run(api):
    assert [r["run"] for r in api.get("/api/runs").json()["runs"]] == ["fin"]
    home = api.get("/", follow_redirects=False)
    assert home.status_code == 307 and home.headers["location"] == "/run/fin"
    page = api.get("/run/fin")
    assert page.status_code == 200 and 'id="finished-banner"' in page.text
    text = api.get("/metrics").text
    assert 'asyncrl_reward_mean{run="fin"} 1' in text and 'asyncrl_groups_trained_total{run="fin"} 240' in text
    missing = api.get("/api/run/other/summary")
    assert missing.status_code == 404 and "it holds run 'fin'" in missing.json()["message"]


def test_a_killed_run_without_summary_uses_its_checkpoint(finished_run_dir):
    """No summary.json (killed before it), a torn last line: status 'ended', the policy version
    from the newest complete checkpoint's extra, counters unknown, the torn line skipped."""
    from asyncrl.learner.checkpoint import publish

    run_dir, _ = finished_run_dir
    (run_dir / "summary.json").unlink()
    for step in (10, 25):
        staging = run_dir / "checkpoints" / f".staging-{step}"
        staging.mkdir(parents=True)
        publish(staging, run_dir / "checkpoints" / f"step_{step:06d}", {"step": step, "version": step + 1})
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step":31,"time":17')  # the kill came mid-write
    with TestClient(create_run_dir_app(run_dir)) as api:
        s = api.get("/api/run/fin/summary").json()
        assert s["status"] == "ended" and s["step"] == 30 and s["policy_version"] == 26
        assert s["finished"]["has_summary"] is False and s["finished"]["checkpoint"] == "step_000025"
        assert s["finished"]["bad_lines"] == 1 and s["finished"]["wall_s"] is None
        assert set(s["counters"].values()) == {None}
        assert 0 <= s["finished"]["metrics_age_s"] < 60  # just written: it may still be running
        assert "groups_trained_total" not in api.get("/metrics").text


def test_a_dir_that_is_not_a_run_dir_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(NotARunDir, match=r"is not a run directory: it has no metrics.jsonl"):
        create_run_dir_app(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "dashboard", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 2 and f"run_dir='{tmp_path / 'nope'}': not a directory" in out.stderr, out.stderr
    # `python -m asyncrl.monitor.dashboard` is the same command: the same checks and messages.
    from asyncrl.monitor.dashboard.__main__ import main as module_main

    assert module_main([str(tmp_path), "--redis", "redis://127.0.0.1:1/0"]) == 2
    assert "give a RUN_DIR (a finished run) or --redis URL (live): both given" in capsys.readouterr().err
    assert module_main([str(tmp_path)]) == 2
    assert "is not a run directory: it has no metrics.jsonl" in capsys.readouterr().err
