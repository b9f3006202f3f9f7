"""Dashboard JSON/HTML/Prometheus endpoints against a real redis-server filled with synthetic runs."""

from __future__ import annotations

import json
import socket
import time

import msgpack
import pytest
import redis
from starlette.testclient import TestClient

from asyncrl.monitor.dashboard.app import create_app, serve
from asyncrl.monitor.sinks import RedisSink
from asyncrl.queue import keys

RUN = "demo"


def _step_metrics(step: int) -> dict[str, float]:
    return {
        "reward/mean": 0.1 * step,
        "response/length_mean": 10.0 + step,
        "staleness/mean": 0.5,
        "staleness/max": 1.0,
        "staleness/p50": 0.5,
        "staleness/p90": 1.0,
        "staleness/frac_0": 0.5,
        "staleness/frac_1": 0.5,
        "staleness/frac_2": 0.0,
        "queue/depth": 4.0 + step,
        "queue/dropped_stale": float(step),
        "queue/dead_lettered": 1.0,
        "drift/rollout_kl": 0.001 * step,
        "drift/abs_logp_diff": 0.01,
        "drift/tis_ratio_mean": 1.01,
        "drift/tis_ratio_max": 1.9,
        "drift/masked_frac": 0.02,
        "policy/clip_frac": 0.1,
        "throughput/gen_tokens_per_s": 1200.0,
        "throughput/train_tokens_per_s": 800.0,
        "time/wait_data": 0.2,
        "time/train": 1.5,
        "time/sync": 0.05,
        "learner/version": float(step + 1),
    }


@pytest.fixture
def filled(redis_url):
    """Run 'demo' at policy version 10 (max_staleness 2) with 10 steps, 3 generators; a second run 'other'."""
    client = redis.Redis.from_url(redis_url)
    now = time.time()
    client.hset(
        keys.state(RUN),
        mapping={
            "policy_version": 10,
            "weights_version": 10,
            "max_staleness": 2,
            "groups_per_step": 8,
            "status": "running",
            "started_at": now - 120,
            "config": json.dumps({"control": {"max_staleness": 2}}),
            "alert_rollout_kl": 0.005,
            "alert_masked_frac": 0.2,
            "alert_staleness_frac": 1.0,
        },
    )
    client.hset(
        keys.counters(RUN),
        mapping={
            "groups_started": 96,
            "groups_produced": 90,
            "groups_trained": 80,
            "dropped_stale": 3,
            "dead_lettered": 1,
        },
    )
    client.hset(
        keys.generators(RUN),
        mapping={
            "gen-0": msgpack.packb({"version": 10, "heartbeat": now - 1, "groups": 40, "tokens_per_s": 700.5}),
            "gen-1": msgpack.packb({"version": 7, "heartbeat": now - 2, "groups": 30, "tokens_per_s": 500.0}),
            "gen-2": msgpack.packb({"version": 9, "heartbeat": now - 90, "groups": 20, "tokens_per_s": 0.0}),
        },
    )
    sink = RedisSink(client, RUN)
    for step in range(10):
        sink.log(step, _step_metrics(step))
    RedisSink(client, RUN, source="gen-0").log(9, {"throughput/gen_tokens_per_s": 700.5})
    client.hset(keys.state("other"), mapping={"policy_version": 3, "status": "finished", "max_staleness": 1})
    RedisSink(client, "other").log(3, {"reward/mean": 0.75})
    yield client
    client.close()


@pytest.fixture
def api(redis_url, filled):
    with TestClient(create_app(redis_url, run=None, stream_interval=0.05)) as c:
        yield c


def test_runs_listing(api):
    runs = {r["run"]: r for r in api.get("/api/runs").json()["runs"]}
    assert set(runs) == {"demo", "other"}
    assert runs["demo"]["policy_version"] == 10 and runs["demo"]["step"] == 9 and runs["demo"]["generators"] == 3
    assert runs["demo"]["reward_mean"] == pytest.approx(0.9)
    assert runs["other"]["status"] == "finished" and runs["other"]["reward_mean"] == 0.75
    page = api.get("/")
    assert page.status_code == 200 and 'id="runs-table"' in page.text


