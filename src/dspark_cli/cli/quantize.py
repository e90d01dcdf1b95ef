"""`dspark quantize`: the Markov head's markov_w2 (--scope markov, NVFP4 W4A16) or the draft's Linear layers (--scope
draft, NVFP4 W4A16 or FP8 W8A8) in ModelOpt's format that vLLM loads, optionally behind the acceptance guard."""

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


class Format(str, Enum):
    nvfp4 = "nvfp4"
    fp8 = "fp8"


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize)


@handle_errors
def quantize(
    checkpoint: str = typer.Argument(
        ..., metavar="CHECKPOINT", help="Draft checkpoint: a local folder or a Hugging Face hub id."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder (written atomically; must not exist)."),
    engine: Engine = typer.Option(
        Engine.modelopt, "--engine", help="modelopt: ModelOpt's quantizers; torch: dspark's bit-identical ones."
    ),
    scope: Scope = typer.Option(
        Scope.markov, "--scope",
        help="markov: markov_w2 only (NVFP4 W4A16); draft: each layer's o_proj and MLP, and fc (see --qkv, "
        "--lm-head, --format).",
    ),
    lm_head: bool = typer.Option(
        False, "--lm-head/--no-lm-head", help="With --scope draft: also quantize the draft's own lm_head (vLLM builds "
        "it unquantized and refuses it: DSP732).",
    ),
    qkv: bool = typer.Option(
        False, "--qkv/--no-qkv", help="With --scope draft: also quantize q/k/v (vLLM and SGLang multiply them "
        "densely for the context K/V and refuse them: DSP731, DSP705; dspark's runtime and convert run them).",
    ),
    fmt: Format = typer.Option(
        Format.nvfp4, "--format", help="With --scope draft: nvfp4 (W4A16) or fp8 (W8A8, static scales calibrated "
        "through --target on --calibration prompts).",
    ),
    target: str = typer.Option(
        None, "--target", "-t", metavar="TARGET", help="The target (folder or hub id): FP8's calibration and the "
        "acceptance guard decode through it.",
    ),
    calibration: Path = typer.Option(
        None, "--calibration", metavar="FILE", help="With --format fp8: prompts (.jsonl or .txt) whose speculative "
        "decoding measures each layer's input range.",
    ),
    calibration_tokens: int = typer.Option(64, "--calibration-tokens", min=1, help="New tokens per calibration "
                                           "prompt."),
    guard_prompts: Path = typer.Option(
        None, "--guard-prompts", metavar="FILE", help="Held-out prompts (.jsonl or .txt): decode them with the "
        "unquantized and the quantized draft beside --target and refuse to write OUT when τ falls too far.",
    ),
    max_tau_drop: float = typer.Option(0.1, "--max-tau-drop", help="The guard refuses OUT when τ falls by more "
                                       "than this (paired over prompts)."),
    guard_warn: bool = typer.Option(False, "--guard-warn", help="Write OUT anyway and warn when τ falls too far."),
    guard_tokens: int = typer.Option(64, "--guard-tokens", min=1, help="New tokens per guard prompt."),
    force: options.force("Replace OUT and the --json file if they exist.") = False,
    revision: options.Revision = None,
    sample_rows: int = typer.Option(
        None, "--sample-rows", min=0, show_default=False,
        help="Previous tokens sampled for the Markov-bias agreement (default 128; 0 skips it).",
    ),
    json_path: options.json_path("the report") = None,
) -> None:
    """Quantize markov_head.markov_w2 to NVFP4 W4A16 (or, with --scope draft, the draft's Linear layers to NVFP4 or
    FP8); everything else is linked or copied unchanged."""
    from dspark_cli.runtime.io.outputs import check_output_files, local_inputs
    from dspark_cli.runtime.quantize.write import quantize_checkpoint

    inputs = (local_inputs("checkpoint", [checkpoint]) + local_inputs("--target folder", [target])
              + local_inputs("--calibration file", [calibration]) + local_inputs("--guard-prompts file",
                                                                                  [guard_prompts]))
    check_output_files([("--json file", json_path)], inputs + [("output folder", out)], force)
    guard = _guard(target, guard_prompts, max_tau_drop, guard_warn, guard_tokens)
    if scope is Scope.draft:
        calibrated = _calibration(fmt, target, calibration, calibration_tokens)
        _quantize_draft(checkpoint, out, fmt, lm_head, qkv, engine, force, revision, sample_rows, calibrated, guard,
                        json_path)
        return
    if lm_head or qkv or fmt is not Format.nvfp4 or calibration is not None:
        raise DsparkError("--lm-head, --qkv, --format and --calibration need --scope draft (--scope markov quantizes "
                          "markov_w2 to NVFP4 W4A16 only).")
    report = quantize_checkpoint(
        checkpoint, out, engine=engine.value, force=force, revision=revision, sample_rows=sample_rows, guard=guard
    )
    _print_warnings(report.warnings, report.guard)
    if json_path is not None:
        emit_json(report.to_dict(), json_path, force)
    if not options.to_stdout(json_path):
        console.print(_table(report))


def _guard(target, guard_prompts, max_tau_drop, guard_warn, guard_tokens):
    """The acceptance guard (bench/runtime_guard.py) when --guard-prompts is given, else None."""
    if guard_prompts is None:
        return None
    if target is None:
        raise DsparkError("the acceptance guard decodes both drafts beside the target: name it with --target.")
    from dspark_cli.runtime.measure.evaluation import read_prompt_set
    from dspark_cli.runtime.bench.runtime_guard import runtime_guard

    prompts = read_prompt_set(guard_prompts).prompts
    return runtime_guard(target, prompts, max_tau_drop, refuse=not guard_warn, max_tokens=guard_tokens)


def _calibration(fmt: Format, target, calibration, calibration_tokens):
    """FP8's calibration (target and prompts); None for NVFP4, which has none."""
    from dspark_cli.runtime.quantize.draft_scope import Calibration

    if fmt is Format.nvfp4:
        if calibration is not None:
            raise DsparkError("--calibration measures FP8's activation scales; NVFP4 W4A16 needs none, so drop it.")
        return None
    if target is None or calibration is None:
        raise DsparkError("--format fp8 needs static activation scales measured through the target: give --target "
                          "and --calibration FILE (prompts like the ones the draft will serve).")
    from dspark_cli.runtime.measure.evaluation import read_prompt_set

    return Calibration(target, tuple(read_prompt_set(calibration).prompts), calibration_tokens)


def _print_warnings(warnings: list[str], guard: dict | None) -> None:
    """stderr, so that --json - keeps stdout to the one document."""
    if guard is not None and not guard["passed"]:
        warnings = [*warnings, f"the acceptance guard failed (written anyway): {guard['line']}, more than the "
                               f"{guard['max_tau_drop']} allowed."]
    for warning in warnings:
        err_console.print(Text("warning: ", style="yellow") + Text(warning), highlight=False)


def _quantize_draft(checkpoint, out, fmt, lm_head, qkv, engine, force, revision, sample_rows, calibration, guard,
                    json_path) -> None:
    from dspark_cli.runtime.quantize.draft_scope import quantize_draft

    if sample_rows is not None:
        raise DsparkError("--sample-rows measures the Markov bias of --scope markov; drop it with --scope draft.")
    report = quantize_draft(checkpoint, out, fmt=fmt.value, lm_head=lm_head, qkv=qkv, engine=engine.value,
                            force=force, revision=revision, calibration=calibration, guard=guard)
    _print_warnings(report.warnings, report.guard)
    if json_path is not None:
        emit_json(report.to_dict(), json_path, force)
    if not options.to_stdout(json_path):
        table = Table(title=Text(f"dspark quantize --scope draft → {report.output}"), show_header=False,
                      title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        described = {"nvfp4": "NVFP4 W4A16 (group 16), MIXED_PRECISION",
                     "fp8": f"FP8 W8A8 per tensor, static input scales from {report.calibration_prompts} "
                            "calibration prompts, MIXED_PRECISION"}
        rows = [
            ("format", described[report.format]),
            ("quantized layers", f"{len(report.quantized_layers)} (q/k/v {'in' if report.qkv else 'out'}, lm_head "
                                 f"{'in' if report.lm_head else 'out'})"),
            ("engine", engine.value),
            ("size", f"{format_bytes(report.bytes_before)} → {format_bytes(report.bytes_after)} "
                     f"({report.compression_ratio:.2f}x smaller)"),
            ("worst relative Frobenius error", f"{report.worst_relative_frobenius_error:.4f} ({report.worst_layer})"),
            *_guard_rows(report.guard),
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
        *_guard_rows(report.guard),
        ("wall time", f"{report.wall_s:.2f} s"),
    ]
    for key, value in rows:
        table.add_row(Text(key), Text(str(value)))
    return table



def _guard_rows(guard: dict | None) -> list[tuple[str, str]]:
    if guard is None:
        return []
    verdict = "passed" if guard["passed"] else "FAILED (written anyway)"
    return [("acceptance guard", f"{verdict}: {guard['line']} (allowed drop {guard['max_tau_drop']})")]
