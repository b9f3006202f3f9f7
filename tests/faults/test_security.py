"""Nothing read from Redis or the network is ever unpickled or executed.

Walks the package's source with `ast` and fails on any call that deserialises objects
unsafely: pickle/cloudpickle/dill/marshal loads, torch.load without weights_only=True,
yaml.load without a safe loader, eval/exec.
"""

from __future__ import annotations

import ast
from pathlib import Path

import asyncrl

PACKAGE = Path(asyncrl.__file__).resolve().parent
UNSAFE_MODULE_CALLS = {
    ("pickle", "loads"),
    ("pickle", "load"),
    ("cloudpickle", "loads"),
    ("cloudpickle", "load"),
    ("dill", "loads"),
    ("dill", "load"),
    ("marshal", "loads"),
    ("marshal", "load"),
    ("shelve", "open"),
    ("jsonpickle", "decode"),
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def unsafe_calls(source: str, filename: str = "<src>") -> list[str]:
    """Every unsafe deserialising call in `source`, as 'file:line: what'."""
    found = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names]
            mod = getattr(node, "module", None) or ""
            if mod in ("pickle", "cloudpickle", "dill", "marshal") and any(n in ("loads", "load") for n in names):
                found.append(f"{filename}:{node.lineno}: from {mod} import {', '.join(names)}")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        parts = name.split(".")
        if len(parts) >= 2 and (parts[-2], parts[-1]) in UNSAFE_MODULE_CALLS:
            found.append(f"{filename}:{node.lineno}: {name}")
        if name in ("eval", "exec"):
            found.append(f"{filename}:{node.lineno}: {name}")
        if name.endswith("torch.load"):
            kw = {k.arg: k.value for k in node.keywords}
            ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
            if not ok:
                found.append(f"{filename}:{node.lineno}: torch.load without weights_only=True")
        if name.endswith("yaml.load") or name.endswith("yaml.load_all"):
            kw = {k.arg: _dotted(k.value) for k in node.keywords}
            if "Safe" not in kw.get("Loader", ""):
                found.append(f"{filename}:{node.lineno}: {name} without a safe Loader")
        if name.endswith("numpy.load") or name.endswith("np.load"):
            kw = {k.arg: k.value for k in node.keywords}
            if isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value is True:
                found.append(f"{filename}:{node.lineno}: {name}(allow_pickle=True)")
    return found


def test_package_never_deserialises_unsafely():
    problems = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10, "the walk found no package source"
    for path in files:
        problems += unsafe_calls(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not problems, "unsafe deserialisation in the package:\n" + "\n".join(problems)


def test_the_walker_catches_each_pattern():
    """The check has teeth: each forbidden pattern in a snippet is reported."""
    bad = {
        "import pickle\npickle.loads(b'')": "pickle.loads",
        "import cloudpickle\ncloudpickle.loads(b'')": "cloudpickle.loads",
        "import torch\ntorch.load('x')": "torch.load without weights_only=True",
        "import torch\ntorch.load('x', weights_only=False)": "torch.load without weights_only=True",
        "import yaml\nyaml.load('x')": "yaml.load without a safe Loader",
        "eval('1')": "eval",
        "from pickle import loads": "from pickle import loads",
        "import numpy as np\nnp.load('x', allow_pickle=True)": "allow_pickle=True",
    }
    for snippet, expected in bad.items():
        report = unsafe_calls(snippet)
        assert any(expected in r for r in report), (snippet, report)
    ok = "import torch, yaml\ntorch.load('x', weights_only=True)\nyaml.load('x', Loader=yaml.SafeLoader)"
    assert unsafe_calls(ok) == []
