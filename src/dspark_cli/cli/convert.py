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
    force: options.force("Replace OUT and the --json file if they exist.") = False,
    json_path: options.json_path("the summary") = None,
    outtype: str = typer.Option(None, "--outtype", metavar="TYPE", help="gguf: q8_0, q4_0 or q4_k (dspark's "
                                "quantizer, every eligible matrix in the type) or q4_k_m (llama.cpp's llama-quantize); "
                                "default: the tensors' own dtype."),
    leave_output: bool = typer.Option(False, "--leave-output", help="With --outtype: keep output.weight (the "
                                      "lm_head) unquantized."),
    guard_prompts: Path = typer.Option(None, "--guard-prompts", metavar="FILE", help="With --outtype: "
                                       "held-out prompts (.jsonl or .txt) on which llama.cpp measures τ of the "
                                       "unquantized and the quantized pair before OUT is written."),
    guard_target: Path = typer.Option(None, "--guard-target", metavar="GGUF", help="The target GGUF the guard "
                                      "serves both drafts beside."),
    guard_draft: str = typer.Option(None, "--guard-draft", metavar="FOLDER", help="With --outtype on a target: the "
                                    "draft folder whose GGUF (FOLDER.gguf beside it) the guard serves with both "
                                    "targets."),
    max_tau_drop: float = typer.Option(0.1, "--max-tau-drop", help="The guard refuses to write OUT when τ falls by "
                                       "more than this."),
    guard_warn: bool = typer.Option(False, "--guard-warn", help="Write OUT anyway and warn when τ falls too far."),
    guard_tokens: int = typer.Option(64, "--guard-tokens", min=1, help="Tokens generated per guard prompt."),
) -> None:
    """Write the draft in another engine's format; refused, in one sentence, when it cannot be faithful."""
    from dspark_cli.runtime.io.outputs import check_output_files, local_inputs

    inputs = (local_inputs("draft", [draft]) + local_inputs("target", [target])
              + local_inputs("--guard-prompts file", [guard_prompts]) + local_inputs("--guard-target file",
                                                                                     [guard_target])
              + local_inputs("--guard-draft folder", [guard_draft]))
    check_output_files([("--json file", json_path)], inputs + [("output", out)], force)
    quant = Quantization(outtype, leave_output, guard_prompts, guard_target, guard_draft, max_tau_drop, guard_warn,
                         guard_tokens)
    if to == Format.gguf:
        summary = _to_gguf(draft, out, target, force) if outtype is None else _quantized(draft, out, target, force,
                                                                                           quant)
    else:
        _refuse_outtype(quant)
        summary = _to_layout(draft, out, to, target, force)
    line = summary.pop("line")
    if json_path is not None:
        emit_json(summary, json_path, force)
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
            f"{summary['tensors']} tensors, target layers {summary['target_layers']} (llama.cpp's numbering)"
            + _dequantized_line(summary)}


def _dequantized_line(summary: dict) -> str:
    """The quantized Linear layers written dequantized, and FP8's input scales dropped (docs/convert.md)."""
    counts = summary.get("dequantized")
    if not counts:
        return ""
    kinds = " and ".join(f"{count} {kind.upper()}" for kind, count in sorted(counts.items()))
    dropped = summary.get("dropped") or []
    return (f"\ndequantized {kinds} Linear weight{'s' if sum(counts.values()) != 1 else ''} to F32 (exact)"
            + (f"; dropped {len(dropped)} FP8 input_scale tensors (llama.cpp quantizes no activations with them)"
               if dropped else ""))


@dataclass(frozen=True)
class Quantization:
    outtype: str | None
    leave_output: bool
    guard_prompts: Path | None
    guard_target: Path | None
    guard_draft: str | None
    max_tau_drop: float
    guard_warn: bool
    guard_tokens: int


def _refuse_outtype(quant: Quantization) -> None:
    from dspark_cli.errors import DsparkError

    if quant.outtype is not None or quant.leave_output or quant.guard_prompts is not None or quant.guard_draft:
        raise DsparkError("--outtype, --leave-output and the guard options apply to --to gguf only.")


