"""The default thread count of `dspark generate` (runtime/threads.py)."""

import pytest
import torch
from torch import nn

from dspark_cli.runtime import threads as threads_module
from dspark_cli.runtime.threads import SMALL_MODEL_PARAMETERS, check_threads, default_threads, parameter_count, set_threads


def test_small_models_get_one_thread_large_ones_every_core():
    assert default_threads(8_000_000, 2) == 1  # the demo pair
    assert default_threads(SMALL_MODEL_PARAMETERS - 1, 16) == 1
    assert default_threads(SMALL_MODEL_PARAMETERS, 16) == 16
    assert default_threads(600_000_000, 2) == 2
    assert default_threads(600_000_000, None) == 1  # core count unknown
    assert default_threads(600_000_000, 16, load=3.4) == 13  # the idle cores only
    assert default_threads(600_000_000, 2, load=1.2) == 1 and default_threads(600_000_000, 2, load=0.3) == 2
    assert default_threads(600_000_000, 2, load=9.0) == 1  # a busy machine: never below 1
    assert default_threads(1_500_000, 16, load=0.0) == 1


def test_shared_parameters_count_once():
    shared = nn.Embedding(10, 4)
    target, draft = nn.Sequential(shared, nn.Linear(4, 3)), nn.Sequential(shared, nn.Linear(4, 2, bias=False))
    assert parameter_count(target, draft) == 40 + 15 + 8


def test_set_threads_applies_the_request_or_the_default(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads_module, "_usable_cores", lambda: 3)
    monkeypatch.setattr(threads_module, "_load", lambda: 0.0)
    monkeypatch.setattr(threads_module, "SMALL_MODEL_PARAMETERS", 50)
    small, large = nn.Linear(4, 4), nn.Linear(10, 10)  # 20 and 110 parameters
    try:
        assert set_threads(None, small) == 1 and torch.get_num_threads() == 1
        assert set_threads(None, large) == 3 and torch.get_num_threads() == 3
        assert set_threads(2, small) == 2 and torch.get_num_threads() == 2  # an explicit request wins
    finally:
        torch.set_num_threads(before)


def test_generate_sets_threads_from_the_option_or_the_model_size(monkeypatch):
    from typer.testing import CliRunner

    from dspark_cli.cli import app

    calls = []
    real = threads_module.set_threads
    monkeypatch.setattr(threads_module, "set_threads", lambda requested, *models: calls.append(
        (requested, parameter_count(*models))) or real(requested, *models))
    runner = CliRunner()
    two = str(min(2, threads_module._usable_cores() or 1))  # --threads above the usable cores is refused
    for extra in (["--threads", two], []):
        result = runner.invoke(app, ["generate", "def f(x):", "--max-new-tokens", "3", "--device", "cpu", *extra])
        assert result.exit_code == 0, result.output
    (explicit, demo_size), (default, same_size) = calls
    assert (explicit, default) == (int(two), None) and demo_size == same_size
    assert 1_000_000 < demo_size < SMALL_MODEL_PARAMETERS  # the demo pair: one thread by default
    assert torch.get_num_threads() == 1
    refused = runner.invoke(app, ["generate", "def f(x):", "--threads", "0"])
    assert refused.exit_code == 2


def test_thread_counts_are_bounded_by_the_usable_cores(monkeypatch):
    """More threads than cores only wait for each other, and 100,000 exhaust the host's process ids."""
    monkeypatch.setattr(threads_module, "_usable_cores", lambda: 4)
    check_threads(None)
    check_threads(1)
    check_threads(4)
    for bad in (0, 5, 100_000):
        with pytest.raises(ValueError, match="between 1 and the 4 CPU cores"):
            check_threads(bad)
    with pytest.raises(ValueError):
        set_threads(100_000)
