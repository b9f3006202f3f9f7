"""The dashboard in a real headless Chromium: live data written during the test shows up on the page,
and a finished run's directory (`asyncrl dashboard RUN_DIR`) renders as finished.

docs/dashboard.png is a real run's page (scripts/dashboard_screenshot.py), not this test's.
"""

from __future__ import annotations

import json
import math
import time

import msgpack
import pytest
import redis

from asyncrl.monitor.dashboard.app import create_app, create_run_dir_app
from asyncrl.monitor.metrics import staleness_summary
from asyncrl.monitor.sinks import RedisSink
from asyncrl.queue import keys

pytestmark = pytest.mark.browser
RUN = "demo"


def _history_step(step: int) -> dict[str, float]:
    """A plausible trajectory: reward rising, drift small, staleness within max_staleness=2,
    an evaluation every 10 steps."""
    stale = [0] * 4 + [1] * 3 + ([2] if step % 3 == 0 else [1])
    evals = {"eval/reward_mean": 0.1 + step / 40, "eval/reward_std": 0.2, "eval/response_length_mean": 4.0}
    return {
        **(evals if step % 10 == 0 else {}),
        **staleness_summary(stale, max_staleness=2),
        "reward/mean": round(0.2 + 0.6 * (1 - math.exp(-step / 8)), 4),
        "reward/std": 0.25,
        "response/length_mean": 12.0 + (step % 5),
        "queue/depth": 6.0 + (step % 4),
        "queue/pending": 8.0,
        "queue/dropped_stale": float(step // 6),
        "queue/dead_lettered": 0.0,
        # The trainer lived through 3 outages (9 s), was resumed at step 10 and lived through one
        # (2 s) before that step: its own counts start again. Step 15's count was not a number.
        "queue/outages": math.nan if step == 15 else 3.0 if step < 10 else 1.0,
        "queue/outage_s": 9.0 if step < 10 else 2.0,
        "generators/restarts": 0.0,
        "drift/rollout_kl": 0.004 + 0.0005 * (step % 4),
        "drift/abs_logp_diff": 0.03,
        "drift/tis_ratio_mean": 1.0 + 0.01 * (step % 3),
        "drift/tis_ratio_max": 1.8 + 0.1 * (step % 3),
        "drift/tis_capped_frac": 0.01,
        "router/mismatch_frac": 0.01 * (step % 5),
        "drift/masked_frac": 0.03 + 0.005 * (step % 3),
        "drift/geo_masked_frac": 0.02,
        "drift/product_masked_frac": 0.01,
        "drift/outlier_masked_frac": 0.0,
        "policy/clip_frac": 0.08,
        "throughput/gen_tokens_per_s": 2400.0 + 40 * (step % 5),
        "throughput/train_tokens_per_s": 1500.0 + 30 * (step % 4),
        "time/wait_data": 0.3,
        "time/train": 1.2,
        "time/sync": 0.08,
        "loss/policy": -0.02,
        "loss/total": -0.02,
        "learner/version": float(step + 1),
    }


def _generator(version: int, age: float = 1.0, groups: int = 10, tps: float = 1200.0) -> bytes:
    return msgpack.packb({"version": version, "heartbeat": time.time() - age, "groups": groups, "tokens_per_s": tps})


@pytest.fixture
def live_run(redis_url):
    """Run 'demo' 20 steps in (policy version 20, max_staleness 2), two generators; and a finished run."""
    client = redis.Redis.from_url(redis_url)
    client.hset(
        keys.state(RUN),
        mapping={
            "policy_version": 20,
            "weights_version": 20,
            "max_staleness": 2,
            "groups_per_step": 8,
            "status": "running",
            "started_at": time.time() - 600,
            "config": json.dumps({"control": {"max_staleness": 2}}),
            "alert_rollout_kl": 0.05,
            "alert_masked_frac": 0.2,
            "alert_staleness_frac": 1.0,
        },
    )
    client.hset(
        keys.counters(RUN),
        mapping={
            "groups_started": 184,
            "groups_produced": 176,
            "groups_trained": 160,
            "dropped_stale": 3,
            "dead_lettered": 0,
        },
    )
    client.hset(keys.generators(RUN), mapping={"gen-0": _generator(20, groups=90), "gen-1": _generator(19, groups=86)})
    sink = RedisSink(client, RUN)
    for step in range(20):
        # The start-up parity gate is logged once, in the first step's row.
        sink.log(step, {**_history_step(step), **({"parity/gate_max_abs_diff": 0.002} if step == 0 else {})})
    client.hset(keys.state("baseline"), mapping={"policy_version": 50, "status": "finished", "max_staleness": 0})
    RedisSink(client, "baseline").log(49, {"reward/mean": 0.625})
    yield client
    client.close()


def _text(page, selector: str) -> str:
    return page.locator(selector).inner_text().strip()


def test_live_page_follows_new_metrics(chromium, serve_dashboard, live_run, redis_url, tmp_path):
    base = serve_dashboard(create_app(redis_url, run=None, stream_interval=0.25))
    page = chromium.new_page(viewport={"width": 1440, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{base}/run/{RUN}")
    page.wait_for_function("document.getElementById('stat-step').textContent === '19'", timeout=15_000)
    assert _text(page, "#stat-policy-version") == "20"
    assert _text(page, "#no-alerts") == "✓ no alerts"
    assert page.locator("#gen-table tbody tr").count() == 2

    # Now the run moves on while the page is open: step 20 with drift above the KL alert,
    # policy version 21, and a third generator joining (elastic).
    step20 = {
        **_history_step(20),
        "reward/mean": 0.875,
        "drift/rollout_kl": 0.0625,
        "throughput/gen_tokens_per_s": 12345.0,
        "learner/version": 21.0,
        "queue/dead_lettered": 2.0,
        "generators/restarts": 1.0,
        "queue/outages": 2.0,
        "queue/outage_s": 6.5,
    }
    RedisSink(live_run, RUN).log(20, step20)
    live_run.hset(keys.state(RUN), mapping={"policy_version": 21, "weights_version": 21})
    live_run.hset(keys.counters(RUN), mapping={"groups_trained": 168})
    live_run.hset(keys.generators(RUN), "gen-2", _generator(21, groups=1, tps=950.0))

    page.wait_for_function("document.getElementById('stat-step').textContent === '20'", timeout=10_000)
    assert _text(page, "#stat-reward") == "0.875"
    assert _text(page, "#stat-rollout-kl") == "0.0625"
    assert _text(page, "#stat-gen-tps") == "12,345"
    assert _text(page, "#stat-policy-version") == "21"
    assert _text(page, "#stat-trained") == "168"
    assert _text(page, "#stat-dropped") == "3"
    assert "alerting" in page.locator("#tile-rollout-kl").get_attribute("class")
    badge = page.locator('.badge.alert[data-kind="rollout_kl"]')
    assert badge.count() == 1 and "rollout KL 0.0625 > 0.05" in badge.inner_text()
    # Generators: versions and lag against the new policy version 21.
    rows = {
        r.get_attribute("data-generator"): r.locator("td").all_inner_texts()
        for r in page.locator("#gen-table tbody tr").all()
    }
    assert set(rows) == {"gen-0", "gen-1", "gen-2"}
    assert rows["gen-2"][1:4] == ["ok", "21", "0"]
    assert rows["gen-1"][2:4] == ["19", "2"]
    # The reward chart got the new point appended to the history (21 points, last 0.875).
    reward = page.evaluate("document.getElementById('chart-reward').data[0]")
    assert len(reward["y"]) == 21 and reward["y"][-1] == 0.875 and reward["x"][-1] == 20
    stale = page.evaluate("document.getElementById('chart-staleness').layout.shapes[0].y0")
    assert stale == 2  # the configured bound is drawn
    # Evaluations (every 10 steps) in their own panel, the new one included.
    ev = page.evaluate("document.getElementById('chart-eval').data[0]")
    assert ev["name"] == "eval reward mean" and ev["x"] == [0, 10, 20] and ev["y"][-1] == 0.6
    assert page.locator("#nodata-eval").is_hidden()
    router = page.evaluate("document.getElementById('chart-router').data[0]")
    assert router["name"] == "mismatch" and router["y"][:5] == pytest.approx([0, 0.01, 0.02, 0.03, 0.04])
    # A live run shows every chart, an empty one with why; only a finished run folds them.
    assert page.locator("#panel-teacher").is_visible() and page.locator("#unlogged").is_hidden()
    assert page.locator("#finished-banner").is_hidden() and _text(page, "#conn-text") == "live"
    # The KL alert is drawn on the axis of the rollout KL; mean |Δlogp| has its own (right) axis.
    drift = page.evaluate(
        "(() => { const c = document.getElementById('chart-drift'); return { data: c.data, layout: c.layout }; })()"
    )
    assert [(t["name"], t.get("yaxis")) for t in drift["data"]] == [
        ("rollout KL (k3)", "y"),
        ("mean |Δlogp| (right axis)", "y2"),
    ]
    ref = next(s for s in drift["layout"]["shapes"] if s.get("name") == "ref")
    assert ref["yref"] == "y" and ref["y0"] == 0.05
    assert drift["layout"]["yaxis"]["title"]["text"] == "rollout KL (k3)"
    assert drift["layout"]["yaxis2"]["title"]["text"] == "mean |Δlogp| (nats)"
    # The queue's pending saw-tooth is explained on the chart itself.
    assert "Acks are sent with each checkpoint" in _text(page, "#note-queue")
    # Hover help on every panel and tile.
    helps = page.evaluate("[...document.querySelectorAll('#charts h2, .tile')].map(e => e.getAttribute('title'))")
    assert len(helps) > 20 and all(h and len(h) > 20 for h in helps), helps
    # Events marked on every chart: the start (its parity gate), and at step 20 dead-lettered
    # records, a generator Ray restarted and a Redis outage the trainer lived through (4.5 s);
    # at step 10 the resumed trainer's first outage (its count fell from 3 to 1: a restart at 0),
    # and none after step 15's gap (not a number, then the same count).
    events = page.evaluate(
        "document.getElementById('chart-reward').layout.shapes"
        ".filter(s => (s.name || '').startsWith('event')).map(s => [s.name, s.x0])"
    )
    assert events == [
        ["event: start", 0],
        ["event: Redis outage +1 (2 s)", 10],
        ["event: dead-lettered +2", 20],
        ["event: generator restarted +1", 20],
        ["event: Redis outage +1 (4.5 s)", 20],
    ], events
    assert errors == []

    page.wait_for_timeout(400)  # let plotly finish its transitions before the picture
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    page.close()


def test_runs_page_lists_every_run(chromium, serve_dashboard, live_run, redis_url):
    base = serve_dashboard(create_app(redis_url, run=None))
    page = chromium.new_page()
    page.goto(base + "/")
    page.wait_for_selector('#runs-table tr[data-run="baseline"]', timeout=10_000)
    cells = page.locator('#runs-table tr[data-run="baseline"] td').all_inner_texts()
    assert cells[:5] == ["baseline", "finished", "50", "49", "0.625"]
    page.click('#runs-table a:text("demo")')
    page.wait_for_function("document.getElementById('stat-step').textContent === '19'", timeout=15_000)
    assert page.url.endswith("/run/demo")
    page.close()


def test_token_link_opens_the_page_and_its_live_requests(chromium, serve_dashboard, live_run, redis_url):
    base = serve_dashboard(create_app(redis_url, run=RUN, token="t0k-123", stream_interval=0.25))
    page = chromium.new_page()
    denied = page.goto(base + "/")
    assert denied.status == 401 and "Token required" in page.content()
    page.goto(base + "/?token=t0k-123")  # the link a user is given: cookie set, then /run/demo
    # plotly, the JSON fetches and the event stream all ride on the cookie: the live value arrives.
    page.wait_for_function("document.getElementById('stat-step').textContent === '19'", timeout=15_000)
    RedisSink(live_run, RUN).log(20, {"reward/mean": 0.5})
    page.wait_for_function("document.getElementById('stat-reward').textContent === '0.5'", timeout=10_000)
    assert page.url == f"{base}/run/{RUN}"
    page.close()


def test_finished_run_dir_renders_as_finished(chromium, serve_dashboard, finished_run_dir):
    """`asyncrl dashboard RUN_DIR`: metrics.jsonl + summary.json, no Redis; marked finished, the
    charts hold the whole (resumed) trajectory, evaluations in their panel, nothing followed."""
    run_dir, reward = finished_run_dir
    base = serve_dashboard(create_run_dir_app(run_dir))
    page = chromium.new_page(viewport={"width": 1440, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    streams: list[str] = []
    page.on("request", lambda r: streams.append(r.url) if r.url.endswith("/stream") else None)
    page.goto(base + "/")  # redirects to the run's page
    page.wait_for_function("document.getElementById('stat-step').textContent === '30'", timeout=15_000)
    assert page.url == f"{base}/run/fin"
    assert _text(page, "#conn-text") == "finished" and _text(page, "#run-status") == "finished"
    banner = _text(page, "#finished-banner")
    assert banner.startswith("Finished run: final step 30 · wall time 56.0 s · start-up 22.7 s"), banner
    assert str(run_dir) in banner
    assert page.locator("#gen-panel").is_hidden()
    assert _text(page, "#stat-policy-version") == "30" and _text(page, "#stat-trained") == "240"
    assert _text(page, "#stat-uptime") == "wall time 56.0 s"
    assert _text(page, "#stat-reward") == "1"
    # Counters the run never incremented (summary.json omits them) are 0, not unknown.
    assert _text(page, "#stat-uniform") == "0" and _text(page, "#stat-dead") == "1"
    events = page.evaluate(
        "document.getElementById('chart-reward').layout.shapes"
        ".filter(s => (s.name || '').startsWith('event')).map(s => [s.name, s.x0])"
    )
    assert events == [["event: resume", 15]]  # metrics.jsonl repeats steps 16-20: resumed after 15
    reward_trace = page.evaluate("document.getElementById('chart-reward').data[0]")
    assert reward_trace["x"] == list(range(1, 31)) and reward_trace["y"] == [reward[s] for s in range(1, 31)]
    ev = page.evaluate("document.getElementById('chart-eval').data[0]")
    assert ev["x"] == [5, 10, 15, 20, 25, 30] and ev["y"][-1] == pytest.approx(0.85)
    assert page.locator("#nodata-eval").is_hidden() and page.locator("#nodata-staleness").is_hidden()
    # What a finished run never logged (or logged only as NaN: the critic's loss) folds into one
    # line, not empty charts.
    assert page.locator("#panel-teacher").is_hidden() and page.locator("#panel-critic").is_hidden()
    unlogged = _text(page, "#unlogged")
    assert unlogged.startswith("Not logged by this run. "), unlogged
    assert "Reverse KL to the teacher: no teacher (rollout.teacher is not set)." in unlogged, unlogged
    assert "Critic (PPO value model)" in unlogged and "Evaluation" not in unlogged, unlogged
    assert page.locator("#panel-eval").is_visible() and page.locator("#panel-reward").is_visible()
    badge = page.locator('.badge.alert[data-kind="rollout_kl"]')
    assert badge.count() == 1 and "rollout KL 0.0625 > 0.05" in badge.inner_text()
    page.wait_for_timeout(1500)  # long enough for a live page to have opened its stream
    assert streams == [] and _text(page, "#conn-text") == "finished"
    assert errors == []
    page.close()
