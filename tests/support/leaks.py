"""Looking for secrets where they must not be: every key and value of a Redis, every file of a
run directory, and whether those files are private to their user.

    assert_no_secret(b"\n".join(redis_values(client)), "Redis", secrets)
    for path, blob in run_files(run_dir): ...
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

import redis


def redis_values(client: redis.Redis) -> list[bytes]:
    """Every key and every value in the server, whatever its type (read by type, not DUMP:
    DUMP compresses long strings, so a secret inside one would not show)."""
    out: list[bytes] = []
    for key in client.scan_iter(count=1000):
        out.append(key)
        kind = client.type(key)
        if kind == b"none":
            continue  # deleted since SCAN listed it (a live job's in-flight notes come and go)
        if kind == b"string":
            out.append(client.get(key))
        elif kind == b"hash":
            out += [x for kv in client.hgetall(key).items() for x in kv]
        elif kind == b"list":
            out += client.lrange(key, 0, -1)
        elif kind == b"set":
            out += list(client.smembers(key))
        elif kind == b"zset":
            out += [m for m, _ in client.zrange(key, 0, -1, withscores=True)]
        elif kind == b"stream":
            out += [x for _, fields in client.xrange(key) for kv in fields.items() for x in kv]
        else:
            raise AssertionError(f"key {key!r} of unexpected type {kind!r}")
    return out


def assert_no_secret(blob: bytes, where: str, secrets: Iterable[str]) -> None:
    for secret in secrets:
        assert secret.encode() not in blob, f"{secret!r} leaked into {where}"


def run_files(run_dir: Path) -> Iterator[tuple[Path, int]]:
    """(path, permission bits) of every file and directory under `run_dir`, symbolic links
    (wandb's latest-run, logs/ray) neither listed nor followed."""
    for root, dirs, files in os.walk(run_dir):
        for name in [*dirs, *files]:
            path = Path(root) / name
            if not path.is_symlink():
                yield path, stat.S_IMODE(os.lstat(path).st_mode)


def check_run_dir(
    run_dir: Path, secrets: Iterable[str], *, holders: set[Path], foreign: frozenset[Path] = frozenset()
) -> int:
    """Assert that no file of the run dir but `holders` holds a secret, that the holders do
    (so the search looks for what is there), and that no file or directory is open to group or
    others (`foreign`: files the run did not create, e.g. a harness's log, are skipped).
    Returns how many files were searched."""
    secrets = list(secrets)
    for path in holders:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, f"{path} holds the secrets: must be 0600"
        assert any(s.encode() in path.read_bytes() for s in secrets), f"{path}: no secret in it to hide"
    searched = 0
    for path, mode in run_files(run_dir):
        if path in foreign:
            continue
        assert mode & 0o077 == 0, f"{path}: mode {mode:o}, open to group or others (expected 600 / 700)"
        if path.is_file() and path not in holders:
            assert_no_secret(path.read_bytes(), str(path.relative_to(run_dir)), secrets)
            searched += 1
    return searched
