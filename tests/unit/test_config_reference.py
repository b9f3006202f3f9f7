"""The guide's configuration reference is generated from the schema and must match it."""

from __future__ import annotations

import re
from pathlib import Path

from asyncrl.config import Config
from asyncrl.config.losses import LOSS_MODELS
from asyncrl.config.reference import REFERENCE_PATH, reference_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_committed_reference_is_up_to_date():
    committed = (ROOT / REFERENCE_PATH).read_text(encoding="utf-8")
    assert committed == reference_markdown(), (
        f"{REFERENCE_PATH} is out of date with asyncrl/config/: run python scripts/config_reference.py"
    )


def test_reference_lists_every_field_of_every_section_and_loss():
    text = reference_markdown()
    for section, field in Config.model_fields.items():
        assert f"\n## {section}\n" in text
        for name in field.annotation.model_fields:  # type: ignore[union-attr]
            assert f"| `{section}.{name}` |" in text, f"{section}.{name} missing from the reference"
    for loss in LOSS_MODELS:
        assert f"\n### type: {loss}\n" in text
    # Nested sections and list entries get their own tables.
    assert "| `algo.correction.tis_cap` |" in text
    assert "| `rollout.rewards[i].fn` |" in text


def test_table_cells_escape_pipes():
    # A Literal type is written 'a' | 'b': an unescaped pipe would split the table row.
    row = next(line for line in reference_markdown().splitlines() if line.startswith("| `algo.correction.tis` |"))
    cells = re.split(r"(?<!\\)\|", row)
    assert len(cells) == 6, cells  # empty, field, type, default, description, empty
