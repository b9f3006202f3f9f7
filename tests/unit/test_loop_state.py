"""A run's bookkeeping stays flat over days: 2,000 steps of the loop's real LoopState calls and
checkpoint writes keep the checkpoint's `extra` and the in-memory state the same size, while
the trained-ids audit (queue.ledger) still lists every group exactly once."""

from __future__ import annotations

import re
import sys
from dataclasses import fields

import pytest

from asyncrl.control.ledger import TRAINED_FILE, record_trained, trained_ids
from asyncrl.control.state import LoopState
from asyncrl.learner.checkpoint import prune, publish
from asyncrl.rundir import complete_checkpoints, read_extra

STEPS, GROUPS, CKPT = 2000, 16, 5


def _deep_size(state: LoopState) -> int:
    """Bytes the state holds: its fields, and every element of its lists."""
    total = sys.getsizeof(state)
    for f in fields(state):
        value = getattr(state, f.name)
        total += sys.getsizeof(value) + (sum(sys.getsizeof(x) for x in value) if isinstance(value, list) else 0)
    return total


def _ids(step: int, kind: str) -> list[str]:
    return [f"gen-0.1:{kind}{step:06d}-{i:02d}" for i in range(GROUPS)]


def test_2000_steps_keep_checkpoint_extra_and_state_flat(tmp_path):
    state = LoopState()
    root = tmp_path / "checkpoints"
    root.mkdir()
    sizes: dict[int, int] = {}
    held: dict[int, int] = {}
    for step in range(1, STEPS + 1):
        # What TrainLoop.step books per step, and TrainLoop.checkpoint per checkpoint.
        state.step, state.version = step, step
        state.trained(_ids(step, "g"), _ids(step, "e"))
        assert len(state.since_checkpoint) <= GROUPS * CKPT and len(state.unacked) <= GROUPS * CKPT
        if step % CKPT == 0:
            staging = root / f".staging-{step}"
            staging.mkdir()
            final = publish(staging, root / f"step_{step:06d}", state.to_extra())
            record_trained(tmp_path, step, state.since_checkpoint)
            assert len(state.checkpointed()) == GROUPS * CKPT
            prune(root, keep_last=2)
            sizes[step] = (final / "extra.msgpack").stat().st_size
            held[step] = _deep_size(state)

    # The extra's size moves only with the digits of its counters (a few bytes), never with
    # the number of groups trained; the old format grew by ~30 bytes a group.
    assert max(sizes.values()) - sizes[100] <= 8, (sizes[100], sizes[STEPS])
    assert sizes[STEPS] < 3000
    # Memory the state holds right after a checkpoint: the same at step 100 and 2,000 (32,000 groups).
    assert held[STEPS] == held[100], (held[100], held[STEPS])
    assert len(complete_checkpoints(root)) == 2

    # Resume: counts come back, and only the last checkpoint's own groups are to be skipped.
    extra = read_extra(complete_checkpoints(root)[-1])
    resumed = LoopState.from_extra(extra)
    assert (resumed.step, resumed.trained_count) == (STEPS, STEPS * GROUPS)
    assert resumed.skip_ids == [g for s in range(STEPS - CKPT + 1, STEPS + 1) for g in _ids(s, "g")]
    assert resumed.since_checkpoint == [] and resumed.unacked == []

    # The audit still has every trained group, once.
    audited = trained_ids(tmp_path, upto_step=STEPS)
    assert audited == [g for s in range(1, STEPS + 1) for g in _ids(s, "g")]
    assert trained_ids(tmp_path, upto_step=10) == [g for s in range(1, 11) for g in _ids(s, "g")]


def test_audit_lines_a_resume_rewrites_or_a_crash_cut_count_once(tmp_path):
    record_trained(tmp_path, 3, ["a", "b"])
    record_trained(tmp_path, 6, ["c"])  # a checkpoint whose run died before the resume...
    record_trained(tmp_path, 3, ["a", "b"])  # ...which resumed from step 3 and rewrote its line
    record_trained(tmp_path, 6, ["d"])  # the resumed run's own step 6
    assert trained_ids(tmp_path, upto_step=6) == ["a", "b", "d"]
    with open(tmp_path / TRAINED_FILE, "a") as f:
        f.write('{"step": 9, "ids": ["e"')  # cut short by a crash while being written
    assert trained_ids(tmp_path, upto_step=9) == ["a", "b", "d"]
    with open(tmp_path / TRAINED_FILE, "a") as f:
        f.write('\n{"step": 12, "ids": ["f"]}\n')
    with pytest.raises(ValueError, match=f"{TRAINED_FILE}:5: unreadable line"):
        trained_ids(tmp_path, upto_step=12)  # a bad line in the middle is corruption, not a crash
    with pytest.raises(FileNotFoundError, match=re.escape("queue.ledger=true")):
        trained_ids(tmp_path / "nowhere", upto_step=1)


def test_a_checkpoint_from_before_the_bounded_state_still_resumes():
    old = {"step": 4, "version": 4, "published_version": 4, "trained_ids": ["a", "b", "c"]}
    state = LoopState.from_extra(old)
    assert (state.step, state.trained_count, state.skip_ids) == (4, 3, ["a", "b", "c"])
