"""Prompt sources: a jsonl / parquet file, a saved Hugging Face dataset, a hub id, or the env.

    source = open_prompts(cfg.rollout.prompts, env, seed=0, id_prefix="gen-0", split="train")
    prompt_id, text, metadata = next(source)          # endless: a dataset is cycled epoch by epoch
    ids = encode_prompt(tokenizer, text, chat_template=True)

A source is
- a ``.jsonl`` / ``.json`` (one object a line) or ``.parquet`` file;
- a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (read with
  ``datasets.load_from_disk``; a DatasetDict gives its ``split``);
- a hub id ``owner/name`` or ``owner/name:config`` (``datasets.load_dataset``, its ``split``;
  needs network the first time, then the local cache);
- None: the environment makes the prompts.

A record's text is its ``prompt_field`` column (with the default "prompt", GSM8K's "question"
is taken when there is no "prompt"). Every other column is metadata handed to the reward
(TRL-style reward functions get each as a keyword); the ``answer_field`` column is handed
over as ``metadata["answer"]``, the reference answer the gsm8k reward reads. Prompt ids are
stable ("<id_prefix>:<name>:<epoch>:<row>", or "<id_prefix>:<n>" for env-made prompts), so a
re-issued prompt is recognisably the same one; the generator's prefix "<generator id>.<incarnation>"
keeps two generators (or two lives of one) reading the same dataset from sharing ids.
``datasets`` is imported only for a dataset directory or a hub id.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config.base import is_hub_id
from asyncrl.infra import ExpectedFailure

DEFAULT_PROMPT_FIELD = "prompt"
FALLBACK_PROMPT_FIELD = "question"
"""GSM8K's name for its prompt, taken when the default "prompt" column is absent."""
ANSWER_KEY = "answer"
"""The metadata key the reference answer is handed to the reward under."""
SPLIT_OPTION = {"rollout.prompts": "rollout.prompt_split", "control.eval_prompts": "control.eval_split"}


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


class PromptSourceError(ValueError, ExpectedFailure):
    """A prompt source that cannot be used: missing, unreadable, no such split or column."""

    label = "prompt error"


def _pick_split(data, split: str, where: str):
    """A DatasetDict's split (error naming the splits there are); a Dataset as it is."""
    if not hasattr(data, "column_names") or isinstance(data.column_names, dict):  # a DatasetDict
        if split not in data:
            option = SPLIT_OPTION.get(where.split("=", 1)[0], "the split")
            raise PromptSourceError(f"{where}: no split {split!r} ({option}); the splits are {sorted(data)}")
        return data[split]
    return data


def _load_dataset(source: str, split: str, where: str):
    try:
        import datasets
    except ImportError as e:
        raise PromptSourceError(f"{where}: reading a Hugging Face dataset needs the 'datasets' package: {e}") from None
    if Path(source).is_dir():
        return _pick_split(datasets.load_from_disk(source), split, where)
    name, _, config = source.partition(":")
    try:
        data = datasets.load_dataset(name, config or None)
    except Exception as e:  # offline, no such dataset or config, ...: the library's own words
        raise PromptSourceError(f"{where}: datasets.load_dataset failed: {type(e).__name__}: {e}") from e
    return _pick_split(data, split, where)


def read_records(source: str | Path, split: str = "train", where: str = "rollout.prompts") -> list[dict[str, Any]]:
    """All records of a prompt source (see the module doc); ``where`` names the option in errors."""
    source = str(source)
    path = Path(source)
    desc = f"{where}={source!r}"
    if is_hub_id(source):
        return _load_dataset(source, split, f"{desc} (hub dataset, split {split!r})").to_list()
    if not path.exists():
        raise PromptSourceError(f"{desc} does not exist (nor is it a hub id 'owner/name[:config]')")
    if path.is_dir():
        if not any((path / f).exists() for f in ("state.json", "dataset_dict.json")):
            raise PromptSourceError(f"{desc}: a directory must be written by Dataset(Dict).save_to_disk")
        return _load_dataset(source, split, desc).to_list()
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
                    raise PromptSourceError(f"{path}:{i + 1}: not valid JSON: {e}") from None
        return rows
    raise PromptSourceError(f"{desc}: expected .jsonl, .json, .parquet, a saved datasets directory or a hub id")


