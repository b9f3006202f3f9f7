"""Checkpoints: torch.distributed.checkpoint (DCP) for the sharded model and optimizer, msgpack
for everything else, published atomically.

    root/
      step_000010/            a complete checkpoint (renamed into place only when finished)
        dcp/                  DCP shards of {"model": ..., "optim": ...}, written by every rank
        rank_00000.msgpack    per rank: step, policy version, lr-scheduler state, RNG states
        extra.msgpack         the caller's dict (e.g. the queue ids the checkpoint covers)
        .complete             marker; readers ignore directories without it
      latest                  text file naming the newest complete checkpoint directory

`prune(root, keep_last, keep_every)` deletes complete checkpoints beyond the newest
`keep_last` (those at a multiple of `keep_every` stay), never the one `latest` names.

Ranks write into a staging directory (`.step_000010.tmp-<id>`); the driver, once every rank
returned, writes extra + marker and renames staging -> final, then rewrites `latest` via
os.replace. A crash at any point leaves either the previous checkpoint or the new one,
never a half-written directory under the final name. DCP reshards on load, so the model
and optimizer can be restored at another world size; RNG states are per rank.

On an object store (`root` an fsspec URL, asyncrl.rundir.store) there is no rename: the ranks
write straight under the final name (DCP through its fsspec writer), and the marker, written
last, is what makes it a checkpoint; readers ignore a prefix without one. `latest` is one PUT
(atomic).

A step that already has a complete checkpoint (the outage checkpoint after an un-acked one,
saved again at the same step) is never overwritten: the new save goes to a new revision
beside it, ``step_000010.r1`` (on disk staged and renamed there, on an object store written
there), and only once it is complete and `latest` names it is the older save deleted. A crash
at any point leaves the older save complete; readers take the newest complete revision of a
step (asyncrl.rundir.complete_checkpoints orders by step, then revision).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import msgpack
import numpy as np
import torch

from asyncrl.rundir import (
    COMPLETE_MARKER,
    EXTRA_FILE,
    LATEST,
    REVISION_SEP,
    checkpoint_name,
    complete_checkpoints,
    revision_of,
    step_of,
)
from asyncrl.rundir.store import ObjectPath, RunPath, remove_tree, run_path, write_atomic

log = logging.getLogger(__name__)

STAGING_TAG = ".tmp-"
"""Staging directories are ``.<name>.tmp-<id>``: hidden from the ``step_*`` readers glob for."""


def rank_file(directory: str | Path | RunPath, rank: int) -> RunPath:
    return run_path(directory) / f"rank_{rank:05d}.msgpack"


def dcp_storage(directory: RunPath, *, reader: bool) -> dict[str, Any]:
    """dcp.save/load arguments for `directory`/dcp: a local path as before; on an object store
    torch's fsspec reader/writer, opened with the run's storage options (a bare checkpoint_id
    would reopen the URL without them)."""
    target = directory / "dcp"
    if not isinstance(target, ObjectPath):
        return {"checkpoint_id": str(target)}
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    if reader:
        return {"storage_reader": FsspecReader(target.url, **target.storage_options)}
    # sync_files=False: a stream to an object store has no fileno, and torch's fallback is a
    # machine-wide os.sync(); the object is durable once its upload completes anyway.
    return {"storage_writer": FsspecWriter(target.url, sync_files=False, **target.storage_options)}


# ----------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """torch (CPU and CUDA), numpy and Python RNG states as msgpack-able values."""
    np_state = cast(tuple, np.random.get_state())  # the legacy tuple form (its default)
    state = {
        "torch": torch.get_rng_state().numpy().tobytes(),
        "numpy": [
            np_state[0],
            np_state[1].astype(np.uint32).tobytes(),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8))


# ----------------------------------------------------------------------------- rank side


def state_dict_options(model: torch.nn.Module) -> Any:
    """Frozen parameters (a LoRA run's base model) stay out of the checkpoint: they are the
    base model's, which every resume loads anyway. ``strict=False`` lets loading leave them
    alone; DCP itself still fails on any entry that is asked for and missing."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def save_rank_state(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    rank: int,
    step: int,
    version: int,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Collective: every rank writes its model/optimizer shards via DCP plus its own msgpack file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = run_path(directory, storage_options)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options(model))
    dcp.save({"model": model_sd, "optim": optim_sd}, **dcp_storage(root, reader=False))
    record = {"step": step, "version": version, "scheduler": scheduler.state_dict(), "rng": rng_state()}
    rank_file(root, rank).write_bytes(msgpack.packb(record, use_bin_type=True))


