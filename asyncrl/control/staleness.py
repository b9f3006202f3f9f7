"""Staleness accounting: which rollouts a learner may still train on.

A rollout of behavior version b, trained by a learner at policy version v, has staleness
v - b (time spent queued counts). It may be trained on only if v - b <= max_staleness.
A trainer step runs `mini_batches` optimizer steps at versions v, v+1, ..., v+m-1, so the
oldest usable behavior version for the whole step is v + m - 1 - max_staleness.
"""

from __future__ import annotations

from collections.abc import Iterable


def min_behavior_version(policy_version: int, max_staleness: int, mini_batches: int = 1) -> int:
    """Oldest behavior version a trainer step starting at `policy_version` may train on."""
    return policy_version + mini_batches - 1 - max_staleness


def admission_budget(policy_version: int, max_staleness: int, groups_per_step: int, mini_batches: int = 1) -> int:
    """Groups that may have been started in total at this version (AReaL-style admission).

    A group sampled at version v is usable by a trainer step starting at v' only if
    v' + m - 1 - max_staleness <= v (min_behavior_version). Steps start at versions 0, m,
    2m, ..., so the last step that can take it is floor((v + max_staleness + 1) / m) - 1,
    and the steps up to it take groups_per_step each: anything beyond this budget would
    arrive too stale. With m = 1 this is (v + max_staleness + 1) * groups_per_step. The
    Lua script TRY_ADMIT (asyncrl.queue.scripts) enforces the same number.
    """
    return (policy_version + max_staleness + 1) // mini_batches * groups_per_step


def staleness_values(train_version: int, behavior_versions: Iterable[int]) -> list[int]:
    return [train_version - b for b in behavior_versions]


def check_within_bound(staleness: Iterable[int], max_staleness: int) -> None:
    """Fail loudly: training on a too-stale record is a bug in the loop, never a tolerance."""
    worst = max(staleness, default=0)
    if worst > max_staleness:
        raise RuntimeError(f"staleness {worst} exceeds control.max_staleness={max_staleness}")
