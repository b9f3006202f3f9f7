"""Prompt sources: a jsonl / parquet file, a saved Hugging Face dataset, a hub id, or the env.

    source = open_prompts(cfg.rollout.prompts, env, seed=0, id_prefix="gen-0", split="train")
    prompt_id, text, metadata = next(source)          # endless: a dataset is cycled epoch by epoch
    ids = encode_prompt(tokenizer, text, chat_template=True)

A source is
- a ``.jsonl`` file (one JSON object a line), a ``.json`` file (a JSON array of objects, or
  one object a line) or a ``.parquet`` file;
- a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (read with
  ``datasets.load_from_disk``; a DatasetDict gives its ``split``);
- a hub id ``owner/name`` or ``owner/name:config`` (``datasets.load_dataset``, its ``split``;
  needs network the first time, then the local cache);
- None: the environment makes the prompts.

A record's text is its ``prompt_field`` column (with the default "prompt", GSM8K's "question"
and then "messages" are taken when there is no "prompt"). A prompt column holding a list is a
chat conversation, ``[{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...]``
(TRL's conversational format; content a string or a list of text and image parts): it is
rendered whole by the tokenizer's chat template (so it needs ``rollout.chat_template=true``),
travels as ``metadata["prompt_messages"]``, and the reward's prompt text is its last user turn.
A record's ``images`` (or ``image``) column travels as ``metadata["images"]``, PNG bytes, one
per image part (asyncrl.rollout.prompt_images: what is read, the limits, the inserted parts).
Every other column is metadata handed to the reward (TRL-style reward functions get each as a
keyword); the ``answer_field`` column is handed over as ``metadata["answer"]``, the reference
answer the gsm8k reward reads. Prompt ids are stable ("<id_prefix>:<name>:<epoch>:<row>", or
"<id_prefix>:<n>" for env-made prompts), so a re-issued prompt is recognisably the same one;
the generator's prefix "<generator id>.<incarnation>" keeps two generators (or two lives of
one) reading the same dataset from sharing ids.
``datasets`` is imported only for a dataset directory or a hub id.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config.base import is_hub_id
from asyncrl.data.images import IMAGES_KEY, ImageLimits
from asyncrl.infra import ExpectedFailure
from asyncrl.rollout.prompt_images import IMAGE_COLUMNS, PromptRecordError, chat_text, record_images, short_json

DEFAULT_PROMPT_FIELD = "prompt"
FALLBACK_PROMPT_FIELDS = ("question", "messages")
"""GSM8K's name for its prompt, then the usual chat column, taken when there is no "prompt"."""
MESSAGES_KEY = "prompt_messages"
"""The metadata key a chat prompt's conversation travels under (to the encoder and the reward)."""
_NEEDS_TEMPLATE = "a chat conversation is rendered with the tokenizer's chat template: set rollout.chat_template=true"
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
    return [row for _, row in located_records(source, split, where)[0]]