def test_summary_has_state_counters_and_latest(api):
    s = api.get(f"/api/run/{RUN}/summary").json()
    assert s["policy_version"] == 10 and s["weights_version"] == 10 and s["max_staleness"] == 2
    assert s["status"] == "running" and s["step"] == 9 and s["groups_per_step"] == 8
    assert s["mode"] == "live" and "finished" not in s  # the page follows the stream
    assert 119 < s["uptime_s"] < 200
    assert s["counters"] == {
        "groups_started": 96,
        "groups_produced": 90,
        "groups_trained": 80,
        "dropped_stale": 3,
        "dead_lettered": 1,
        "dropped_uniform": 0,
        "weight_load_failures": 0,
        "generator_restarts": 0,  # every run counter is reported, 0 until counted
    }
    assert s["latest"]["reward/mean"] == pytest.approx(0.9)
    assert s["latest"]["queue/depth"] == 13.0
    assert s["latest"]["drift/rollout_kl"] == pytest.approx(0.009)
    # The trainer's aggregate wins over a generator's own, newer, entry for the same name.
    assert s["latest"]["throughput/gen_tokens_per_s"] == 1200.0
    assert s["thresholds"] == {
        "rollout_kl": 0.005,
        "masked_frac": 0.2,
        "staleness_frac": 1.0,
        "logprob_diff_max": 0.5,
        "reward_failure_rate": 0.5,
    }
    assert s["config"] == {"control": {"max_staleness": 2}}


def test_generators_show_version_lag_and_liveness(api):
    body = api.get(f"/api/run/{RUN}/generators").json()
    gens = {g["id"]: g for g in body["generators"]}
    assert (gens["gen-0"]["version"], gens["gen-0"]["lag"], gens["gen-0"]["status"]) == (10, 0, "ok")
    assert (gens["gen-1"]["lag"], gens["gen-1"]["status"]) == (3, "lagging")
    assert gens["gen-2"]["status"] == "gone" and gens["gen-2"]["heartbeat_age_s"] > 89
    assert gens["gen-0"]["tokens_per_s"] == 700.5 and gens["gen-0"]["groups"] == 40


def test_alerts(api):
    body = api.get(f"/api/run/{RUN}/alerts").json()
    kinds = {(a["kind"], a["subject"]) for a in body["alerts"]}
    # rollout KL 0.009 > 0.005; staleness max 1 < 2; masked 0.02 < 0.2; gen-1 lags 3 > 2; gen-2 silent 90 s.
    assert kinds == {("rollout_kl", ""), ("generator_lag", "gen-1"), ("generator_heartbeat", "gen-2")}


def test_a_failed_parity_gate_and_unloadable_weights_are_alerts_read_as_untrusted(redis_url):
    """What the trainer keeps in the state hash: the gate's record (JSON) and why no generator
    can load the weights. A record that is not one (bad JSON, wrong types) is no alert."""
    client = redis.Redis.from_url(redis_url)
    gate = {"passed": False, "max_abs_diff": 0.39, "tolerance": 1e-3, "version": 0, "mode": "stop"}
    client.hset(
        keys.state("gated"),
        mapping={"policy_version": 1, "parity_gate": json.dumps(gate), "weights_unloadable": "no generator can load"},
    )
    client.hset(keys.state("junk"), mapping={"policy_version": 1, "parity_gate": "{not json"})
    client.hset(keys.state("typed"), mapping={"parity_gate": json.dumps({**gate, "max_abs_diff": "big"})})
    client.hset(keys.state("deep"), mapping={"parity_gate": '{"a":' * 5000 + "1" + "}" * 5000})
    client.hset(keys.state("huge"), mapping={"parity_gate": json.dumps({**gate, "tolerance": 10**400})})
    client.hincrby(keys.counters("gated"), "weight_load_failures", 3)
    client.sadd(keys.RUNS, "gated", "junk", "typed", "deep", "huge")
    with TestClient(create_app(redis_url, run=None)) as c:
        alerts = c.get("/api/run/gated/alerts").json()["alerts"]
        summary = c.get("/api/run/gated/summary").json()
        junk = [c.get(f"/api/run/{run}/alerts").json()["alerts"] for run in ("junk", "typed", "deep", "huge")]
        assert all(c.get(f"/api/run/{run}/summary").status_code == 200 for run in ("deep", "huge"))
    client.close()
    assert [a["kind"] for a in alerts] == ["parity_gate", "weights_unloadable"]
    assert alerts[0]["value"] == 0.39 and "stopped before any update" in alerts[0]["message"]
    assert summary["parity_gate"] == gate and summary["counters"]["weight_load_failures"] == 3
    assert junk == [[], [], [], []]


