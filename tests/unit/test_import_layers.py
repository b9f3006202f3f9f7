"""The package's import graph runs one way: each top-level part of asyncrl imports only the
parts below it in LAYERS, so there is no cycle between parts.

Every import counts, the ones inside functions and under ``if TYPE_CHECKING`` too: an import
moved into a function still makes its module depend on the other part; it only hides the
edge from Python until the function runs. A helper two parts share belongs in the lower one
(or in a low-level module such as asyncrl/infra.py or asyncrl/rundir/), not behind a
function-level import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "asyncrl"

LAYERS = (
    "types",  # the records passed between components (numpy only)
    "infra",  # a free port, a Ray actor's state
    "lifeline",  # stops what a run started once its process is gone (stdlib and psutil only)
    "rundir",  # a run directory's file names and checkpoint listing
    "algo",  # the math and its parameter types
    "config",  # the typed config tree (holds algo's parameter types)
    "seeding",
    "data",  # codec, batches, micro-batches, the token ban
    "queue",
    "sync",
    "monitor",  # reads the queue's metrics stream and run directories, nothing that trains
    "learner",  # told the task's token ban by its caller, never imports the environments
    "rollout",
    "control",  # wires all of the above
    "cli",
)
"""The parts of the package, lowest first: a part may import the parts before it, never after.
Two parts that need not know each other (the learner and the generators) still get an order:
the lower one then may not import the higher."""

SKIPPED = ("testing",)
"""Harnesses that are not part of the shipped layering."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The absolute module names an import statement names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join([*base, node.module] if node.module else base)
    else:
        source = node.module or ""
    # `from asyncrl import seeding` names the part in the imported name, not in the module.
    return [f"{source}.{alias.name}" for alias in node.names] if source == "asyncrl" else [source]


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "asyncrl" and len(parts) > 1 else None


def _edges() -> list[tuple[str, str, str, str]]:
    """(where as file:line, importing part, imported part, imported module) for every import in
    the package that crosses from one part to another."""
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        source = _part(module)
        if source is None or source in SKIPPED:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(module, path.name == "__init__.py", node):
                part = _part(target)
                if part is not None and part != source:
                    where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                    edges.append((where, source, part, target))
    return edges


def test_every_part_of_the_package_has_a_layer():
    found = {_part(_module_name(p)) for p in PACKAGE.rglob("*.py")} - {None, *SKIPPED}
    missing = sorted(found - set(LAYERS))
    assert not missing, f"parts of asyncrl with no place in LAYERS (add them where they belong): {missing}"
    assert len(set(LAYERS)) == len(LAYERS)


def test_imports_only_go_down_the_layers():
    rank = {part: i for i, part in enumerate(LAYERS)}
    upward = [
        f"{where}: {source} -> {part} (imports {target}; {part} is above {source} in LAYERS)"
        for where, source, part, target in _edges()
        if part in rank and source in rank and rank[part] > rank[source]
    ]
    if upward:  # pytest.fail: an assert's message would be cut after a few lines
        pytest.fail("imports against the layer order:\n" + "\n".join(upward), pytrace=False)


def test_the_check_sees_function_level_and_relative_imports(tmp_path):
    """The walk above must catch the imports that hid the old cycles: inside a function, and
    relative ones (resolved against the importing module's package)."""
    code = "def f():\n    from ..control.cluster import actor_state\n    from asyncrl import cli\n"
    node_a, node_b = (n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.ImportFrom))
    assert _targets("asyncrl.learner.group", False, node_a) == ["asyncrl.control.cluster"]
    assert _targets("asyncrl.learner", True, node_a) == ["asyncrl.control.cluster"]
    assert _targets("asyncrl.learner.group", False, node_b) == ["asyncrl.cli"]
    assert [_part(t) for t in _targets("asyncrl.learner", True, node_b)] == ["cli"]


@pytest.mark.parametrize("part", ["types", "infra", "rundir"])
def test_the_lowest_parts_import_nothing_from_the_package(part):
    assert not [e for e in _edges() if e[1] == part], f"asyncrl.{part} must stay at the bottom"


def test_the_package_root_imports_no_part():
    """Every import of any part runs asyncrl/__init__.py first: an import there would make
    every part depend on the imported one."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    named = [t for n in imports for t in _targets("asyncrl", True, n) if t.split(".")[0] == "asyncrl"]
    assert not named, f"asyncrl/__init__.py imports {named}"


HEAVY = ("torch", "vllm", "ray", "transformers", "datasets", "starlette", "uvicorn", "wandb")
"""Libraries that take seconds to import (or pull a server stack): the modules a command
needs before its config is valid must not load them at import time."""


def _heavy_loaded_by(module: str) -> list[str]:
    """The HEAVY libraries that importing `module` loads, in a fresh interpreter."""
    code = f"import sys, {module}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.split()


@pytest.mark.parametrize(
    "module",
    ["asyncrl.config", "asyncrl.cli", "asyncrl.control.train", "asyncrl.control.preflight", "asyncrl.control.export"],
)
def test_start_up_modules_load_no_heavy_library(module):
    """`asyncrl train --check` and `--help-config` answer in about a second, and `asyncrl
    train` rejects a bad config before torch, Ray or vLLM load: the imports that would load
    them stay inside the functions that need them."""
    loaded = _heavy_loaded_by(module)
    assert loaded == [], f"import {module} loads {loaded}"


def test_an_export_it_cannot_do_is_refused_before_torch_loads(tmp_path):
    """`asyncrl export RUN --step N` with no such checkpoint fails at once, not after the
    seconds torch and transformers take to import."""
    (tmp_path / "config.yaml").write_text("{}\n")
    code = (
        "import sys\n"
        "from asyncrl.control.export import export_checkpoint\n"
        "try:\n"
        f"    export_checkpoint({str(tmp_path)!r}, step=3)\n"
        "except FileNotFoundError as e:\n"
        "    print('refused:', e)\n"
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    refused, loaded = out.stdout.splitlines()
    assert refused.startswith("refused: ") and "no complete checkpoint" in refused, out.stdout
    assert loaded.split() == [], loaded


def test_the_start_up_check_sees_a_heavy_import():
    assert "torch" in _heavy_loaded_by("asyncrl.learner")
