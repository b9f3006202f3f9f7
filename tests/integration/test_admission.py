"""Admission against a real redis-server: the budget in versions when a trainer step runs m
optimizer steps (mini-batches), driven the way the generators and the trainer loop drive it.

    .venv/bin/python -m pytest tests/integration/test_admission.py -q
"""

from __future__ import annotations

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