@pytest.mark.parametrize(("timeout_s", "status"), [(60, "ok"), (10, "gone")])
def test_a_generator_is_gone_after_the_runs_own_heartbeat_timeout(redis_url, timeout_s, status):
    """The dashboard judges heartbeats by the run's rollout.heartbeat_timeout_s (from the config
    in its state), the silence after which the trainer's watchdog kills a generator: 20 s of
    silence is a pause under the 60 s default, and a dead generator under 10 s."""
    client = redis.Redis.from_url(redis_url)
    config = {"control": {"max_staleness": 2}, "rollout": {"heartbeat_timeout_s": timeout_s}}
    client.hset(keys.state("hb"), mapping={"policy_version": 5, "max_staleness": 2, "config": json.dumps(config)})
    client.hset(keys.generators("hb"), "gen-0", msgpack.packb({"version": 5, "heartbeat": time.time() - 20}))
    client.sadd(keys.RUNS, "hb")
    with TestClient(create_app(redis_url, run=None)) as c:
        (gen,) = c.get("/api/run/hb/generators").json()["generators"]
        alerts = {a["kind"] for a in c.get("/api/run/hb/alerts").json()["alerts"]}
    client.close()
    assert gen["status"] == status and 19 < gen["heartbeat_age_s"] < 60
    assert ("generator_heartbeat" in alerts) == (status == "gone")


def test_series_values_names_and_since(api, filled):
    body = api.get(f"/api/run/{RUN}/series", params={"names": "reward/mean,staleness/frac_*"}).json()
    assert set(body["series"]) == {"reward/mean", "staleness/frac_0", "staleness/frac_1", "staleness/frac_2"}
    reward = body["series"]["reward/mean"]
    assert reward["step"] == list(range(10))
    assert reward["value"] == pytest.approx([0.1 * s for s in range(10)])
    assert set(reward["source"]) == {"trainer"}
    gen = api.get(f"/api/run/{RUN}/series", params={"names": "throughput/gen_tokens_per_s"}).json()
    assert gen["series"]["throughput/gen_tokens_per_s"]["source"][-1] == "gen-0"
    # Nothing new after the last id; then exactly the one new step.
    last = body["last_id"]
    assert api.get(f"/api/run/{RUN}/series", params={"since": last}).json()["series"] == {}
    RedisSink(filled, RUN).log(10, {"reward/mean": 0.95})
    new = api.get(f"/api/run/{RUN}/series", params={"since": last}).json()
    assert new["series"] == {
        "reward/mean": {
            "step": [10],
            "time": new["series"]["reward/mean"]["time"],
            "value": [0.95],
            "source": ["trainer"],
        }
    }
    bad = api.get(f"/api/run/{RUN}/series", params={"since": "yesterday"})
    assert bad.status_code == 400 and "stream id" in bad.json()["message"]


def test_generator_restarts_and_redis_outages_come_back_as_series_the_page_marks(api, filled):
    """The page marks a rise of generators/restarts or queue/outages (with the outage's seconds)
    on every chart (app.js runEvents, checked in the browser by tests/browser): the API hands
    back those series, and the restarts counter in the summary."""
    filled.hincrby(keys.counters(RUN), "generator_restarts", 1)
    quiet = {"generators/restarts": 0.0, "queue/outages": 0.0, "queue/outage_s": 0.0}
    RedisSink(filled, RUN).log(10, quiet)
    RedisSink(filled, RUN).log(11, {"generators/restarts": 1.0, "queue/outages": 1.0, "queue/outage_s": 4.5})
    names = "generators/restarts,queue/outage*"
    series = api.get(f"/api/run/{RUN}/series", params={"names": names}).json()["series"]
    assert set(series) == {"generators/restarts", "queue/outages", "queue/outage_s"}
    assert series["generators/restarts"]["step"] == [10, 11] and series["generators/restarts"]["value"] == [0.0, 1.0]
    assert series["queue/outage_s"]["value"] == [0.0, 4.5]
    assert api.get(f"/api/run/{RUN}/summary").json()["counters"]["generator_restarts"] == 1


