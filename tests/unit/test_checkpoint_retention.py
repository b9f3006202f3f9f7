"""Checkpoint retention (control.keep_checkpoints / keep_every): a long run keeps a bounded set."""

from __future__ import annotations

import re

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.learner.checkpoint import COMPLETE_MARKER, LATEST, prune
from asyncrl.rundir import complete_checkpoints


def make(root, step: int, complete: bool = True):
    d = root / f"step_{step:06d}"
    (d / "dcp").mkdir(parents=True)
    (d / "dcp" / "shard").write_bytes(b"x" * 10)
    if complete:
        (d / COMPLETE_MARKER).write_text("ok\n")
    return d


def names(root):
    return sorted(p.name for p in root.glob("step_*"))


def test_keeps_the_newest_and_every_kth_and_what_latest_names(tmp_path):
    for step in range(10, 101, 10):
        make(tmp_path, step)
    (tmp_path / LATEST).write_text("step_000100\n")
    removed = prune(tmp_path, keep_last=3, keep_every=40)
    assert names(tmp_path) == ["step_000040", "step_000080", "step_000090", "step_000100"]
    assert sorted(p.name for p in removed) == [
        "step_000010",
        "step_000020",
        "step_000030",
        "step_000050",
        "step_000060",
        "step_000070",
    ]
    assert prune(tmp_path, keep_last=3, keep_every=40) == []  # idempotent

    # `latest` pointing at an older checkpoint (a resume from it) protects it.
    (tmp_path / LATEST).write_text("step_000040\n")
    make(tmp_path, 110)
    prune(tmp_path, keep_last=1)
    assert names(tmp_path) == ["step_000040", "step_000110"]


def test_incomplete_and_staging_directories_are_left_alone(tmp_path):
    for step in (1, 2, 3):
        make(tmp_path, step)
    make(tmp_path, 4, complete=False)  # a save interrupted (or in progress): not ours to judge
    (tmp_path / ".step_000005.tmp-abc").mkdir()
    prune(tmp_path, keep_last=1)
    assert names(tmp_path) == ["step_000003", "step_000004"]
    assert (tmp_path / ".step_000005.tmp-abc").is_dir()


def test_steps_sort_numerically_past_the_padding(tmp_path):
    make(tmp_path, 999_999)
    (tmp_path / "step_1000000").mkdir()
    (tmp_path / "step_1000000" / COMPLETE_MARKER).write_text("ok\n")
    prune(tmp_path, keep_last=1)
    assert names(tmp_path) == ["step_1000000"]


def test_config_rejects_keeping_no_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("control.keep_checkpoints=0: must be >= 1")):
        load_config(None, ["control.keep_checkpoints=0"])
    with pytest.raises(ConfigError, match=re.escape("control.keep_every=-1: must be >= 0")):
        load_config(None, ["control.keep_every=-1"])
    with pytest.raises(ValueError, match="keep_last=0"):
        prune(tmp_path, keep_last=0)


# ----------------------------------------------------------------------------- a step saved again


def save(root, step: int, extra: dict):
    """staging_dir + publish as LearnerGroup.save_checkpoint does, the ranks' shards faked."""
    from asyncrl.learner import checkpoint

    final = root / f"step_{step:06d}"
    staging = checkpoint.staging_dir(final)
    (staging / "dcp").mkdir()
    (staging / "dcp" / "shard").write_bytes(repr(extra).encode())
    return checkpoint.publish(staging, final, extra)


def test_a_resave_that_dies_before_it_is_in_place_keeps_the_previous_one(tmp_path, monkeypatch):
    """Saving a step again (the outage checkpoint after an un-acked one) must never leave that
    step without a complete checkpoint: a process that dies while the new one is moved into
    place leaves the previous one where a resume finds it, even with keep_checkpoints: 1."""
    import os

    from asyncrl.learner import checkpoint
    from asyncrl.rundir import CHECKPOINTS_DIR, latest_checkpoint, read_extra

    root = tmp_path / CHECKPOINTS_DIR
    first = save(root, 10, {"ids": ["g1"]})
    real_replace = os.replace

    def dies_moving_the_new_one(src, dst):
        if os.path.basename(src).startswith(".step_000010") and ".tmp-" in os.path.basename(src):
            raise OSError("injected: the process died here")
        return real_replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(checkpoint.os, "replace", dies_moving_the_new_one)
        with pytest.raises(OSError, match="injected"):
            save(root, 10, {"ids": ["g1", "g2"]})
    prune(root, keep_last=1)
    found = latest_checkpoint(tmp_path)
    assert found == first and read_extra(found) == {"ids": ["g1"]}
    assert checkpoint.resolve(root) == first

    # Saved again for real: a new revision, `latest` names it, the older save is gone.
    second = save(root, 10, {"ids": ["g1", "g2"]})
    assert second.name == "step_000010.r1" and checkpoint.resolve(root) == second
    assert latest_checkpoint(tmp_path) == second and read_extra(second) == {"ids": ["g1", "g2"]}
    assert names(root) == ["step_000010.r1"]
    third = save(root, 10, {"ids": ["g3"]})
    assert third.name == "step_000010.r2" and names(root) == ["step_000010.r2"]
    # Later steps sort after every revision of an earlier one; retention counts revisions as steps.
    from asyncrl.rundir import complete_checkpoint_of

    save(root, 20, {})
    assert [p.name for p in complete_checkpoints(root)] == ["step_000010.r2", "step_000020"]
    assert complete_checkpoint_of(root, 10) == third and complete_checkpoint_of(root, 30) is None
    prune(root, keep_last=1)
    assert names(root) == ["step_000020"]


def test_export_finds_a_step_saved_again(tmp_path):
    from asyncrl.control.export import checkpoint_dir
    from asyncrl.rundir import CHECKPOINTS_DIR

    root = tmp_path / CHECKPOINTS_DIR
    save(root, 10, {})
    again = save(root, 10, {"again": True})
    assert checkpoint_dir(tmp_path, step=10) == again == checkpoint_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint of step 20 "):
        checkpoint_dir(tmp_path, step=20)
