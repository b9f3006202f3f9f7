"""Parity-suite fixtures: the tiny model in the variants the suite needs (with a chat template,
with dropout in its config), and the report every variant adds its row to: a table printed at
the end of the test session and a JSON file under the session's tmp dir."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.parity import ParityResult, format_table

# Prefix-stable, as multi-turn needs (a conversation's rendering extends its earlier turns').
TEMPLATE = (
    "<bos>{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_RESULTS: list[ParityResult] = []
_REPORT: dict[str, Path] = {}


def _variant_of(tiny_model_dir: str, dest: Path, *, dropout: float = 0.0, template: str = TEMPLATE) -> str:
    """The tests' tiny model copied to `dest`, its tokenizer given a chat template, and
    attention dropout set in its config (vLLM ignores it; a learner in train mode does not)."""
    from transformers import AutoTokenizer

    shutil.copytree(tiny_model_dir, dest)
    tok = AutoTokenizer.from_pretrained(dest)
    tok.chat_template = template
    tok.save_pretrained(dest)
    if dropout:
        config = json.loads((dest / "config.json").read_text())
        config["attention_dropout"] = dropout
        (dest / "config.json").write_text(json.dumps(config, indent=2))
    return str(dest)


@pytest.fixture(scope="session")
def chat_model(tiny_model_dir, tmp_path_factory) -> str:
    return _variant_of(tiny_model_dir, tmp_path_factory.mktemp("parity-model") / "chat")


@pytest.fixture(scope="session")
def tools_model(tiny_model_dir, tmp_path_factory) -> str:
    """With a template that shows the tools (by name: the tiny alphabet has no JSON braces)."""
    from tests.support.tools import TINY_TOOLS_TEMPLATE

    return _variant_of(tiny_model_dir, tmp_path_factory.mktemp("parity-model") / "tools", template=TINY_TOOLS_TEMPLATE)


@pytest.fixture(scope="session")
def dropout_model(tiny_model_dir, tmp_path_factory) -> str:
    return _variant_of(tiny_model_dir, tmp_path_factory.mktemp("parity-model") / "dropout", dropout=0.1)


@pytest.fixture(scope="session")
def parity_report(tmp_path_factory):
    """record(result): adds a variant's row, rewrites the JSON report and prints the table."""
    path = tmp_path_factory.getbasetemp() / "parity" / "parity.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _REPORT["path"] = path

    def record(result: ParityResult) -> None:
        _RESULTS[:] = [r for r in _RESULTS if r.variant != result.variant] + [result]
        path.write_text(json.dumps([r.to_dict() for r in _RESULTS], indent=2))
        print(f"\n{format_table(_RESULTS)}\nparity report: {path}")

    return record


def pytest_terminal_summary(terminalreporter):
    if _RESULTS:
        terminalreporter.section("log-prob parity (learner.lr=0; D, E: LoRA trained on-policy): per variant")
        terminalreporter.write_line(format_table(_RESULTS))
        terminalreporter.write_line(f"parity report: {_REPORT['path']}")
