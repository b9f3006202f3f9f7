"""The config schema as a Markdown page (docs/guide/configuration-reference.md).

The same walk as ``asyncrl train --help-config`` (asyncrl.config.help), written as one table
per section, so the guide's reference is generated from the models and cannot drift from
them: ``scripts/config_reference.py`` writes the page and a unit test fails when the committed
copy differs from what this module produces.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from asyncrl.config.help import BOUNDS, entry_sections, field_default, model_doc, section_type, type_name
from asyncrl.config.losses import LOSS_MODELS, CustomLoss
from asyncrl.config.tree import Config

REFERENCE_PATH = "docs/guide/configuration-reference.md"

_HEADER = """\
# Configuration reference

<!-- Generated from the config schema (asyncrl/config/) by `python scripts/config_reference.py`;
do not edit by hand: tests/unit/test_config_reference.py fails when this file is out of date. -->

Every section and field of the config tree, with its type, default, bounds and description,
as `asyncrl train --help-config` prints them. Set a field in the YAML file
(`control: {total_steps: 400}`) or on the command line as `section.field=value`
(`control.total_steps=400`). An unknown key or a bad value fails at start-up, naming the
field. How to use the settings: [the guide](index.md).
"""


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (pipes escaped, one line)."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{_cell(text)}`" if text else ""


def _rows(model: type[BaseModel], path: str, skip: tuple[str, ...] = ()) -> list[str]:
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        doc = field.description or ""
        if name == "policy_loss":
            kind, default = "policy loss (see [Policy losses](#policy-losses))", _code(field_default(field))
        elif (nested := section_type(field.annotation)) is not None:
            anchor = f"{path}.{name}".replace(".", "")
            kind = f"section ([`{path}.{name}`](#{anchor}))"
            default = "" if isinstance(field.annotation, type) else _code(field_default(field))
            doc = doc or model_doc(nested)
        else:
            kind, default = _code(type_name(field.annotation)), _code(field_default(field))
            bounds = [f"{op} {getattr(m, attr)}" for m in field.metadata for attr, op in BOUNDS if hasattr(m, attr)]
            if bounds:
                kind += f" ({_cell(', '.join(bounds))})"
        rows.append(f"| `{path + '.' if path else ''}{name}` | {kind} | {default} | {_cell(doc)} |")
    return rows


def _section(model: type[BaseModel], path: str, level: int) -> list[str]:
    lines = [f"{'#' * level} {path}", "", model_doc(model), "", *_rows(model, path), ""]
    for name, field in model.model_fields.items():
        if name == "policy_loss":
            continue
        for entry in entry_sections(field.annotation):
            lines += [f"{'#' * (level + 1)} {path}.{name}[i]: {entry.__name__}", "", model_doc(entry), ""]
            lines += [*_rows(entry, f"{path}.{name}[i]"), ""]
        nested = section_type(field.annotation)
        if nested is not None:
            lines += _section(nested, f"{path}.{name}", level + 1)
    return lines


def reference_markdown() -> str:
    """The whole reference page, deterministic for a given schema."""
    lines = [_HEADER]
    for section, field in Config.model_fields.items():
        model: Any = field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        lines += _section(model, section, 2)
    lines += [
        "## Policy losses",
        "",
        "`algo.policy_loss` is a name (its defaults), `{type: NAME, setting: value, ...}` or "
        "`{type: 'package.module:function', kwargs: {...}}`; override one setting with "
        "`algo.policy_loss.SETTING=value`. What each loss does: [docs/algorithms.md](../algorithms.md).",
        "",
    ]
    for name, loss in LOSS_MODELS.items():
        lines += [f"### type: {name}", "", model_doc(loss), "", *_rows(loss, "", skip=("type",)), ""]
    lines += [
        "### type: package.module:function",
        "",
        model_doc(CustomLoss),
        "",
        *_rows(CustomLoss, "", skip=("type",)),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"
