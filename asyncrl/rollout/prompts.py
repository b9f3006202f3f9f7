"""Prompt sources: a jsonl / parquet file, a local Hugging Face ``datasets`` directory, or the env.

    source = open_prompts(cfg.rollout.prompts, env, seed=0, id_prefix="gen-0")
    prompt_id, text, metadata = next(source)          # endless: files are cycled epoch by epoch

A record's text is its "prompt" field (or "question", GSM8K's name); every other field
is metadata handed to the reward function (e.g. "answer"). Prompt ids are stable
("<id_prefix>:<file stem>:<epoch>:<row>", or "<id_prefix>:<n>" for env-made prompts), so a
re-issued prompt is recognisably the same one; the generator's prefix "<generator id>.<incarnation>"
keeps two generators (or two lives of one) reading the same file from sharing ids.
A ``datasets`` directory (``Dataset.save_to_disk``) is read with pyarrow directly, so
the ``datasets`` package is not needed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEXT_FIELDS = ("prompt", "question")


@dataclass(frozen=True)
class PromptItem:
    """A drawn prompt on its way through a generator: admitted, noted in Redis (text and
    metadata, so a successor can re-issue it), then rolled out into one group."""

    prompt_id: str
    """Also the group id and the request id, so it fixes the sampling seeds."""
    text: str
    metadata: dict[str, Any]
    ids: list[int]
    """The tokenized text."""


def _split(record: dict[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    for name in TEXT_FIELDS:
        if isinstance(record.get(name), str):
            meta = {k: v for k, v in record.items() if k != name}
            return record[name], meta
    raise ValueError(f"{where}: no string field {' or '.join(map(repr, TEXT_FIELDS))} in {sorted(record)}")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All records of a jsonl file, a parquet file, or a ``save_to_disk`` datasets directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"rollout.prompts={str(path)!r} does not exist")
    if path.is_dir():
        import pyarrow as pa

        state = path / "state.json"
        if not state.exists():
            raise ValueError(
                f"rollout.prompts={str(path)!r}: a directory must be a saved datasets directory (state.json missing)"
            )
        rows: list[dict[str, Any]] = []
        for entry in json.loads(state.read_text())["_data_files"]:
            with pa.memory_map(str(path / entry["filename"])) as source:
                rows += pa.ipc.open_stream(source).read_all().to_pylist()
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for i, line in enumerate(path.read_text().splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i + 1}: not valid JSON: {e}") from None
        return rows
    raise ValueError(f"rollout.prompts={str(path)!r}: expected .jsonl, .parquet or a datasets directory")


def file_prompts(path: str | Path, seed: int = 0, id_prefix: str = "") -> Iterator[tuple[str, str, dict[str, Any]]]:
    records = read_records(path)
    if not records:
        raise ValueError(f"rollout.prompts={str(path)!r} holds no records")
    stem = f"{id_prefix}:{Path(path).stem}" if id_prefix else Path(path).stem
    parsed = [_split(r, f"{path} row {i}") for i, r in enumerate(records)]
    epoch = 0
    while True:
        order = list(range(len(parsed)))
        random.Random(seed + epoch).shuffle(order)
        for i in order:
            yield f"{stem}:{epoch}:{i}", parsed[i][0], parsed[i][1]
        epoch += 1


def env_prompts(env, seed: int, id_prefix: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    rng = random.Random(seed)
    i = 0
    while True:
        text, meta = env.make_prompt(rng)
        yield f"{id_prefix}:{i}", text, meta
        i += 1


def open_prompts(path: str | None, env, *, seed: int, id_prefix: str):
    """The endless prompt stream a generator draws from."""
    return file_prompts(path, seed, id_prefix) if path else env_prompts(env, seed, id_prefix)
