"""The demo target/draft pair that ships inside the package (built by `scripts/build_demo.py`)."""

from __future__ import annotations

from pathlib import Path

from dspark_cli.errors import DsparkError

DEMO_DIR = Path(__file__).parent / "assets" / "demo"  # target/ (HF Qwen3 + tokenizer), draft/ (DSpark), MODEL_CARD.md

# What `dspark generate` continues when it is given the demo pair and no prompt: the demo models were trained on
# Python's standard-library sources, so code is what they can continue.
DEMO_PROMPTS = (
    "def read_config(path):\n    \"\"\"Return the settings stored in the file at path.\"\"\"\n",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, key):\n",
)


def demo_pair() -> tuple[Path, Path]:
    """(target_dir, draft_dir) of the shipped demo pair; DsparkError when it has not been built."""
    target, draft = DEMO_DIR / "target", DEMO_DIR / "draft"
    if not (target / "config.json").is_file() or not (draft / "config.json").is_file():
        raise DsparkError("the demo pair is not built yet; run `python scripts/build_demo.py` or pass the target "
                          "option and the draft option")
    return target, draft
