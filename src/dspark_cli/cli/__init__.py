"""The `dspark` Typer app. Command modules import only typer here; heavy imports live inside commands."""

import os
import signal

import typer

from dspark_cli import __version__
from dspark_cli.cli import render
from dspark_cli.errors import Terminated

app = typer.Typer(
    name="dspark",
    help="Validate, quantize, run, profile and train DSpark speculative-decoding drafts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dspark {__version__}")
        raise typer.Exit()


@app.callback()
def _global_options(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show tracebacks and debug detail on errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    render.state.verbose = verbose


def _register() -> None:
    from dspark_cli.cli import (bench, calibrate, convert, eval, features, generate, plan, quantize, regen, serve,
                                train, validate)

    for module in (validate, quantize, convert, generate, eval, calibrate, plan, bench, regen, features, train,
                   serve):
        module.register(app)
    typers = [app] + [group.typer_instance for group in app.registered_groups]
    for command in (command for typer_app in typers for command in typer_app.registered_commands):
        command.cls = render.Command


_register()


def main() -> None:
    # Idle OpenMP threads sleep instead of spinning: on a shared CPU, spinning threads made one decode step 16x
    # slower. Set before torch is imported (commands import it lazily); an explicit user setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        app()
    except Terminated as stop:  # before a command's handle_errors ran: while Typer parsed the options
        raise SystemExit(render.stopped(stop)) from None
    except SystemExit as done:
        if done.code and _one_of_many_ranks():
            _exit_at_once(done.code)
        raise


RANK_EXIT_GRACE_S = 3.0  # how long a failing rank waits for its peers to fail alike before it exits


def _one_of_many_ranks() -> bool:
    """Whether this process is one rank of a torchrun job (torchrun sets WORLD_SIZE for each rank)."""
    size = os.environ.get("WORLD_SIZE", "1")
    return size.isdigit() and int(size) > 1


def _exit_at_once(code: object) -> None:
    """End a failing rank of a torchrun job with the exit code it chose, whatever torchrun does meanwhile.

    torchrun SIGTERMs every other rank as soon as one exits. A rank still tearing the interpreter down after printing
    its refusal was then reported killed (-15), and a rank a moment behind was ended before it could say why. So a
    failing rank skips the teardown (its outputs were cleaned up while the error unwound), waits RANK_EXIT_GRACE_S
    for the others to reach the same refusal, and a SIGTERM in that wait ends it with its own code."""
    import sys
    import time

    status = code if isinstance(code, int) else 1
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(status))
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    time.sleep(RANK_EXIT_GRACE_S)
    os._exit(status)


def _raise_terminated(signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C (temporary outputs removed), then render.handle_errors exits 143. Further
    SIGTERMs are ignored so that the cleanup can finish (SIGKILL still stops the process)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()
