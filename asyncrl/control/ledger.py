"""The exactly-once ledger of a run: where every produced rollout group ended up.

    ledger = audit(queue, trained_ids)      # queue connected with ledger=True
    ledger.check()                          # raises LedgerError naming the broken rule

Rules (docs/design.md, "Ledger"): produced = trained ∪ dropped-stale ∪ dead-lettered ∪
still queued, and each group id is trained at most once. `trained_ids` is the list a
checkpoint stores (the groups baked into its weights), so a crash between a step and its
checkpoint must leave those groups queued (un-acked) rather than lost or trained twice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


class LedgerError(AssertionError):
    """A group was lost, invented, or trained twice."""


@dataclass
class Ledger:
    produced: set[str]
    trained: list[str]
    dropped: set[str]
    dead_lettered: set[str]
    queued: set[str]
    problems: list[str] = field(default_factory=list)

    @property
    def summary(self) -> dict[str, int]:
        return {
            "produced": len(self.produced),
            "trained": len(self.trained),
            "dropped_stale": len(self.dropped),
            "dead_lettered": len(self.dead_lettered),
            "queued": len(self.queued),
            "double_trained": sum(c - 1 for c in Counter(self.trained).values() if c > 1),
            "lost": len(self.produced - set(self.trained) - self.dropped - self.dead_lettered - self.queued),
        }

    def check(self) -> Ledger:
        twice = sorted(g for g, c in Counter(self.trained).items() if c > 1)
        accounted = set(self.trained) | self.dropped | self.dead_lettered | self.queued
        lost = sorted(self.produced - accounted)
        invented = sorted((set(self.trained) | self.dropped | self.queued) - self.produced)
        if twice:
            self.problems.append(f"{len(twice)} groups trained more than once, e.g. {twice[:5]}")
        if lost:
            self.problems.append(f"{len(lost)} produced groups are nowhere (lost), e.g. {lost[:5]}")
        if invented:
            self.problems.append(f"{len(invented)} groups accounted for but never produced, e.g. {invented[:5]}")
        both = set(self.trained) & self.dropped
        if both:
            self.problems.append(f"{len(both)} groups both trained and dropped as stale, e.g. {sorted(both)[:5]}")
        if self.problems:
            raise LedgerError("; ".join(self.problems) + f" (ledger: {self.summary})")
        return self


def _peek_group_id(raw: bytes) -> str | None:
    """The group id of a malformed record, if its top level is still a readable map."""
    from asyncrl.queue.runstate import unpack_small

    try:
        record = unpack_small(raw)
    except Exception:  # malformed by definition: no id to find is a normal outcome
        return None
    gid = record.get("group_id") if isinstance(record, dict) else None
    return gid if isinstance(gid, str) else None


def _deadletter_group_ids(queue) -> set[str]:
    ids = (_peek_group_id(entry["d"]) for entry in queue.deadletter_entries())
    return {g for g in ids if g is not None}


def audit(queue, trained_ids: list[str]) -> Ledger:
    """Build the ledger of `queue`'s run from Redis plus the trained ids of the final weights."""
    return Ledger(
        produced=queue.produced_ids(),
        trained=list(trained_ids),
        dropped=queue.dropped_ids(),
        dead_lettered=_deadletter_group_ids(queue),
        queued={g.group_id for g in queue.queued_groups()},
    )
