"""The installed package never imports the test suite's harnesses (tests.support): they need a
checkout (configs/, the repository root as working directory) and the wheel does not ship them."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "asyncrl"


def _imported_modules(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):  # function-level imports included
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_nothing_in_asyncrl_imports_the_tests():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name in _imported_modules(ast.parse(path.read_text(), str(path)))
        if name == "tests" or name.startswith("tests.")
    ]
    assert not offenders, offenders
    assert not list((PACKAGE / "testing").glob("*.py"))  # the harnesses' old home inside the package
