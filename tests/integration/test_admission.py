"""Admission against a real redis-server: the budget in versions when a trainer step runs m
optimizer steps (mini-batches), driven the way the generators and the trainer loop drive it.

    .venv/bin/python -m pytest tests/integration/test_admission.py -q
"""

from __future__ import annotations

import msgpack
import pytest

from asyncrl.control.staleness import admission_budget, min_behavior_version
from asyncrl.queue import RolloutQueue, RunState
from asyncrl.types import RolloutGroup, Sample


def _group(group_id: str, version: int) -> RolloutGroup:
    return RolloutGroup(group_id, group_id, [1, 2], [Sample([3, 4], [-0.5, -0.25], [1, 1], 1.0, version)])


@pytest.mark.parametrize("m", [1, 2, 3])
def test_the_lua_budget_is_admission_budget(redis_url, m):
    q = RolloutQueue.connect(redis_url, f"budget{m}")
    rs = RunState.of(q)
    for staleness in range(0, 5):
        rs.configure_admission(max_staleness=staleness, groups_per_step=4, mini_batches_per_step=m)
        for version in range(0, 9):
            rs.set_policy_version(version)
            budget = admission_budget(version, staleness, 4, m)
            rs.reset_admission(0)
            assert (budget == 0 or rs.try_admit(budget)) and not rs.try_admit(1), (staleness, version, budget)
    with pytest.raises(ValueError, match="mini_batches_per_step"):
        rs.configure_admission(max_staleness=1, groups_per_step=4, mini_batches_per_step=0)
    q.close()


@pytest.mark.parametrize(("m", "bound"), [(1, 1), (2, 1), (2, 2), (2, 3), (4, 5)])
def test_a_generator_faster_than_the_learner_never_makes_stale_groups(redis_url, m, bound):
    """The worst case for admission: a generator that fills whatever budget it is given before
    every trainer step. Each step takes groups_per_step groups no older than the loop's
    min_behavior_version and raises the version by m. Nothing may be dropped as stale, the
    backlog stays bounded, and the trainer is never short of a full step."""
    gps, steps, run = 8, 12, f"fast{m}{bound}"
    q = RolloutQueue.connect(redis_url, run, maxlen=10_000)
    rs = RunState.of(q)
    rs.configure_admission(max_staleness=bound, groups_per_step=gps, mini_batches_per_step=m)
    version, made, seen = 0, 0, {}
    for step in range(steps):
        # The generator: admit and put until refused, sampling with the announced weights.
        while rs.admit_prompt("gen-0", f"p{made}", b"note", weights_version=version):
            q.put(_group(f"g{made:04d}", version), inflight_of="gen-0")
            made += 1
        assert q.depth() >= gps, f"step {step}: the trainer would wait for data the budget refused"
        # The trainer loop's step: collect, give dropped groups' admission back, train, ack.
        items = q.get_batch(gps, min_behavior_version(version, bound, m), timeout=1.0)
        counters = rs.counters()
        lost = counters.get("dropped_stale", 0) - seen.get("dropped_stale", 0)
        if lost:
            rs.release_admission(lost)
        seen = counters
        assert len(items) == gps
        for j in range(m):  # mini-batch j trains at version + j on gps / m of the groups
            for _, g in items[j * gps // m : (j + 1) * gps // m]:
                assert version + j - g.behavior_version <= bound
        q.ack([entry for entry, _ in items])
        version += m
        rs.set_policy_version(version)
        backlog = rs.counters()["groups_started"] - (step + 1) * gps
        assert backlog <= admission_budget(0, bound, gps, m), f"step {step}: backlog {backlog} keeps growing"
    counters = rs.counters()
    assert counters.get("dropped_stale", 0) == 0, f"{counters['dropped_stale']} of {made} groups dropped as stale"
    assert counters["groups_produced"] <= steps * gps + admission_budget(0, bound, gps, m)
    q.close()


def _note(text: str, metadata: dict) -> bytes:
    return msgpack.packb({"text": text, "metadata": metadata}, use_bin_type=True)


def test_the_prompt_of_a_stale_group_is_reissued_a_bounded_number_of_times(redis_url):
    """The consumer that drops a group as stale pushes its prompt (the in-flight note its put
    carried) back under a new id; a generator pops it before drawing a new prompt. After
    queue.stale_reissues tries it is given up; every outcome is counted, with the response
    lengths of dropped against trained groups."""
    q = RolloutQueue.connect(redis_url, "reissue", stale_reissues=2)
    rs = RunState.of(q)
    rs.configure_admission(max_staleness=0, groups_per_step=100)
    meta = {"target": "abc"}

    def produce(prompt_id: str, text: str, metadata: dict, version: int, n_tokens: int) -> None:
        assert rs.admit_prompt("gen-0", prompt_id, _note(text, metadata), weights_version=version)
        sample = Sample(list(range(n_tokens)), [-0.5] * n_tokens, [1] * n_tokens, 1.0, version)
        q.put(RolloutGroup(prompt_id, prompt_id, [1, 2], [sample, sample]), inflight_of="gen-0")

    produce("p0", "abc=", meta, version=0, n_tokens=8)  # slow: will be stale
    q.put(_group("no-note", 0))  # a producer that put no note: cannot be re-issued
    rs.set_policy_version(1)
    produce("p1", "xyz=", meta, version=1, n_tokens=2)  # fresh
    got = q.get_batch(3, min_version=1, timeout=1.0)
    assert [g.group_id for _, g in got] == ["p1"]
    assert q.dropped_ids() == {"p0", "no-note"}
    again = rs.pop_reissued()
    assert (again.prompt_id, again.text) == ("p0/stale1", "abc=")
    assert again.metadata == {"target": "abc", "stale_reissues": 1, "reissue_of": "p0"}
    assert rs.pop_reissued() is None  # handed to one generator only
    # Dropped again (still slow), then once more: the second re-issue is the last.
    produce(again.prompt_id, again.text, again.metadata, version=1, n_tokens=8)
    rs.set_policy_version(2)
    assert q.get_batch(1, min_version=2, timeout=0.2) == []
    again = rs.pop_reissued()
    assert again.prompt_id == "p0/stale2" and again.metadata["stale_reissues"] == 2
    produce(again.prompt_id, again.text, again.metadata, version=2, n_tokens=8)
    assert q.get_batch(1, min_version=3, timeout=0.2) == []
    assert rs.pop_reissued() is None
    counters = rs.counters()
    assert (counters["dropped_stale"], counters["stale_reissued"], counters["stale_abandoned"]) == (4, 2, 2)
    # Mean response length of the dropped samples: p0 three times (8 tokens), no-note (2).
    assert counters["dropped_response_tokens"] / counters["dropped_samples"] == (3 * 2 * 8 + 1 * 2) / 7
    assert rs.inflight_prompts("gen-0") == {}
    q.close()
