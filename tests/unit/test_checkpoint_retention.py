"""Checkpoint retention (control.keep_checkpoints / keep_every): a long run keeps a bounded set."""

from __future__ import annotations

import re

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.learner.checkpoint import COMPLETE_MARKER, LATEST, prune


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
