"""`dspark convert`: a draft rewritten for another engine (llama.cpp's dflash GGUF) or in vLLM's other layout; a
target as llama.cpp's GGUF."""

from __future__ import annotations

from dataclasses import dataclass
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
    outtype: str = typer.Option(None, "--outtype", metavar="TYPE", help="gguf: q8_0, q4_0 or q4_k (dspark's "
                                "quantizer, every eligible matrix in the type) or q4_k_m (llama.cpp's llama-quantize); "
                                "default: the tensors' own dtype."),
    leave_output: bool = typer.Option(False, "--leave-output", help="With --outtype: keep output.weight (the "
                                      "lm_head) unquantized."),
    guard_prompts: Path = typer.Option(None, "--guard-prompts", metavar="FILE", help="With --outtype on a draft: "
                                       "held-out prompts (.jsonl or .txt) on which llama.cpp measures τ of the "
                                       "unquantized and the quantized draft before OUT is written."),
    guard_target: Path = typer.Option(None, "--guard-target", metavar="GGUF", help="The target GGUF the guard "
                                      "serves both drafts beside."),
    max_tau_drop: float = typer.Option(0.1, "--max-tau-drop", help="The guard refuses to write OUT when τ falls by "
                                       "more than this."),
    guard_warn: bool = typer.Option(False, "--guard-warn", help="Write OUT anyway and warn when τ falls too far."),
    guard_tokens: int = typer.Option(64, "--guard-tokens", min=1, help="Tokens generated per guard prompt."),
) -> None:
    """Write the draft in another engine's format; refused, in one sentence, when it cannot be faithful."""
    from dspark_cli.runtime.io.outputs import check_output_file, local_inputs

    inputs = (local_inputs("draft", [draft]) + local_inputs("target", [target])
              + local_inputs("--guard-prompts file", [guard_prompts]) + local_inputs("--guard-target file",
                                                                                     [guard_target]))
    check_output_file(json_path, inputs + [("output", out)], "--json file")
    quant = Quantization(outtype, leave_output, guard_prompts, guard_target, max_tau_drop, guard_warn, guard_tokens)
    if to == Format.gguf:
        summary = _to_gguf(draft, out, target, force) if outtype is None else _quantized(draft, out, target, force,
                                                                                           quant)
    else:
        _refuse_outtype(quant)
        summary = _to_layout(draft, out, to, target, force)
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


@dataclass(frozen=True)
class Quantization:
    outtype: str | None
    leave_output: bool
    guard_prompts: Path | None
    guard_target: Path | None
    max_tau_drop: float
    guard_warn: bool
    guard_tokens: int


def _refuse_outtype(quant: Quantization) -> None:
    from dspark_cli.errors import DsparkError

    if quant.outtype is not None or quant.leave_output or quant.guard_prompts is not None:
        raise DsparkError("--outtype, --leave-output and the guard options apply to --to gguf only.")


def _quantized(draft: str, out: Path, target: str | None, force: bool, quant: Quantization) -> dict:
    """The GGUF quantized to --outtype, the acceptance guard run on a draft when --guard-prompts is given."""
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.convert.gguf import convert_to_gguf
    from dspark_cli.runtime.convert.gguf_quant import convert_quantized
    from dspark_cli.runtime.convert.target_gguf import convert_target_to_gguf, is_target
    from dspark_cli.runtime.io.outputs import local_inputs

    if is_target(draft):
        if target or quant.guard_prompts is not None:
            raise DsparkError(f"{draft} is a model, not a draft; --target and the guard options are for a draft's "
                              "conversion, so drop them to convert the model itself.")
        inputs = local_inputs("target", [draft])
        summary = convert_quantized(lambda path: convert_target_to_gguf(draft, path, force=True), out, quant.outtype,
                                    inputs, force, quant.leave_output)
        return {**summary, "line": _quantized_line(summary)}
    if not target:
        raise DsparkError("a GGUF takes its tokenizer from the target, so the target option must name its folder.")
    inputs = (local_inputs("draft", [draft]) + local_inputs("target", [target])
              + local_inputs("--guard-prompts file", [quant.guard_prompts])
              + local_inputs("--guard-target file", [quant.guard_target]))
    summary = convert_quantized(lambda path: convert_to_gguf(draft, path, target=target, force=True), out,
                                quant.outtype, inputs, force, quant.leave_output, _guard(draft, target, quant))
    return {**summary, "line": _quantized_line(summary)}


def _guard(draft: str, target: str, quant: Quantization):
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.bench.quant_guard import GuardSettings, acceptance_guard, spec_args_for
    from dspark_cli.runtime.measure.evaluation import read_prompt_set

    if quant.guard_prompts is None:
        if quant.guard_target is not None:
            raise DsparkError("--guard-target names the target GGUF of the acceptance guard; give --guard-prompts "
                              "too, or drop it.")
        return None
    if quant.guard_target is None or not quant.guard_target.is_file():
        raise DsparkError("the acceptance guard serves both drafts beside the target's GGUF: name that file with "
                          "--guard-target (dspark convert TARGET --to gguf writes it).")
    prompts = tuple(read_prompt_set(quant.guard_prompts).prompts)
    return acceptance_guard(GuardSettings(quant.guard_target, spec_args_for(draft, target), prompts,
                                          quant.max_tau_drop, refuse=not quant.guard_warn,
                                          max_tokens=quant.guard_tokens))


def _quantized_line(summary: dict) -> str:
    types = ", ".join(f"{count} {kind}" for kind, count in sorted(summary["tensor_types"].items()))
    line = (f"wrote {summary['output']}: llama.cpp {summary['architecture']} GGUF at {summary['outtype']}, "
            f"{summary['bytes'] / 1e6:.2f} MB (unquantized {summary['unquantized_bytes'] / 1e6:.2f} MB); tensors: "
            f"{types}")
    guard = summary.get("guard")
    if guard is not None:
        verdict = "passed" if guard["passed"] else "WARNING: failed, written anyway"
        line += f"\nacceptance guard {verdict}: {guard['line']} (allowed drop {guard['max_tau_drop']})"
    return line


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
