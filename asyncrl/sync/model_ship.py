"""The model directory to every node, through Ray's object store (weights' "version 0").

    package = ship_model("/runs/x/tiny-model")        # driver: [ObjectRef] + manifest, or None
    path = local_model("/runs/x/tiny-model", package)  # any node: that path if it holds the
                                                       # same files, else an unpacked copy

A hub id, or a path that holds the same files on every node, is used as it is. A local
directory of the driver's host (the `tiny` model in the run dir, a fine-tuned checkpoint) is
put once; a node that lacks it pulls it once and unpacks it under its own temp dir, keyed by
the manifest, so several actors on one node share one copy. The package is only ever read
through Ray (our own actors, or an elastic generator attached as a Ray driver), never from
Redis.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

MAX_SHIP_BYTES = 64 * 1024**3
"""Beyond this a model directory is not copied through the object store: put it on shared
storage or the hub instead (the error says so)."""


def manifest(path: str | Path) -> dict[str, int]:
    """{relative path: size} of every file under ``path``."""
    root = Path(path)
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def ship_model(path: str) -> dict | None:
    """Put a local model directory into the object store; None for anything else (a hub id)."""
    import ray

    if not os.path.isdir(path):
        return None
    files = manifest(path)
    total = sum(files.values())
    if total > MAX_SHIP_BYTES:
        raise ValueError(
            f"rollout.model={path!r}: {total / 1e9:.1f} GB is too large to ship through Ray's "
            f"object store; use a hub id or a path every node can read"
        )
    blobs = {name: (Path(path) / name).read_bytes() for name in files}
    log.info("model %s (%d files, %.1f MB) shipped through the object store", path, len(files), total / 1e6)
    return {"path": path, "manifest": files, "ref": [ray.put(blobs)]}


def _same_files(path: str, files: dict[str, int]) -> bool:
    try:
        return os.path.isdir(path) and manifest(path) == files
    except OSError:
        return False


def local_model(path: str, package: dict | None) -> str:
    """``path`` where it holds the shipped files (or nothing was shipped), else a local copy."""
    if package is None or _same_files(path, package["manifest"]):
        return path
    import ray

    digest = hashlib.sha256(json.dumps([package["path"], package["manifest"]]).encode()).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / "asyncrl-models" / digest
    if _same_files(str(target), package["manifest"]):
        return str(target)
    blobs = ray.get(package["ref"][0])
    staging = Path(
        tempfile.mkdtemp(prefix=f".{digest}-", dir=target.parent if target.parent.exists() else _mkdir(target.parent))
    )
    try:
        for name, data in blobs.items():
            dest = (staging / name).resolve()
            if staging.resolve() not in dest.parents:  # names come from our own driver; still, stay inside
                raise ValueError(f"model package entry {name!r} escapes its directory")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        with contextlib.suppress(OSError):  # another actor on this node won the race: use its copy
            os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("model %s unpacked from the object store into %s", path, target)
    return str(target)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
