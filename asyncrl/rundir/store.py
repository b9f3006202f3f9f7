"""Where a run directory lives: a local path, or an fsspec URL on an object store.

    root = run_path("runs/x")                                  # a pathlib.Path, exactly as before
    root = run_path("s3://bucket/runs/x", {"endpoint_url": ...})  # an ObjectPath
    (root / "summary.json").write_text(...)                   # the same calls on both
    write_atomic(root / "config.yaml", data, private=True)    # what differs goes through helpers

A local run directory stays a `pathlib.Path`, so local runs keep their behaviour (atomic
renames, fsync, umask-private files) and their speed. An `ObjectPath` offers the part of
pathlib a run uses over an fsspec filesystem (s3fs for ``s3://``, gcsfs for ``gs://``);
the operations an object store does differently (an atomic replace, an append, a tree's
removal or upload) are the module's functions, which dispatch on the type.

Object stores have no rename and no append: a PUT replaces an object whole and atomically,
so a replace is a plain write, an append rewrites the object, and "directories" are key
prefixes (mkdir does nothing; a prefix exists while it holds an object). Listings are not
cached (`use_listings_cache=False`): other processes (learner ranks, a resumed run) write
the same prefixes.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem  # type: ignore[import-untyped]

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")

_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
"""The package fsspec needs for each scheme a user is likely to write."""

_NO_LISTINGS_CACHE = frozenset({"s3", "s3a", "gs", "gcs"})


class StorageError(ValueError):
    """A run directory URL that cannot be used: an unknown scheme or a missing package."""


class FileStat(NamedTuple):
    st_size: int
    st_mtime: float
    st_mtime_ns: int


def is_url(location: str | os.PathLike[str]) -> bool:
    """True for ``scheme://...`` other than ``file://`` (a local path written as a URL)."""
    m = _URL.match(os.fspath(location)) if isinstance(location, str) else None
    return m is not None and m.group(1).lower() != "file"


