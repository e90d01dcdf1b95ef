"""Every command's --help shows every option's help text whole: rich reads `[...]` as markup and drops it, which
once turned "Draft decoder layers [default: 1]." into "Draft decoder layers ."."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from dspark_cli.cli import app

wide = CliRunner(env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})


def _commands(command, path=()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


COMMANDS = [(path, command) for path, command in _commands(typer.main.get_command(app)) if path]


def _flat(text: str) -> str:
    """The rendered page as one line: box borders and runs of blanks collapsed."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


@pytest.mark.parametrize("path, command", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_every_option_help_is_shown_whole(path, command):
    result = wide.invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    page = _flat(result.output)
    for line in result.output.splitlines():
        assert not re.search(r"\w \.\s*(│|$)", line), f"a help line lost text before its full stop: {line.strip()}"
    for param in command.params:
        help_text = " ".join((getattr(param, "help", None) or "").split())
        if help_text:
            assert help_text in page, f"dspark {' '.join(path)}: the help of {param.name} is not shown whole"
