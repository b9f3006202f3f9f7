"""What a (re)starting trainer does to the run's Redis, against a real redis-server: it retires
a predecessor's announced weights and closes admission, then counts every prompt that will be
re-issued without admission when it reopens the budget."""

from __future__ import annotations

from pathlib import Path

import msgpack

from asyncrl.config import load_config
from asyncrl.control.restart import restart_admission
from asyncrl.control.state import LoopState
from asyncrl.queue import RolloutQueue, RunState
from asyncrl.types import RolloutGroup, Sample, WeightsFile

ROOT = Path(__file__).resolve().parents[2]
GPS, MS = 4, 1


def _group(gid: str, version: int) -> RolloutGroup:
    import numpy as np

    s = Sample(
        response_ids=np.arange(3),
        rollout_logprobs=np.zeros(3, np.float32),
        loss_mask=np.ones(3),
        reward=0.0,
        behavior_version=version,
        stop_reason="stop",
        generator_id=gid.split(".")[0],
    )
    return RolloutGroup(group_id=gid, prompt_id=gid, prompt_ids=np.arange(2), samples=[s], env="copy", metadata={})


def _admit_until_refused(rs: RunState) -> int:
    n = 0
    while rs.try_admit():
        n += 1
    return n


def test_a_restart_counts_the_prompts_successors_reissue_and_drops_orphans(redis_url):
    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        ["control.run_name=rst", f"control.groups_per_step={GPS}", f"control.max_staleness={MS}"],
    )
    q = RolloutQueue.connect(redis_url, "rst", maxlen=64)
    rs = RunState.of(q)
    # The crashed run: two steps trained (8 groups) at v2, v3 announced, budget (2 + 1 + 1) * 4 = 16.
    rs.configure_admission(MS, GPS)
    rs.set_policy_version(2)
    rs.set_weights(WeightsFile("/dev/shm/asyncrl-rst-v3.safetensors"), 3)
    rs.reset_admission(8)
    note = msgpack.packb({"text": "abc", "metadata": {}}, use_bin_type=True)
    for i in range(5):  # gen-0 (ours: its successor re-issues what is still noted) admitted 5, put 2
        assert rs.admit_prompt("gen-0", f"gen-0.1:{i}", note, 3)
    for i in range(2):
        q.put(_group(f"gen-0.1:{i}", 3), inflight_of="gen-0")
    assert rs.admit_prompt("elastic-live", "elastic-live.1:0", note, 3)  # an elastic one still running
    rs.heartbeat("elastic-live", {"version": 3})
    for i in range(2):  # an elastic one that died: nobody will run its notes
        assert rs.admit_prompt("elastic-dead", f"elastic-dead.1:{i}", note, 3)
    assert rs.counters()["groups_started"] == 16

    # The new trainer starts: nothing may load v3 or be admitted until its prepare().
    assert rs.retire_weights() == 3
    assert rs.weights() == (None, -1) and not rs.admission_open()
    assert rs.try_admit() is False and rs.admit_prompt("elastic-live", "elastic-live.1:1", note, 3) is False
    assert rs.retire_weights() == 3  # a second restart still knows what was announced
    assert sorted(rs.inflight_generators()) == ["elastic-dead", "elastic-live", "gen-0"]

    # Its prepare(): resumed at step 2 (v2, nothing renumbered), then admission reopens.
    started = restart_admission(
        cfg, rs, LoopState(step=2, version=2, trained_count=8), queued_skips=0, max_staleness=MS
    )
    # trained 8 + in the stream 2 + gen-0's 3 notes (re-issued, never re-admitted) + elastic-live's 1
    assert started == 14
    assert rs.inflight_generators() == ["elastic-live", "gen-0"]  # the dead one's notes are gone
    rs.configure_admission(MS, GPS)
    # Left: 16 - 14 = 2, so everything alive stays within (max_staleness + 1) steps' worth (8).
    assert _admit_until_refused(rs) == 2
    alive = q.depth() + q.pending() + sum(len(rs.inflight_prompts(g)) for g in ("gen-0", "elastic-live")) + 2
    assert alive == (MS + 1) * GPS
    q.close()


def test_a_renumbered_resume_rebases_the_count_by_the_versions_it_skipped(redis_url):
    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        ["control.run_name=rsj", f"control.groups_per_step={GPS}", f"control.max_staleness={MS}"],
    )
    q = RolloutQueue.connect(redis_url, "rsj", maxlen=64)
    rs = RunState.of(q)
    rs.set_weights(WeightsFile("/dev/shm/asyncrl-rsj-v7.safetensors"), 7)
    top = rs.retire_weights()
    state = LoopState(step=3, version=3, trained_count=12)
    assert state.continue_past(top, MS) == 6 and state.version == 9
    assert restart_admission(cfg, rs, state, queued_skips=0, max_staleness=MS) == 12 + 6 * GPS
    rs.configure_admission(MS, GPS)
    rs.set_policy_version(state.version)
    # The same headroom as a run that never stopped: (max_staleness + 1) steps' worth.
    assert _admit_until_refused(rs) == (MS + 1) * GPS
    q.close()
