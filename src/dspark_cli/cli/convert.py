"""`dspark convert`: a draft rewritten for another engine (llama.cpp's dflash GGUF)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from dspark_cli.cli import options
from dspark_cli.cli.render import console, emit_json, handle_errors


class Format(str, Enum):
    gguf = "gguf"


def register(app: typer.Typer) -> None:
    app.command("convert")(convert)


@handle_errors
def convert(
    draft: str = typer.Argument(..., metavar="DRAFT", help="Draft checkpoint folder (DeepSpec format)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output file (written atomically; must not exist)."),
    to: Format = typer.Option(
        ..., "--to", help="gguf: llama.cpp's dflash GGUF (llama-server --spec-type draft-dspark)."
    ),
    target: str = typer.Option(..., "--target", help="The target's folder: the GGUF takes its tokenizer."),
    force: options.force("Replace OUT if it exists.") = False,
    json_path: options.json_path("the summary") = None,
) -> None:
    """Write the draft in another engine's format; refused, in one sentence, when it cannot be faithful."""
    from dspark_cli.runtime.convert.gguf import convert_to_gguf
    from dspark_cli.runtime.io.outputs import check_output_file, local_inputs

    check_output_file(json_path, local_inputs("draft", [draft]) + [("output", out)], "--json file")
    summary = convert_to_gguf(draft, out, target=target, force=force)
    if json_path is not None:
        emit_json(summary, json_path)
    if not options.to_stdout(json_path):
        console.print(f"wrote {summary['output']}: llama.cpp {summary['architecture']} GGUF, {summary['tensors']} "
                      f"tensors, target layers {summary['target_layers']} (llama.cpp's numbering)")
