"""Prompts whose group was dropped as stale, run again (a bounded number of times).

    q = RolloutQueue.connect(url, run, stale_reissues=2)   # the trainer: drops push re-issues
    prompt = RunState.of(q).pop_reissued()                  # a generator, before drawing a new prompt

A group is dropped as stale when it took longer than the staleness bound allows, which is
mostly the slow ones: long answers, hard prompts. Never running them again would bias
training against exactly those prompts. Each stream entry a generator puts carries its
prompt's in-flight note (text and metadata, the note a successor re-issues after a crash:
asyncrl.rollout.recovery), so the consumer that drops the group can hand the same prompt
back: it pushes the note, under a new prompt id, onto the run's re-issue list, in the same
transaction as the drop. Generators take from that list before drawing a new prompt and
admit it like any other (the dropped group's admission was given back). The metadata
counts the re-issues (``stale_reissues``) and names the original prompt (``reissue_of``);
past ``stale_reissues`` tries the prompt is given up (counted ``stale_abandoned``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgpack

from asyncrl.data.images import ImageLimits
from asyncrl.queue.records import unpack_note
from asyncrl.types import RolloutGroup

log = logging.getLogger("asyncrl.queue")

REISSUES_KEY = "stale_reissues"
"""Metadata key: how many times this prompt has been re-issued after a stale drop."""
ORIGIN_KEY = "reissue_of"
"""Metadata key: the prompt id the first, dropped group had."""


@dataclass(frozen=True)
class ReissuedPrompt:
    """A dropped group's prompt, to be admitted and rolled out again."""

    prompt_id: str
    text: str
    metadata: dict[str, Any]


@dataclass
class StaleDrops:
    """What one batch of stale drops adds to the run: re-issue records and counters."""

    max_reissues: int
    records: list[bytes] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, group: RolloutGroup, note: dict[str, Any] | None) -> None:
        """One dropped group and its prompt's in-flight note (None when its producer put
        none: it cannot be re-issued)."""
        self._count("dropped_samples", len(group.samples))
        self._count("dropped_response_tokens", sum(len(s.response_ids) for s in group.samples))
        reissue = None if note is None else reissue_of(group.prompt_id, note, self.max_reissues)
        if reissue is None:
            self._count("stale_abandoned", 1)
            return
        self.records.append(
            msgpack.packb(
                {"prompt_id": reissue.prompt_id, "text": reissue.text, "metadata": reissue.metadata}, use_bin_type=True
            )
        )
        self._count("stale_reissued", 1)

    def _count(self, name: str, n: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


def reissue_of(prompt_id: str, note: dict[str, Any], max_reissues: int) -> ReissuedPrompt | None:
    """The prompt to run again for a group dropped as stale, or None past `max_reissues`
    (or for a note that is not {"text": str, "metadata": dict})."""
    text, metadata = note.get("text"), note.get("metadata")
    if not isinstance(text, str) or not isinstance(metadata, dict):
        return None
    done = metadata.get(REISSUES_KEY, 0)
    if not isinstance(done, int) or isinstance(done, bool) or done >= max_reissues:
        return None
    origin = metadata.get(ORIGIN_KEY, prompt_id)
    if not isinstance(origin, str):
        return None
    # A new id: the group id is the prompt id, and the dropped group's id is already taken
    # (the dropped set, the ledger); it also gives the requests new sampling seeds.
    return ReissuedPrompt(f"{origin}/stale{done + 1}", text, {**metadata, REISSUES_KEY: done + 1, ORIGIN_KEY: origin})


def parse_reissued(record: Any) -> ReissuedPrompt | None:
    """A decoded re-issue list entry, or None when it has the wrong shape."""
    if not isinstance(record, dict):
        return None
    prompt_id, text, metadata = record.get("prompt_id"), record.get("text"), record.get("metadata")
    if not (isinstance(prompt_id, str) and isinstance(text, str) and isinstance(metadata, dict)):
        return None
    return ReissuedPrompt(prompt_id, text, metadata)


def note_of(entry_id: str, raw: bytes | None, limits: ImageLimits | None = None) -> dict[str, Any] | None:
    """The prompt's in-flight note a stream entry carries (its images within ``limits``, the
    run's rollout.images); None if absent or unreadable."""
    if raw is None:
        return None
    try:
        note = unpack_note(raw, limits)
    except Exception as e:  # a bad note costs the re-issue, never the drop
        log.warning("rollout entry %s: unreadable prompt note (%s); not re-issued", entry_id, e)
        return None
    return note if isinstance(note, dict) else None