def test_stream_sends_new_points_live(api, filled):
    last = api.get(f"/api/run/{RUN}/series").json()["last_id"]
    events = []
    with api.stream("GET", f"/api/run/{RUN}/stream", params={"since": last}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 1:
                assert events[0]["series"] == {}  # nothing after `since` yet
                assert events[0]["summary"]["policy_version"] == 10
                RedisSink(filled, RUN).log(10, {"reward/mean": 0.97, "staleness/mean": 2.0, "staleness/max": 2.0})
            elif events[-1]["series"]:
                break
    latest = events[-1]
    assert latest["series"]["reward/mean"]["value"] == [0.97]
    assert latest["summary"]["step"] == 10 and latest["summary"]["latest"]["reward/mean"] == 0.97
    assert "staleness" in {a["kind"] for a in latest["alerts"]}  # staleness/mean 2 >= 1.0 * 2


def test_prometheus_metrics(api):
    text = api.get("/metrics").text
    lines = set(text.splitlines())
    assert 'asyncrl_reward_mean{run="demo"} 0.9' in lines
    assert 'asyncrl_queue_depth{run="demo"} 13' in lines
    assert 'asyncrl_staleness_frac_1{run="demo"} 0.5' in lines
    assert 'asyncrl_reward_mean{run="other"} 0.75' in lines
    assert 'asyncrl_policy_version{run="demo"} 10' in lines
    assert 'asyncrl_groups_trained_total{run="demo"} 80' in lines
    assert 'asyncrl_generator_version{run="demo",generator="gen-1"} 7' in lines
    assert 'asyncrl_generator_lag{run="demo",generator="gen-1"} 3' in lines
    assert 'asyncrl_generator_up{run="demo",generator="gen-2"} 0' in lines
    assert "# TYPE asyncrl_groups_trained_total counter" in lines
    assert text.count("# TYPE asyncrl_reward_mean gauge") == 1  # one family, two runs


def test_unknown_run_is_404_with_message(api):
    r = api.get("/api/run/nope/summary")
    assert r.status_code == 404
    assert r.json() == {
        "error": "Unknown run",
        "message": "run 'nope' not found in this Redis (known runs: demo, other)",
    }
    page = api.get("/run/nope")
    assert page.status_code == 404 and "text/html" in page.headers["content-type"]
    assert "run &#x27;nope&#x27; not found" in page.text and "Traceback" not in page.text
    assert api.get("/api/run/nope/stream").status_code == 404


def _dead_url() -> str:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def test_unreachable_redis_is_503_with_message():
    url = _dead_url()
    with TestClient(create_app(url, run=None)) as c:
        r = c.get(f"/api/run/{RUN}/summary")
        assert r.status_code == 503
        assert r.json()["error"] == "Redis unreachable" and url in r.json()["message"]
        page = c.get("/")
        assert page.status_code == 503 and "Redis unreachable" in page.text and "Traceback" not in page.text
        assert c.get("/metrics").status_code == 503


def test_token_required_and_wrong_token_refused(redis_url, filled):
    with TestClient(create_app(redis_url, run=RUN, token="s3cret")) as c:
        assert c.get("/api/runs").status_code == 401
        assert c.get("/metrics").status_code == 401
        assert c.get("/static/app.js").status_code == 401
        assert c.get("/api/runs", params={"token": "guess"}).status_code == 403
        assert c.get("/api/runs", headers={"Authorization": "Bearer guess"}).status_code == 403
        assert c.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        first = c.get("/", params={"token": "s3cret"}, follow_redirects=False)
        assert first.status_code == 307 and first.headers["location"] == f"/run/{RUN}"
        assert "asyncrl_dashboard_token=s3cret" in first.headers["set-cookie"]
        # The cookie from the first visit now authorises the page's own requests.
        assert c.get(f"/api/run/{RUN}/summary").json()["policy_version"] == 10
        c.cookies.clear()
        assert c.get(f"/api/run/{RUN}/summary").status_code == 401


def test_non_loopback_bind_needs_a_token(redis_url):
    with pytest.raises(ValueError, match="set a token"):
        serve(redis_url, host="0.0.0.0", port=1)
    with pytest.raises(ValueError, match="must start with redis://"):
        create_app("http://127.0.0.1:6379", run=None)
