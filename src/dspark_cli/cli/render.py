"""Shared CLI output: rich consoles, JSON emission, the error → exit-code mapping, and tables that stay readable at
80 columns (`fitted`, `columns`)."""

from __future__ import annotations

import functools
import json
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import typer
from rich.console import Console
from typer.core import TyperCommand
from rich.markup import escape

from dspark_cli.cli import options
from dspark_cli.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED, DsparkError, Terminated
from dspark_cli.runtime.settings import SELECTOR

if TYPE_CHECKING:
    from rich.table import Table

console = Console()
err_console = Console(stderr=True)


@dataclass
class State:
    verbose: bool = False


state = State()

# The runtime names a setting ("the force option"), not its flag; the CLI prints the flag ("--force") in its place
# (docs/architecture.md, "The runtime raises, the CLI words").
_SETTING = re.compile(r"\bthe ([a-z][a-z0-9]*(?:-[a-z0-9]+)*) option\b")


def name_flags(text: str) -> str:
    """A runtime sentence (an error, a validate finding, a note) as the CLI prints it: each setting it names
    ("the force option", "the block-size option") becomes its flag ("--force", "--block-size")."""
    return _SETTING.sub(lambda match: f"--{match.group(1)}", text)


def with_flags(document: Any) -> Any:
    """A JSON-ready document with name_flags applied to every string in it."""
    if isinstance(document, str):
        return name_flags(document)
    if isinstance(document, dict):
        return {key: with_flags(value) for key, value in document.items()}
    if isinstance(document, list):
        return [with_flags(value) for value in document]
    return document


def quiet() -> None:
    """Silence the console of this process: under torchrun, rank 0 alone prints progress and reports."""
    console.quiet = True


class Command(TyperCommand):
    """Usage lines name a required argument plainly (`CHECKPOINT`), as click does, not `{CHECKPOINT}`."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [_unbraced(piece) for piece in super().collect_usage_pieces(ctx)]


def _unbraced(piece: str) -> str:
    return piece[1:-1] if piece.startswith("{") and piece.endswith("}") else piece


def handle_errors(command: Callable) -> Callable:
    """Turn DsparkError into one sentence on stderr and its exit code; Ctrl-C into exit 130, SIGTERM into 143.

    A ValueError is the runtime's word for a bad value it was given (the runtime is a library: it raises
    ValueError, not DsparkError, for a value the caller chose): one sentence and exit 2, like DsparkError.

    A failed write (full disk, quota, read-only, permission denied: files.is_disk_error) is one sentence and exit 2
    as well. Every message about what is on disk is true: the outputs already put in place by this command
    (files.written_outputs) are named after an error, and an interrupt says "nothing was written" only when nothing
    was (`stopped`).
    """

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from dspark_cli.runtime.io import outputs as files

        files.forget_written()
        try:
            return command(*args, **kwargs)
        except DsparkError as error:
            _print_error(_with_written(options.worded(error), files))
            raise typer.Exit(error.exit_code) from None
        except ValueError as error:
            _print_error(_with_written(sentence(str(error)), files))
            raise typer.Exit(EXIT_BAD_INPUT) from None
        except OSError as error:
            if not files.is_disk_error(error) and error.filename is None:
                raise  # not about a file the user named: a bug, shown with its traceback
            where = f" {error.filename}" if error.filename else ""
            if files.is_disk_error(error):
                verb = "write" if files.is_full_or_read_only(error) else "access"
                fix = "free space, or choose a place this user may write"
            else:
                verb, fix = "use", "choose another path"
            _print_error(_with_written(f"cannot {verb}{where}: {error.strerror or error}; {fix}.", files))
            raise typer.Exit(EXIT_BAD_INPUT) from None
        except (KeyboardInterrupt, Terminated) as stop:
            raise typer.Exit(stopped(stop)) from None

    return wrapper


def stopped(stop: KeyboardInterrupt | Terminated) -> int:
    """Ctrl-C or SIGTERM, wherever it landed (in a command, or before one started: while the CLI parsed its options,
    cli.main): what was kept said on stderr, and the exit code, 130 or 143. An interrupt may carry `kept`, a
    sentence saying what the command kept on disk (train's checkpoints)."""
    from dspark_cli.runtime.io import outputs as files

    terminated = isinstance(stop, Terminated)
    kept = files.kept_sentence(getattr(stop, "kept", None))
    err_console.print(f"[yellow]{'terminated' if terminated else 'interrupted'}[/]: {escape(kept)}", highlight=False)
    return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED


def _with_written(message: str, files) -> str:
    """An error message followed by the outputs this command had already put in place, if any."""
    written = files.written_outputs()
    if not written:
        return message
    return f"{message} Already written and kept: {', '.join(str(path) for path in written)}."


def _print_error(message: str) -> None:
    if state.verbose:
        err_console.print(traceback.format_exc(), markup=False, highlight=False)
    err_console.print(f"[bold red]error:[/] {escape(name_flags(message))}", highlight=False, soft_wrap=True)


def number(value: float | None, digits: int = 2) -> str:
    """A table cell: `value` with `digits` decimals, '-' when there is none."""
    return "-" if value is None else f"{value:.{digits}f}"


def drafting_stage(settings: dict) -> str:
    """A report heading's words for what follows the draft's backbone, from the resolved settings: "selector top-4"
    (a DFlash2 draft's path selector), "markov topk (top-16)", "markov dense"."""
    markov, topk = settings["markov"], settings["draft_topk"]
    if markov == SELECTOR:
        return f"selector top-{topk}"
    return f"markov {markov}" + (f" (top-{topk})" if topk and markov != "dense" else "")


def stage_label(markov: str) -> str:
    """The name of the per-round time of that stage: "selector stage" for a DFlash2 draft, else "Markov stage"."""
    return "selector stage" if markov == SELECTOR else "Markov stage"


def sentence(text: str) -> str:
    """A runtime message as a sentence: it ends with one full stop."""
    text = text.strip()
    return text if text.endswith((".", "?", "!")) else f"{text}."


def emit_json(document: Any, path: Path | str | None = None, force: bool = False) -> None:
    """Write `document` as JSON to stdout (path None or '-') or to a file: written beside it and renamed into place,
    exclusively unless `force` (a file that exists, or appears meanwhile, is never replaced without it). The path
    is checked before any work with outputs.check_output_files(..., force), which refuses an existing file."""
    text = json.dumps(document, indent=2, default=_json_default) + "\n"
    if path is None or str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    from dspark_cli.runtime.io.outputs import atomic_write_text

    atomic_write_text(Path(path).expanduser(), text, replace=force)


def _json_default(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


UNBOUNDED = 10_000  # columns: a table measured without wrapping


def fitted(out: Console, build: Callable[[tuple[int, int]], Table]) -> Table:
    """The table `build(padding)` makes, without cell padding when the padded one is wider than `out` (a pipe or
    a narrow terminal: 80 columns), so that every header stays whole."""
    table = build((0, 1))
    unwrapped = out.measure(table, options=out.options.update(max_width=UNBOUNDED)).maximum
    return build((0, 0)) if unwrapped > out.width else table


def columns(table: Table, names: tuple[str, ...]) -> None:
    """Right-aligned columns, the first left-aligned and folded; none narrower than its header's longest word."""
    for i, name in enumerate(names):
        table.add_column(name, justify="right" if i else "left", overflow="fold",
                         min_width=max(len(word) for word in name.split()))