def load_rank_state(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    rank: int,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[int, int]:
    """Collective: restore shards (resharding if the world size changed), scheduler and RNG;
    return (step, version)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root = run_path(directory, storage_options)
    options = state_dict_options(model)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, **dcp_storage(root, reader=True))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    # Rank 0's file always exists; a rank beyond the saved world size takes rank 0's
    # step/version/scheduler (identical on all ranks) and keeps its own fresh RNG.
    own = rank_file(root, rank)
    record = msgpack.unpackb((own if own.exists() else rank_file(root, 0)).read_bytes(), raw=False)
    scheduler.load_state_dict(record["scheduler"])
    if own.exists():
        set_rng_state(record["rng"])
    return int(record["step"]), int(record["version"])


# ----------------------------------------------------------------------------- driver side


def _revision_target(final: RunPath) -> RunPath:
    """Where a save of `final`'s step goes: `final` itself, or, when that step already has a
    complete checkpoint (an outage checkpoint after an un-acked one), a new revision beside
    it (``step_N.rK``, K past every revision there), so the complete one stays until the new
    one is complete. Never overwritten in place: a crash mid-save would leave no step N."""
    if not final.name.startswith("step_") or REVISION_SEP in final.name:
        return final  # not a step's checkpoint name: saved as named
    step = step_of(final)
    saves = _saves_of(final.parent, step)
    if not any((p / COMPLETE_MARKER).exists() for p in saves):
        return final
    return final.parent / checkpoint_name(step, max(revision_of(p) for p in saves) + 1)


def _saves_of(root: RunPath, step: int) -> list[RunPath]:
    """Every ``step_N`` and ``step_N.rK`` directory of `step` under `root`, complete or not."""
    base = checkpoint_name(step)
    return [p for p in root.glob(f"{base}*") if p.name == base or p.name.startswith(base + REVISION_SEP)]


def staging_dir(final: str | Path | RunPath) -> RunPath:
    """Where the ranks write a checkpoint of `final`'s step: a fresh hidden sibling directory,
    renamed into place by `publish`. On an object store the target itself (cleared of what a
    crashed save left there): see the module doc."""
    final = run_path(final)
    target = _revision_target(final)
    if isinstance(target, ObjectPath):
        remove_tree(target)
        return target
    assert isinstance(target, Path)
    target.parent.mkdir(parents=True, exist_ok=True)
    path = target.parent / f".{target.name}{STAGING_TAG}{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


def target_of(staging: RunPath, final: RunPath) -> RunPath:
    """The checkpoint a staging directory becomes: on an object store itself; on disk the
    name `staging_dir` gave it (`final` or a revision of it), else `final`."""
    if isinstance(staging, ObjectPath):
        return staging
    if staging.name.startswith(".") and STAGING_TAG in staging.name:
        target = staging.parent / staging.name[1:].rsplit(STAGING_TAG, 1)[0]
        if target.name == final.name or target.name.startswith(final.name + REVISION_SEP):
            return target
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(staging: Path, final: Path) -> None:
    """Rename a finished `staging` directory to `final`. An older `final` (a checkpoint or an
    export of the same name) is moved aside first and deleted after, so a reader finds the old
    directory or the new one under that name, never a half-written one."""
    if final.exists():
        trash = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, trash)
        os.replace(staging, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, final)


def publish(staging: RunPath, final: str | Path | RunPath, extra: dict[str, Any]) -> RunPath:
    """Write `extra` and the marker into `staging`, make it the checkpoint of `final`'s step
    (renamed into place; on an object store it is in place already), point `latest` at it,
    then delete what it supersedes: older saves of the same step. Returns the checkpoint."""
    try:
        payload = msgpack.packb(extra, use_bin_type=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint extra must be msgpack-able (dicts, lists, str, numbers, bytes): {e}") from None
    target = target_of(staging, run_path(final))
    if isinstance(target, ObjectPath):
        (target / EXTRA_FILE).write_bytes(payload)
        (target / COMPLETE_MARKER).write_text("ok\n")
        (target.parent / LATEST).write_text(target.name + "\n")
    else:
        assert isinstance(staging, Path) and isinstance(target, Path)
        (staging / EXTRA_FILE).write_bytes(payload)
        (staging / COMPLETE_MARKER).write_text("ok\n")
        _fsync_dir(staging)
        replace_dir(staging, target)
        write_atomic(target.parent / LATEST, (target.name + "\n").encode())
        _fsync_dir(target.parent)
    _drop_superseded(target)
    return target


def _drop_superseded(target: RunPath) -> None:
    """Older saves of `target`'s step (complete or left by a crash), now that `latest` names
    `target`: marker first, as `prune` does. Best effort: the new checkpoint is complete, a
    failure here leaves only bytes for a later save of this step to clear."""
    if not target.name.startswith("step_"):
        return
    for path in _saves_of(target.parent, step_of(target)):
        if revision_of(path) >= revision_of(target):
            continue
        try:
            (path / COMPLETE_MARKER).unlink(missing_ok=True)
            remove_tree(path)
        except OSError as e:
            log.warning("could not delete %s, superseded by %s: %s", path, target.name, e)


def resolve(path: str | Path | RunPath) -> RunPath:
    """A complete checkpoint directory: `path` itself, or the one its `latest` pointer names."""
    path = run_path(path)
    if (path / LATEST).is_file() and not (path / COMPLETE_MARKER).exists():
        path = path / (path / LATEST).read_text().strip()
    if not (path / COMPLETE_MARKER).exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    return path


def prune(root: str | Path | RunPath, keep_last: int, keep_every: int = 0) -> list[RunPath]:
    """Delete complete ``step_*`` checkpoints under `root` but the newest `keep_last`, those
    whose step is a multiple of `keep_every` (> 0) and the one `latest` names; returns the
    deleted ones. Staging directories are left alone: a save may be writing them."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: must be >= 1")
    root = run_path(root)
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    removed = []
    for path in complete_checkpoints(root)[:-keep_last]:
        if path.name == latest or (keep_every > 0 and step_of(path) % keep_every == 0):
            continue
        # Out of readers' sight first (the marker), then the bytes: a crash mid-delete leaves
        # no directory that looks complete but is not.
        (path / COMPLETE_MARKER).unlink()
        remove_tree(path)
        removed.append(path)
    return removed