def _quantized(draft: str, out: Path, target: str | None, force: bool, quant: Quantization) -> dict:
    """The GGUF quantized to --outtype, the acceptance guard run on a draft when --guard-prompts is given."""
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.convert.gguf import convert_to_gguf
    from dspark_cli.runtime.convert.gguf_quant import convert_quantized
    from dspark_cli.runtime.convert.target_gguf import convert_target_to_gguf, is_target
    from dspark_cli.runtime.io.outputs import local_inputs

    guard_files = (local_inputs("--guard-prompts file", [quant.guard_prompts])
                   + local_inputs("--guard-target file", [quant.guard_target]))
    if is_target(draft):
        if target or quant.guard_target is not None:
            raise DsparkError(f"{draft} is a model, not a draft; --target and --guard-target are for a draft's "
                              "conversion (a target's guard takes --guard-draft), so drop them.")
        inputs = local_inputs("target", [draft]) + local_inputs("--guard-draft folder", [quant.guard_draft])
        summary = convert_quantized(lambda path: convert_target_to_gguf(draft, path, force=True), out, quant.outtype,
                                    inputs + guard_files, force, quant.leave_output, _target_guard(draft, quant))
        return {**summary, "line": _quantized_line(summary)}
    if not target:
        raise DsparkError("a GGUF takes its tokenizer from the target, so the target option must name its folder.")
    if quant.guard_draft is not None:
        raise DsparkError("--guard-draft names the draft a target's guard serves; for a draft, name the target's "
                          "GGUF with --guard-target.")
    inputs = local_inputs("draft", [draft]) + local_inputs("target", [target]) + guard_files
    summary = convert_quantized(lambda path: convert_to_gguf(draft, path, target=target, force=True), out,
                                quant.outtype, inputs, force, quant.leave_output, _draft_guard(draft, target, quant))
    return {**summary, "line": _quantized_line(summary)}


def _draft_guard(draft: str, target: str, quant: Quantization):
    """Both drafts beside --guard-target (a GGUF), under dspark's flags for the draft folder."""
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.bench.quant_guard import spec_args_for

    if quant.guard_prompts is None:
        _refuse_without_prompts(quant.guard_target, "--guard-target")
        return None
    if quant.guard_target is None or not quant.guard_target.is_file():
        raise DsparkError("the acceptance guard serves both drafts beside the target's GGUF: name that file with "
                          "--guard-target (dspark convert TARGET --to gguf writes it).")
    return _guard(quant, quant.guard_target, spec_args_for(draft, target), "draft")


def _target_guard(target: str, quant: Quantization):
    """Both targets with the draft GGUF beside --guard-draft (FOLDER.gguf, as dspark serve plans llama.cpp)."""
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.bench.quant_guard import spec_args_for
    from dspark_cli.runtime.engines.llamacpp import gguf_beside

    if quant.guard_prompts is None:
        _refuse_without_prompts(quant.guard_draft, "--guard-draft")
        return None
    if quant.guard_draft is None:
        raise DsparkError("a target's acceptance guard serves both targets with a draft: name its folder with "
                          "--guard-draft (its GGUF beside it, FOLDER.gguf).")
    draft_gguf = Path(gguf_beside(quant.guard_draft, "draft"))
    if not draft_gguf.is_file():
        raise DsparkError(f"the guard's draft GGUF {draft_gguf} does not exist; write it with dspark convert "
                          f"{quant.guard_draft} --to gguf --target {target}.")
    return _guard(quant, draft_gguf, spec_args_for(quant.guard_draft, target), "target")


def _refuse_without_prompts(given: object, flag: str) -> None:
    from dspark_cli.errors import DsparkError

    if given is not None:
        raise DsparkError(f"{flag} is for the acceptance guard; give --guard-prompts too, or drop it.")


def _guard(quant: Quantization, partner: Path, spec_args: tuple[str, ...], role: str):
    from dspark_cli.runtime.bench.quant_guard import GuardSettings, acceptance_guard
    from dspark_cli.runtime.measure.evaluation import read_prompt_set

    prompts = tuple(read_prompt_set(quant.guard_prompts).prompts)
    return acceptance_guard(GuardSettings(partner, spec_args, prompts, quant.max_tau_drop,
                                          refuse=not quant.guard_warn, max_tokens=quant.guard_tokens,
                                          quantized_role=role))


def _quantized_line(summary: dict) -> str:
    types = ", ".join(f"{count} {kind}" for kind, count in sorted(summary["tensor_types"].items()))
    line = (f"wrote {summary['output']}: llama.cpp {summary['architecture']} GGUF at {summary['outtype']}, "
            f"{summary['bytes'] / 1e6:.2f} MB (unquantized {summary['unquantized_bytes'] / 1e6:.2f} MB); tensors: "
            f"{types}" + _dequantized_line(summary))
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
