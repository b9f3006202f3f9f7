"""The exactly-once ledger of a run: where every produced rollout group ended up.

    ledger = audit(queue, trained_ids(run_dir, upto_step=final checkpoint's step))
    ledger.check()                          # raises LedgerError naming the broken rule

Rules (docs/design/contracts.md, "Ledger"): produced = trained ∪ dropped-stale ∪ dead-lettered ∪
still queued, and each group id is trained at most once. The trained ids are those baked
into the final checkpoint's weights, so a crash between a step and its checkpoint must leave
those groups queued (un-acked) rather than lost or trained twice.

With queue.ledger on, each checkpoint appends the group ids it added to the weights to
run_dir/trained_ids.jsonl (`record_trained`) before it acks them; a resume writes its
checkpoint's line again (a crash may have come between the checkpoint and that line). The
file grows with the run, like Redis' produced set, so both exist only with queue.ledger on;
the checkpoint itself keeps only counts and the last interval's ids (LoopState).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.queue.runstate import unpack_small
from asyncrl.rundir.store import RunPath, append_durable, run_path

TRAINED_FILE = "trained_ids.jsonl"


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
    try:
        record = unpack_small(raw)
    except Exception:  # malformed by definition: no id to find is a normal outcome
        return None
    gid = record.get("group_id") if isinstance(record, dict) else None
    return gid if isinstance(gid, str) else None


def _deadletter_group_ids(queue) -> set[str]:
    ids = (entry["group_id"] or _peek_group_id(entry["d"]) for entry in queue.deadletter_entries())
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


def record_trained(run_dir: str | Path | RunPath, step: int, group_ids: list[str]) -> None:
    """Append (durably) that the checkpoint of `step` trained `group_ids` (on an object store
    the file is rewritten whole: it exists only with queue.ledger on, for tests and soaks)."""
    line = json.dumps({"step": int(step), "ids": list(group_ids)}, separators=(",", ":")) + "\n"
    append_durable(run_path(run_dir) / TRAINED_FILE, line)


def trained_ids(run_dir: str | Path | RunPath, upto_step: int) -> list[str]:
    """Every group id trained into the weights of the checkpoint of `upto_step`, oldest first.

    A step written twice (a resume rewrites its checkpoint's line) counts once, the last
    line winning; lines past `upto_step` (steps no complete checkpoint covers) are ignored.
    """
    path = run_path(run_dir) / TRAINED_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no trained-ids audit (it is written only with queue.ledger=true)")
    by_step: dict[int, list[str]] = {}
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            by_step[int(record["step"])] = [str(g) for g in record["ids"]]
        except (ValueError, KeyError, TypeError) as e:
            if n == len(lines):
                break  # a line cut short by a crash while it was being written
            raise ValueError(f"{path}:{n}: unreadable line ({e})") from e
    return [g for step in sorted(by_step) if step <= upto_step for g in by_step[step]]