def split_record(
    record: dict[str, Any], where: str, prompt_field: str = DEFAULT_PROMPT_FIELD, answer_field: str = ANSWER_KEY
) -> tuple[str, dict[str, Any]]:
    """(prompt text, metadata) of one record; ValueError naming the field, the columns and ``where``."""
    field = prompt_field
    if field not in record and field == DEFAULT_PROMPT_FIELD and FALLBACK_PROMPT_FIELD in record:
        field = FALLBACK_PROMPT_FIELD
    if field not in record:
        raise PromptSourceError(
            f"{where}: no prompt column {prompt_field!r} (rollout.prompt_field); the columns are {sorted(record)}"
        )
    if not isinstance(record[field], str):
        raise PromptSourceError(
            f"{where}: prompt column {field!r} holds a {type(record[field]).__name__}, expected a string"
        )
    meta = {k: v for k, v in record.items() if k != field}
    if answer_field != ANSWER_KEY:
        if answer_field not in record:
            raise PromptSourceError(
                f"{where}: no answer column {answer_field!r} (rollout.answer_field); the columns are {sorted(record)}"
            )
        meta[ANSWER_KEY] = meta.pop(answer_field)
    return record[field], meta


def _name(source: str) -> str:
    """The source's part of a prompt id (no ':', which separates the id's parts)."""
    return Path(source).stem if not is_hub_id(source) else source.rsplit("/", 1)[-1].replace(":", ".")


def file_prompts(
    source: str | Path,
    seed: int = 0,
    id_prefix: str = "",
    *,
    split: str = "train",
    prompt_field: str = DEFAULT_PROMPT_FIELD,
    answer_field: str = ANSWER_KEY,
    where: str = "rollout.prompts",
) -> Iterator[tuple[str, str, dict[str, Any]]]:
    records = read_records(source, split, where)
    if not records:
        raise PromptSourceError(f"{where}={str(source)!r} holds no records")
    name = _name(str(source))
    stem = f"{id_prefix}:{name}" if id_prefix else name
    parsed = [
        split_record(r, f"{where}={str(source)!r} row {i}", prompt_field, answer_field) for i, r in enumerate(records)
    ]
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


def open_prompts(
    source: str | None,
    env,
    *,
    seed: int,
    id_prefix: str,
    split: str = "train",
    prompt_field: str = DEFAULT_PROMPT_FIELD,
    answer_field: str = ANSWER_KEY,
    where: str = "rollout.prompts",
):
    """The endless prompt stream a generator (or the evaluator) draws from."""
    if not source:
        return env_prompts(env, seed, id_prefix)
    return file_prompts(
        source, seed, id_prefix, split=split, prompt_field=prompt_field, answer_field=answer_field, where=where
    )


def encode_prompt(tokenizer, text: str, chat_template: bool = False) -> list[int]:
    """Token ids of a prompt; with ``chat_template``, of the single user turn rendered by the
    tokenizer's chat template with the assistant's turn opened (add_generation_prompt). The
    rendered text carries the template's own special tokens, so none are added again."""
    if not chat_template:
        return tokenizer.encode(text)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(rendered, add_special_tokens=False)


def check_chat_template(tokenizer, model: str) -> None:
    """rollout.chat_template needs a tokenizer that has one: say so before any generator starts."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptSourceError(
            f"rollout.chat_template=true, but the tokenizer of rollout.model={model!r} has no chat template "
            f"(no 'chat_template' in its tokenizer_config.json nor a chat_template.jinja): use an instruct/chat "
            f"model's tokenizer, or rollout.chat_template=false to tokenize prompts as they are"
        )
