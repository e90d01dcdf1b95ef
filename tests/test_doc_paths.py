"""Every path the docs, the README and the source's docstrings and comments name exists (moves leave no stale
references)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "dspark_cli"
# A path with a folder part, ending in a file name: `runtime/decode/markov.py`, `decode/markov.py`,
# tests/decode/test_markov.py, docs/eval.md, scripts/build_demo.py (URLs and other repositories excluded below).
PATH = re.compile(r"(?<![\w./:-])((?:[\w-]+/)+[\w-]+\.(?:py|md|json|jsonl|toml))\b")
BASES = (ROOT, ROOT / "src", PACKAGE, PACKAGE / "runtime", PACKAGE / "runtime" / "checkpoint", ROOT / "docs",
         ROOT / "tests")
FOREIGN = ("vllm/", "sglang/", "tensorrt_llm/", "deepspec/", "transformers/", "modelopt/", "speculators/",
           "python/sglang", "src/speculators", "examples/", "common/", "conversion/", "src/models", "model_executor",
           "v1/", "llm_args", "_torch/", "gguf", "models/", "huggingface", "torch/", "specforge/", "benchmark/",
           # other repositories' files the docs cite (DeepSpec, SGLang, z-lab DFlash, SpecForge)
           "dspark_components/", "speculative/", "config/dspark/", "dflash/", "configs/", "scripts/gates/", "docs/user_guide/",
           "qwen3/config.py", "gemma4/config.py", "build/")


def texts() -> list[Path]:
    return ([ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(PACKAGE.rglob("*.py")),
             *sorted((ROOT / "scripts").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))])


def exists(name: str, where: Path) -> bool:
    bases = (where.parent, *BASES)
    return any((base / name).exists() for base in bases)


def test_every_named_path_exists():
    missing = []
    for path in texts():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for name in PATH.findall(line):
                placeholder = name.split("/")[0].isupper() or name.startswith("my-")  # DRAFT/config.json
                if placeholder or name.startswith(FOREIGN) or "://" in line.split(name)[0][-12:]:
                    continue
                if not exists(name, path):
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)
