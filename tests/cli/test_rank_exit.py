"""A failing rank of a torchrun job ends with its own exit code: torchrun SIGTERMs the other ranks as soon as one
exits, and a rank still in the interpreter's teardown after printing its refusal was reported killed (-15; 5 of 6
torchrun runs of `eval --dist-timeout inf` before this). It skips the teardown, waits a grace period for its peers to
fail alike, and torchrun's SIGTERM in that wait ends it with its own code. One process exits the ordinary way."""

from __future__ import annotations

import signal
import sys

import pytest

import dspark_cli.cli as cli


class ExitedAtOnce(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


@pytest.fixture
def run_main(monkeypatch):
    def at_once(code: int):
        raise ExitedAtOnce(code)

    monkeypatch.setattr(cli.os, "_exit", at_once)
    handler = signal.getsignal(signal.SIGTERM)  # main() installs its own; this test process keeps pytest's

    def run(*argv: str):
        monkeypatch.setattr(sys, "argv", ["dspark", *argv])
        try:
            cli.main()
        finally:
            signal.signal(signal.SIGTERM, handler)

    return run


def test_a_failing_rank_waits_for_its_peers_then_exits_with_its_code(run_main, monkeypatch, tmp_path, capsys):
    waits = []
    monkeypatch.setattr("time.sleep", waits.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ExitedAtOnce) as exited:
        run_main("validate", str(tmp_path / "missing-draft"))
    assert exited.value.code == 2 and waits == [cli.RANK_EXIT_GRACE_S]
    assert "missing-draft" in capsys.readouterr().err  # the sentence was out before the wait


def test_torchruns_sigterm_during_the_wait_ends_the_rank_with_its_own_code(run_main, monkeypatch, tmp_path):
    def sigterm_arrives(seconds):
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # what torchrun sends when a peer exits first

    monkeypatch.setattr("time.sleep", sigterm_arrives)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ExitedAtOnce) as exited:
        run_main("validate", str(tmp_path / "missing-draft"))
    assert exited.value.code == 2  # not 143 (Terminated) nor -15


@pytest.mark.parametrize("world_size", [None, "1"])
def test_one_process_exits_the_ordinary_way(run_main, monkeypatch, tmp_path, world_size):
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises(SystemExit) as done:
        run_main("validate", str(tmp_path / "missing-draft"))
    assert done.value.code == 2


def test_a_rank_that_succeeds_exits_the_ordinary_way(run_main, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as done:
        run_main("--version")
    assert done.value.code in (0, None)
