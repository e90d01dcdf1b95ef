"""The layer rules of docs/architecture.md that a scan of the source can check."""

from __future__ import annotations

import ast
import re
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "src" / "dspark_cli" / "runtime"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# Files whose strings name another program's flags (not dspark's), relative to runtime/.
FLAG_ALLOWED = {
    "engines/vllm.py",  # vLLM's own command-line flags: the argv dspark builds for `vllm serve`
    "engines/sglang.py",  # SGLang's server flags: the `sglang.launch_server` argv
    "engines/trtllm.py",  # trtllm-serve's flags: its argv
    "engines/llamacpp.py",  # llama-server's own flags: the argv dspark builds for it
    "engines/seam.py",  # the engines' shared --port flag, checked against their extra arguments
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


# Layers, top to bottom (docs/architecture.md): a module imports modules of lower layers, of its own folder, and
# the shared modules; never a higher layer or a sibling folder of the same layer.
LAYERS = [
    ("cli",),
    ("runtime.train", "runtime.bench", "runtime.quantize", "runtime.convert", "runtime.regen", "runtime.session",
     "runtime.probe"),
    ("runtime.pair",),
    ("runtime.engines",),
    ("runtime.decode", "runtime.measure"),
    ("runtime.model",),
    ("runtime.checkpoint",),
    ("runtime.settings",),
    ("runtime.rounds",),
    ("runtime.io", "kernels"),
]
SHARED = ("errors", "triton_mode", "runtime.devices", "runtime.units", "runtime.threads", "runtime.demo",
          "runtime.distributed")
# The torch-free layers: validate, serve, plan and calibrate's reading run without torch installed.
TORCH_FREE = ("runtime.checkpoint", "runtime.io", "runtime.settings", "runtime.rounds", "runtime.engines",
              "runtime.measure", "runtime.convert", "runtime.regen")


def _room(module: str) -> tuple[int, str] | None:
    """(layer index, folder) of a dspark_cli module name without the package prefix; None for a shared one."""
    if module.startswith(SHARED):
        return None
    for index, rooms in enumerate(LAYERS):
        for room in rooms:
            if module == room or module.startswith(room + "."):
                return index, room
    raise AssertionError(f"{module} is in no layer of LAYERS")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported dspark_cli module without the prefix) of every import in the file, function-level too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dspark_cli."):
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.startswith("dspark_cli.")]
        for name in names:
            module = name.removeprefix("dspark_cli.")
            package = PACKAGE / module.replace(".", "/")
            if module != "runtime" and (package.with_suffix(".py").exists() or (package / "__init__.py").exists()):
                found.append((node.lineno, module))
    return found


PACKAGE = RUNTIME.parent


def test_imports_run_down_the_layers():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
        if module in ("__init__", "__main__", "runtime") or "assets" in module:
            continue
        here = _room(module)
        for line, imported in _imports(path):
            there = _room(imported)
            if here is None or there is None or there[1] == here[1]:
                if here is None and there is not None:
                    wrong.append(f"{module}:{line} shared module imports {imported}")
                continue
            if there[0] <= here[0]:
                wrong.append(f"{module}:{line} imports {imported} ({'sibling' if there[0] == here[0] else 'higher'})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_torch_free_layers_import_without_torch():
    import subprocess
    import sys

    modules = sorted({path.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
                      for path in PACKAGE.rglob("*.py")})
    chosen = [f"dspark_cli.{m}" for m in modules if m.startswith(TORCH_FREE)]
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'transformers', 'triton', 'modelopt'):\n"
            "            raise ImportError(f'{name} is blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            f"import importlib\nfor m in {chosen!r}:\n    importlib.import_module(m)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONPATH": str(PACKAGE.parent), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
