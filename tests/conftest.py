import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from ckpt_factory import DraftSpec, write_draft  # noqa: E402


@pytest.fixture
def spec() -> DraftSpec:
    return DraftSpec()


@pytest.fixture
def draft_dir(tmp_path, spec):
    """A valid tiny DSpark checkpoint folder (single file)."""
    return write_draft(tmp_path / "draft", spec)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes: a second torch thread only adds contention on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/fixtures/golden/demo_trace.json from the shipped demo pair (a deliberate rebuild)")
