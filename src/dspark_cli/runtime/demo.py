"""The demo target/draft pairs that ship inside the package (built by `scripts/build_demo.py`): the attention pair
(a Qwen3 target, short name "demo", the default) and the hybrid pair (a Qwen3.5-style Gated DeltaNet / attention
target, short name "demo-hybrid")."""

from __future__ import annotations

from pathlib import Path

from dspark_cli.errors import DsparkError, SettingError

DEMO_DIR = Path(__file__).parent / "assets" / "demo"  # target/ (HF Qwen3 + tokenizer), draft/ (DSpark), MODEL_CARD.md
HYBRID_DEMO_DIR = Path(__file__).parent / "assets" / "demo-hybrid"  # the same, with a Qwen3.5-style hybrid target
DEMO_PAIRS = ("demo", "demo-hybrid")  # the short names: the attention pair (the default), the hybrid pair

# What `dspark generate` continues when it is given the demo pair and no prompt: the demo models were trained on
# Python's standard-library sources, so code is what they can continue.
DEMO_PROMPTS = (
    "def read_config(path):\n    \"\"\"Return the settings stored in the file at path.\"\"\"\n",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, key):\n",
)


def demo_pair(name: str = "demo") -> tuple[Path, Path]:
    """(target_dir, draft_dir) of the shipped demo pair called `name` (one of DEMO_PAIRS); DsparkError when it
    has not been built, SettingError when there is no such pair."""
    folder = demo_folder(name)
    target, draft = folder / "target", folder / "draft"
    if not (target / "config.json").is_file() or not (draft / "config.json").is_file():
        build = "" if name == "demo" else f" with the pair option {name}"
        raise DsparkError(f"the {name} pair is not built yet; run `python scripts/build_demo.py`{build} or pass the "
                          "target option and the draft option")
    return target, draft


def demo_folder(name: str) -> Path:
    """The folder of the shipped demo pair called `name`; SettingError for a name not in DEMO_PAIRS."""
    if name == "demo":
        return DEMO_DIR
    if name == "demo-hybrid":
        return HYBRID_DEMO_DIR
    raise SettingError("pair", f"must be one of {', '.join(DEMO_PAIRS)} (the shipped demo pairs), not {name!r}")