class ObjectPath:
    """A file or directory under an fsspec URL, with the part of pathlib's interface a run uses."""

    __slots__ = ("fs", "path", "storage_options")

    def __init__(self, fs: AbstractFileSystem, path: str, storage_options: Mapping[str, Any]):
        self.fs = fs
        self.path = path.rstrip("/")
        """The filesystem's own path (no scheme: ``bucket/runs/x`` on S3)."""
        self.storage_options = dict(storage_options)
        """What the filesystem was opened with (torch's DCP writer opens its own with them)."""

    @classmethod
    def open(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> ObjectPath:
        scheme = url.split("://", 1)[0].lower()
        options = dict(storage_options or {})
        if scheme in _NO_LISTINGS_CACHE:
            options.setdefault("use_listings_cache", False)
        import fsspec  # a local run never needs it

        try:
            fs, path = fsspec.core.url_to_fs(url, **options)
        except ImportError as e:
            package = _PACKAGES.get(scheme, "the fsspec implementation of that scheme")
            raise StorageError(f"run dir {url!r}: {scheme}:// needs the {package} package ({e})") from None
        except ValueError as e:
            raise StorageError(f"run dir {url!r}: {e}") from None
        return cls(fs, path, options)

    # ------------------------------------------------------------------ naming

    @property
    def url(self) -> str:
        return str(self.fs.unstrip_protocol(self.path))

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectPath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and (self.fs.protocol, self.path) == (other.fs.protocol, other.path)

    def __hash__(self) -> int:
        return hash((str(self.fs.protocol), self.path))

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(self.fs, f"{self.path}/{name.strip('/')}", self.storage_options)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.fs, self.path.rsplit("/", 1)[0], self.storage_options)

    # ------------------------------------------------------------------ reading

    def exists(self) -> bool:
        return bool(self.fs.exists(self.path))

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.path))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.path))

    def read_bytes(self) -> bytes:
        return bytes(self.fs.cat_file(self.path))

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)

    def iterdir(self) -> Iterator[ObjectPath]:
        try:
            names = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return
        for name in names:
            child = str(name).rstrip("/")
            if child != self.path:
                yield ObjectPath(self.fs, child, self.storage_options)

    def glob(self, pattern: str) -> Iterator[ObjectPath]:
        """The children whose name matches `pattern` (one level, as the run's callers use it)."""
        return (p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern))

    def stat(self) -> FileStat:
        info = self.fs.info(self.path)
        try:
            mtime = self.fs.modified(self.path).timestamp()
        except (NotImplementedError, AttributeError):
            mtime = 0.0
        return FileStat(int(info.get("size") or 0), mtime, int(mtime * 1e9))

    # ------------------------------------------------------------------ writing

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do: a prefix exists once an object is written under it."""

    def write_bytes(self, data: bytes) -> int:
        self.fs.pipe_file(self.path, bytes(data))
        return len(data)

    def write_text(self, data: str, encoding: str = "utf-8") -> int:
        return self.write_bytes(data.encode(encoding))

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise


RunPath: TypeAlias = Path | ObjectPath
"""A run directory or a file in it: local (pathlib) or on an object store."""


def run_path(
    location: str | os.PathLike[str] | ObjectPath, storage_options: Mapping[str, Any] | None = None
) -> RunPath:
    """`location` as a RunPath: an ObjectPath for a URL (opened with `storage_options`, or the
    filesystem's standard credentials: for S3 the AWS_* variables, ~/.aws, AWS_ENDPOINT_URL),
    else a Path. ``file://`` URLs are local paths."""
    if isinstance(location, (Path, ObjectPath)):
        return location
    text = os.fspath(location)
    if is_url(text):
        return ObjectPath.open(text, storage_options)
    if text.lower().startswith("file://"):
        return Path(text[len("file://") :])
    return Path(text)


def is_remote(path: RunPath) -> bool:
    return isinstance(path, ObjectPath)


def write_atomic(path: RunPath, data: bytes, *, private: bool = False, durable: bool = False) -> None:
    """Replace `path` whole; a reader sees the old content or the new, never half. Local: a
    temporary file renamed over it (created 0600 with `private`, fsynced with `durable`).
    An object store's PUT is atomic already, and its objects have no mode bits."""
    if isinstance(path, ObjectPath):
        path.write_bytes(data)
        return
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def append_durable(path: RunPath, text: str) -> None:
    """Append `text`. Local: appended and fsynced. An object store cannot append: the object is
    read and written back whole (one PUT, atomic), which suits small files written rarely."""
    if isinstance(path, ObjectPath):
        old = path.read_bytes() if path.exists() else b""
        path.write_bytes(old + text.encode())
        return
    with open(path, "a") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def remove_tree(path: RunPath) -> None:
    """Delete a directory and everything under it; a missing one is not an error."""
    if isinstance(path, ObjectPath):
        with contextlib.suppress(FileNotFoundError):
            path.fs.rm(path.path, recursive=True)
        return
    shutil.rmtree(path, ignore_errors=True)


def copy_tree(source: ObjectPath, dest: ObjectPath) -> None:
    """Copy every object under `source` to the same relative key under `dest` (server-side)."""
    for key in source.fs.find(source.path):
        source.fs.copy(key, dest.path + key[len(source.path) :])


def upload_tree(local: Path, dest: RunPath) -> None:
    """Every file under the local directory `local` to the same relative names under `dest`."""
    if not isinstance(dest, ObjectPath):
        raise TypeError(f"upload_tree: {dest} is a local path")
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        dest.fs.put_file(str(file), f"{dest.path}/{file.relative_to(local).as_posix()}")


def check_writable(path: RunPath) -> None:
    """Write and delete a probe file under `path`; OSError naming `path` and the cause if either
    fails (a missing bucket, no credentials, no permission, a read-only disk)."""
    probe = path / f".asyncrl-write-check-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok\n")
        probe.unlink()
    except Exception as e:  # botocore and gcsfs raise their own types, not only OSError
        raise OSError(f"run dir {path} is not writable: {type(e).__name__}: {e}") from None


def local_dir_for(run_dir: RunPath, configured: str | None = None) -> Path:
    """Where a run keeps what must stay on the trainer's machine (the Redis AOF, the metrics
    spool, the tiny model, the Ray log link, the dashboard token): the run directory itself
    when it is local; for an object store `configured` (control.local_dir) or
    ``~/.cache/asyncrl/runs/<scheme>/<path>``, the same path each time, so a resume on the
    same machine finds its Redis again."""
    if isinstance(run_dir, Path):
        return run_dir
    if configured:
        return Path(configured).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    protocol = run_dir.fs.protocol
    scheme = protocol[0] if isinstance(protocol, (tuple, list)) else str(protocol)
    return cache / "asyncrl" / "runs" / scheme / run_dir.path