def located_records(
    source: str | Path, split: str = "train", where: str = "rollout.prompts", limit: int | None = None
) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """(where each record is, for errors: "file:line" or "source row i"; the record) for the
    first ``limit`` records (all with None), and how many records the source holds."""
    source = str(source)
    path = Path(source)
    desc = f"{where}={source!r}"
    if is_hub_id(source):
        desc = f"{desc} (hub dataset, split {split!r})"
        return _dataset_rows(_load_dataset(source, split, desc), desc, limit)
    if not path.exists():
        raise PromptSourceError(f"{desc} does not exist (nor is it a hub id 'owner/name[:config]')")
    if path.is_dir():
        if not any((path / f).exists() for f in ("state.json", "dataset_dict.json")):
            raise PromptSourceError(f"{desc}: a directory must be written by Dataset(Dict).save_to_disk")
        return _dataset_rows(_load_dataset(source, split, desc), desc, limit)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = [(f"{desc} row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    elif path.suffix in (".jsonl", ".json"):
        rows = _json_rows(path, where)
    else:
        raise PromptSourceError(f"{desc}: expected .jsonl, .json, .parquet, a saved datasets directory or a hub id")
    return rows[:limit], len(rows)


def _dataset_rows(data, desc: str, limit: int | None) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    rows = (data if limit is None or limit >= len(data) else data.select(range(limit))).to_list()
    return [(f"{desc} row {i}", r) for i, r in enumerate(rows)], len(data)


def _json_rows(path: Path, where: str) -> list[tuple[str, dict[str, Any]]]:
    """A JSON array of objects, or one object a line; every error names the file and line."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a BOM, as some editors write, is not part of the data
    except UnicodeDecodeError as e:
        bad = raw.count(b"\n", 0, e.start) + 1
        raise PromptSourceError(f"{where}: {path}:{bad}: not UTF-8 (byte {raw[e.start]:#04x}: {e.reason})") from None
    if text.lstrip().startswith("["):
        items = _json_array(path, text, where)
    else:
        items = []
        # "\n" only: str.splitlines also splits at U+2028 and the like, which JSON strings may hold.
        for i, line in enumerate(text.split("\n")):
            if line.strip():
                try:
                    items.append((i + 1, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise PromptSourceError(f"{where}: {path}:{i + 1}: not valid JSON: {e}") from None
    rows = []
    for line_no, item in items:
        if not isinstance(item, dict):
            got = short_json(item, 40)
            raise PromptSourceError(f"{where}: {path}:{line_no}: expected a JSON object (a record), got {got}")
        rows.append((f"{where}: {path}:{line_no}", item))
    return rows


def _json_array(path: Path, text: str, where: str) -> list[tuple[int, Any]]:
    """The elements of a JSON array with the line each starts on."""
    decoder = json.JSONDecoder()
    items: list[tuple[int, Any]] = []
    pos = text.index("[") + 1
    try:
        pos = _skip_space(text, pos)
        if text.startswith("]", pos):
            pos += 1
        else:
            while True:
                item, end = decoder.raw_decode(text, pos)
                items.append((text.count("\n", 0, pos) + 1, item))
                pos = _skip_space(text, end)
                if text.startswith("]", pos):
                    pos += 1
                    break
                if not text.startswith(",", pos):
                    raise json.JSONDecodeError("expected ',' or ']' after an array element", text, pos)
                pos = _skip_space(text, pos + 1)
        if _skip_space(text, pos) != len(text):
            raise json.JSONDecodeError("extra data after the array", text, _skip_space(text, pos))
    except json.JSONDecodeError as e:
        raise PromptSourceError(f"{where}: {path}:{e.lineno}: not valid JSON: {e}") from None
    return items


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def split_record(
    record: dict[str, Any],
    where: str,
    prompt_field: str = DEFAULT_PROMPT_FIELD,
    answer_field: str = ANSWER_KEY,
    image_limits: ImageLimits | None = None,
) -> tuple[str, dict[str, Any]]:
    """(prompt text, metadata) of one record; ValueError naming the field, the columns and ``where``.
    Its images are held to ``image_limits`` (the run's rollout.images; the defaults without)."""
    field = prompt_field
    if field not in record and field == DEFAULT_PROMPT_FIELD:
        field = next((f for f in FALLBACK_PROMPT_FIELDS if f in record), field)
    if field not in record:
        raise PromptSourceError(
            f"{where}: no prompt column {prompt_field!r} (rollout.prompt_field); the columns are {sorted(record)}"
        )
    value = record[field]
    if MESSAGES_KEY in record and field != MESSAGES_KEY:
        raise PromptSourceError(f"{where}: column {MESSAGES_KEY!r} is reserved for a chat prompt's conversation")
    meta = {k: v for k, v in record.items() if k != field and k not in IMAGE_COLUMNS}
    if not isinstance(value, (list, str)):
        raise PromptSourceError(
            f"{where}: prompt column {field!r} holds a {type(value).__name__}, expected a string "
            f"or a chat conversation (a list of {{role, content}} messages)"
        )
    try:  # the conversation's parts, the record's images as PNG bytes: asyncrl.rollout.prompt_images
        text = chat_text(value, f"{where}: column {field!r}") if isinstance(value, list) else value
        messages, images = record_images(
            record, value if isinstance(value, list) else None, text, where, image_limits or ImageLimits()
        )
    except PromptRecordError as e:
        raise PromptSourceError(str(e)) from None
    if messages is not None:
        meta[MESSAGES_KEY] = messages
    if images:
        meta[IMAGES_KEY] = images
    if answer_field != ANSWER_KEY:
        if answer_field not in record:
            raise PromptSourceError(
                f"{where}: no answer column {answer_field!r} (rollout.answer_field); the columns are {sorted(record)}"
            )
        meta[ANSWER_KEY] = meta.pop(answer_field)
    return text, meta


@dataclass(frozen=True)
class SourceCheck:
    """What check_source read: every record of a file or saved dataset, a sample of a hub dataset's."""

    checked: int
    total: int
    chat: int
    """Records holding a chat conversation."""
    images: int = 0
    """Records with images (each read and decoded)."""
    first_with_images: tuple[str, str, dict[str, Any]] | None = None
    """(where, text, metadata) of the first record with images: --check renders it for the model."""

    def describe(self) -> str:
        rows = (
            f"{self.checked} records"
            if self.checked == self.total
            else f"the first {self.checked} of {self.total} records"
        )
        kinds = [f"{self.chat} chat conversations"] if self.chat else []
        kinds += [f"{self.images} with images"] if self.images else []
        return f"{rows} read and valid" + (f" ({', '.join(kinds)})" if kinds else "")


def check_source(
    source: str,
    *,
    split: str = "train",
    prompt_field: str = DEFAULT_PROMPT_FIELD,
    answer_field: str = ANSWER_KEY,
    chat_template: bool = False,
    where: str = "rollout.prompts",
    hub_sample: int | None = None,
    image_limits: ImageLimits | None = None,
) -> SourceCheck:
    """Read a prompt source through and check every record as a generator would split and
    encode it (a hub dataset's first ``hub_sample`` records when given); PromptSourceError otherwise."""
    limit = hub_sample if is_hub_id(str(source)) else None
    rows, total = located_records(source, split, where, limit)
    if not rows:
        raise PromptSourceError(f"{where}={str(source)!r} holds no records")
    chat, images, first = 0, 0, None
    for place, record in rows:
        text, meta = split_record(record, place, prompt_field, answer_field, image_limits)
        if MESSAGES_KEY in meta:
            chat += 1
            if not chat_template:
                also = " (a prompt with images is one: its image parts)" if IMAGES_KEY in meta else ""
                raise PromptSourceError(f"{place}: {_NEEDS_TEMPLATE}{also}")
        if IMAGES_KEY in meta:
            images += 1
            first = first or (place, text, meta)
    return SourceCheck(len(rows), total, chat, images, first)


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
    image_limits: ImageLimits | None = None,
) -> Iterator[tuple[str, str, dict[str, Any]]]:
    rows, _ = located_records(source, split, where)
    if not rows:
        raise PromptSourceError(f"{where}={str(source)!r} holds no records")
    name = _name(str(source))
    stem = f"{id_prefix}:{name}" if id_prefix else name
    parsed = [split_record(r, place, prompt_field, answer_field, image_limits) for place, r in rows]
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
    image_limits: ImageLimits | None = None,
):
    """The endless prompt stream a generator (or the evaluator) draws from."""
    if not source:
        return env_prompts(env, seed, id_prefix)
    return file_prompts(
        source,
        seed,
        id_prefix,
        split=split,
        prompt_field=prompt_field,
        answer_field=answer_field,
        where=where,
        image_limits=image_limits,
    )


def encode_prompt(
    tokenizer, text: str, chat_template: bool = False, metadata: dict[str, Any] | None = None
) -> list[int]:
    """Token ids of a prompt; with ``chat_template``, of the single user turn (or the record's
    chat conversation, ``metadata["prompt_messages"]``) rendered by the tokenizer's chat template
    with the assistant's turn opened (add_generation_prompt). The rendered text carries the
    template's own special tokens, so none are added again."""
    messages = (metadata or {}).get(MESSAGES_KEY)
    if messages is not None and not chat_template:
        raise PromptSourceError(_NEEDS_TEMPLATE)
    if not chat_template:
        return tokenizer.encode(text)
    conversation = messages if messages is not None else [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def prompt_encoder(tokenizer, chat_template: bool) -> Callable[[str, dict[str, Any]], list[int]]:
    """encode_prompt with its tokenizer and template setting fixed: (text, metadata) -> ids."""
    return lambda text, metadata: encode_prompt(tokenizer, text, chat_template, metadata)


def check_chat_template(tokenizer, model: str) -> None:
    """rollout.chat_template needs a tokenizer that has one: say so before any generator starts."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptSourceError(
            f"rollout.chat_template=true, but the tokenizer of rollout.model={model!r} has no chat template "
            f"(no 'chat_template' in its tokenizer_config.json nor a chat_template.jinja): use an instruct/chat "
            f"model's tokenizer, or rollout.chat_template=false to tokenize prompts as they are"
        )
