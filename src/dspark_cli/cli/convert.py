"""`dspark convert`: a draft rewritten for another engine (llama.cpp's dflash GGUF) or in vLLM's other layout; a
target as llama.cpp's GGUF."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from dspark_cli.cli import options
from dspark_cli.cli.render import console, emit_json, handle_errors


class Format(str, Enum):
    gguf = "gguf"
    deepspec = "deepspec"
    speculators = "speculators"


def register(app: typer.Typer) -> None:
    app.command("convert")(convert)


@handle_errors
def convert(
    draft: str = typer.Argument(..., metavar="DRAFT", help="Draft checkpoint folder (DeepSpec or speculators); "
                                "for --to gguf also a target folder (a Qwen3 or Qwen2 model), converted without "
                                "--target."),
    out: Path = typer.Option(..., "--out", "-o", help="Output file or folder (written atomically; must not exist)."),
    to: Format = typer.Option(
        ..., "--to", help="gguf: llama.cpp's dflash GGUF for a draft (llama-server -md with --spec-type "
        "draft-dspark), its qwen3 GGUF for a target (llama-server -m); deepspec or "
        "speculators: the draft folder in that DSpark layout (both read by vLLM)."
    ),
    target: str = typer.Option(None, "--target", help="The target: its folder for gguf (the GGUF takes its "
                               "tokenizer); its name or path for speculators (the verifier); unused for deepspec."),
    force: options.force("Replace OUT if it exists.") = False,
    json_path: options.json_path("the summary") = None,
) -> None:
    """Write the draft in another engine's format; refused, in one sentence, when it cannot be faithful."""
    from dspark_cli.runtime.io.outputs import check_output_file, local_inputs

    check_output_file(json_path, local_inputs("draft", [draft]) + [("output", out)], "--json file")
    summary = _to_gguf(draft, out, target, force) if to == Format.gguf else _to_layout(draft, out, to, target, force)
    line = summary.pop("line")
    if json_path is not None:
        emit_json(summary, json_path)
    if not options.to_stdout(json_path):
        console.print(line)


def _to_gguf(draft: str, out: Path, target: str | None, force: bool) -> dict:
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.convert.gguf import convert_to_gguf
    from dspark_cli.runtime.convert.target_gguf import is_target

    if is_target(draft):
        return _target_to_gguf(draft, out, target, force)
    if not target:
        raise DsparkError("a GGUF takes its tokenizer from the target, so the target option must name its folder.")
    summary = convert_to_gguf(draft, out, target=target, force=force)
    return {**summary, "line": f"wrote {summary['output']}: llama.cpp {summary['architecture']} GGUF, "
            f"{summary['tensors']} tensors, target layers {summary['target_layers']} (llama.cpp's numbering)"}


def _to_layout(draft: str, out: Path, to: Format, target: str | None, force: bool) -> dict:
    from dspark_cli.runtime.convert.layouts import convert_layout

    summary = convert_layout(draft, out, to.value, target=target, force=force)
    return {**summary, "line": f"wrote {summary['output']}: the {to.value} layout, {summary['tensors']} tensors"}


def _target_to_gguf(source: str, out: Path, target: str | None, force: bool) -> dict:
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.convert.target_gguf import convert_target_to_gguf

    if target:
        raise DsparkError(f"{source} is a model, not a draft; --target names a draft's target, so drop it to "
                          "convert the model itself.")
    summary = convert_target_to_gguf(source, out, force=force)
    return {**summary, "line": f"wrote {summary['output']}: llama.cpp {summary['architecture']} GGUF, "
            f"{summary['tensors']} tensors, pre-tokenizer {summary['pre_tokenizer']}"}
