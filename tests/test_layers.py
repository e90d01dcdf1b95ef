"""The layer rules of docs/architecture.md that a scan of the source can check."""

from __future__ import annotations

import ast
import re
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "src" / "dspark_cli" / "runtime"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# Files whose messages still name flags, relative to runtime/; the list is to be emptied, not grown.
FLAG_ALLOWED = {
    "engines/vllm.py",  # owned by the settings/engine work, cleaned there
}


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the module, class and function docstring nodes of `tree`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_no_runtime_message_names_a_flag():
    """The runtime names a setting ("the force option"), the CLI prints its flag (render.name_flags): no string in
    runtime/ outside docstrings holds `--flag`."""
    found = []
    for path in sorted(RUNTIME.rglob("*.py")):
        name = path.relative_to(RUNTIME).as_posix()
        if name in FLAG_ALLOWED:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                found += [f"{name}:{node.lineno}: {flag}" for flag in FLAG.findall(node.value)]
    assert not found, "runtime messages naming flags:\n" + "\n".join(found)
