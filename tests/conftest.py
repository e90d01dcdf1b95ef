import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from ckpt_factory import DraftSpec, write_draft  # noqa: E402


@pytest.fixture
def spec() -> DraftSpec:
    return DraftSpec()


@pytest.fixture
def draft_dir(tmp_path, spec):
    """A valid tiny DSpark checkpoint folder (single file)."""
    return write_draft(tmp_path / "draft", spec)
