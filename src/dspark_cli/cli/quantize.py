"""`dspark quantize`: the Markov head's markov_w2 (--scope markov) or the draft's Linear layers (--scope draft) in
NVFP4 W4A16 (ModelOpt format) that vLLM loads."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from dspark_cli.cli import options
from dspark_cli.cli.render import console, emit_json, err_console, handle_errors
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.units import format_bytes


class Engine(str, Enum):
    modelopt = "modelopt"
    torch = "torch"


class Scope(str, Enum):
    markov = "markov"
    draft = "draft"


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize)


@handle_errors
def quantize(
    checkpoint: str = typer.Argument(
        ..., metavar="CHECKPOINT", help="Draft checkpoint: a local folder or a Hugging Face hub id."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder (written atomically; must not exist)."),
    engine: Engine = typer.Option(
        Engine.modelopt, "--engine", help="modelopt: ModelOpt's NVFP4 quantizer; torch: dspark's bit-identical one."
    ),
    scope: Scope = typer.Option(
        Scope.markov, "--scope",
        help="markov: markov_w2 only; draft: every decoder Linear layer and fc (NVFP4 W4A16).",
    ),
    lm_head: bool = typer.Option(
        False, "--lm-head/--no-lm-head", help="With --scope draft: also quantize the draft's own lm_head.",
    ),
    force: options.force("Replace OUT if it exists.") = False,
    revision: options.Revision = None,
    sample_rows: int = typer.Option(
        None, "--sample-rows", min=0, show_default=False,
        help="Previous tokens sampled for the Markov-bias agreement (default 128; 0 skips it).",
    ),
    json_path: options.json_path("the report") = None,
) -> None:
    """Quantize markov_head.markov_w2 to NVFP4 W4A16; everything else is linked or copied unchanged."""
    from dspark_cli.runtime.io.outputs import check_output_file, local_inputs
    from dspark_cli.runtime.quantize.write import quantize_checkpoint

    check_output_file(json_path, local_inputs("checkpoint", [checkpoint]) + [("output folder", out)], "--json file")
    if scope is Scope.draft:
        _quantize_draft(checkpoint, out, lm_head, engine, force, revision, sample_rows, json_path)
        return
    if lm_head:
        raise DsparkError("--lm-head needs --scope draft (--scope markov quantizes markov_w2 only).")
    report = quantize_checkpoint(
        checkpoint, out, engine=engine.value, force=force, revision=revision, sample_rows=sample_rows
    )
    for warning in report.warnings:  # stderr, so that --json - keeps stdout to the one document
        err_console.print(Text("warning: ", style="yellow") + Text(warning), highlight=False)
    if json_path is not None:
        emit_json(report.to_dict(), json_path)
    if not options.to_stdout(json_path):
        console.print(_table(report))


def _quantize_draft(checkpoint, out, lm_head, engine, force, revision, sample_rows, json_path) -> None:
    from dspark_cli.runtime.quantize.draft_scope import quantize_draft

    if sample_rows is not None:
        raise DsparkError("--sample-rows measures the Markov bias of --scope markov; drop it with --scope draft.")
    report = quantize_draft(checkpoint, out, lm_head=lm_head, engine=engine.value, force=force, revision=revision)
    if json_path is not None:
        emit_json(report.to_dict(), json_path)
    if not options.to_stdout(json_path):
        table = Table(title=Text(f"dspark quantize --scope draft → {report.output}"), show_header=False,
                      title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        rows = [
            ("format", "NVFP4 W4A16 (group 16), MIXED_PRECISION"),
            ("quantized layers", f"{len(report.quantized_layers)} (lm_head {'in' if report.lm_head else 'out'})"),
            ("engine", engine.value),
            ("size", f"{format_bytes(report.bytes_before)} → {format_bytes(report.bytes_after)} "
                     f"({report.compression_ratio:.2f}x smaller)"),
            ("worst relative Frobenius error", f"{report.worst_relative_frobenius_error:.4f} ({report.worst_layer})"),
            ("wall time", f"{report.wall_s:.2f} s"),
        ]
        for key, value in rows:
            table.add_row(Text(key), Text(str(value)))
        console.print(table)


def _table(report) -> Table:
    vd, rank = report.shape
    table = Table(title=Text(f"dspark quantize → {report.output}"), show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("tensor", f"{report.tensor} [{vd}, {rank}] {report.source_dtype} → NVFP4 W4A16 (group 16)"),
        ("vLLM layer", f"{report.quantized_layer} (the only quantized layer)"),
        ("engine", report.engine),
        ("size", f"{format_bytes(report.bytes_before)} → {format_bytes(report.bytes_after)} "
                 f"({report.compression_ratio:.2f}x smaller)"),
        ("relative Frobenius error", f"{report.relative_frobenius_error:.4f}"),
        ("cosine", f"{report.cosine:.5f}"),
        ("max abs error", f"{report.max_abs_error:.4g}"),
        ("global scale (weight_scale_2)", f"{report.global_scale:.6g}"),
    ]
    if report.bias is not None:
        bias = report.bias
        rows += [
            (f"Markov bias, {bias.rows} previous tokens", "bf16 vs NVFP4 head"),
            ("  top-1 agreement", f"{bias.top1_agreement:.2%}"),
            ("  top-16 overlap", f"{bias.top16_overlap:.2%}"),
            ("  relative error", f"{bias.relative_error:.4f}"),
        ]
    rows += [
        ("rewritten shard", report.rewritten_shard),
        ("files", f"{len(report.linked_files)} hard-linked, {len(report.copied_files)} copied"),
        ("wall time", f"{report.wall_s:.2f} s"),
    ]
    for key, value in rows:
        table.add_row(Text(key), Text(str(value)))
    return table

