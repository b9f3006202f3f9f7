"""How the run's small records are written in Redis and read back.

    unpack_small(raw)                    # a heartbeat or metrics record -> plain Python
    unpack_note(raw)                     # a prompt's note (its images too) -> plain Python
    to_text("max_staleness", 2)          # "2": a state hash value, readable by the Lua scripts
    from_text("2")                       # 2: int, then float, else the text itself

msgpack is decoded with ext types refused and sizes bounded, never pickle: a record in Redis
is data from any process that can reach it, not code.
"""

from __future__ import annotations

from typing import Any

import msgpack

from asyncrl.data.images import ImageLimits

MAX_SMALL_RECORD = 1 << 20
"""Bound on a heartbeat or metrics record (bytes): they are small by design."""


def note_bound(limits: ImageLimits | None = None) -> int:
    """Bound on a prompt's note (in-flight, re-issued): its text and metadata, plus the largest
    images a prompt may carry under the run's limits (rollout.images; the defaults alone reach
    MAX_SMALL_RECORD)."""
    limits = limits or ImageLimits()
    return MAX_SMALL_RECORD + limits.max_images * limits.max_bytes


def unpack_note(data: bytes, limits: ImageLimits | None = None) -> Any:
    """A prompt's note (asyncrl.rollout.production writes it) -> plain Python, as unpack_small,
    bounded by note_bound(limits)."""
    return unpack_small(data, max_bytes=note_bound(limits))


def unpack_small(data: bytes, *, max_bytes: int = MAX_SMALL_RECORD) -> Any:
    """msgpack -> plain Python for small trusted-shape records; ext types refused."""

    def no_ext(code: int, _data: bytes) -> Any:
        raise ValueError(f"msgpack ext type {code} is not allowed")

    if len(data) > max_bytes:
        raise ValueError(f"record of {len(data)} bytes > {max_bytes}")
    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=True,
        ext_hook=no_ext,
        max_bin_len=max_bytes,
        max_str_len=MAX_SMALL_RECORD,  # a note's images are bins: its text keeps the bound
        max_array_len=65536,
        max_map_len=65536,
        max_ext_len=0,
    )


def to_text(name: str, value: Any) -> str:
    """A state hash value as text (bools as 0/1, floats exactly)."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, (int, str)):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # round-trips exactly
    raise TypeError(f"state field {name!r}: {type(value).__name__} is not int, float, str or bool")


def from_text(text: str) -> int | float | str:
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return text
