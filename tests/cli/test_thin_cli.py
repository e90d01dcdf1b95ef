"""The CLI is a thin skin over the runtime's faces (docs/architecture.md): no command module reaches into the
networks (runtime/model/); what a command needs of them goes through a runtime function."""

from __future__ import annotations

import ast
from pathlib import Path

import dspark_cli.cli

CLI = Path(dspark_cli.cli.__file__).parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_cli_module_imports_the_model_package():
    offenders = {path.name: sorted(name for name in _imports(path) if name == "dspark_cli.runtime.model"
                                   or name.startswith("dspark_cli.runtime.model."))
                 for path in sorted(CLI.rglob("*.py"))}
    assert not {name: found for name, found in offenders.items() if found}


def test_the_scan_sees_function_level_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from dspark_cli.runtime.model.target import TargetModel\n")
    assert "dspark_cli.runtime.model.target" in _imports(module)
