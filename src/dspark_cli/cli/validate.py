"""`dspark validate`: can vLLM load this draft checkpoint, and if not, exactly why (headers only, well under 1 s)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import typer
from rich.table import Table
from rich.text import Text

from dspark_cli.cli import options, render
from dspark_cli.runtime.units import format_bytes

if TYPE_CHECKING:
    from dspark_cli.runtime.checkpoint.rules import Report

HELP = """Check a DSpark (or DFlash) draft checkpoint against every rule vLLM's loader applies, reading only
config.json and the safetensors headers; a draft .gguf file against what llama.cpp's dflash model reads. --probe also
decodes a few greedy prompts with the pair and measures τ. Exit codes: 0 no errors, 1 errors found (or warnings with
--strict), 2 the checkpoint could not be read. Every finding code is documented in docs/validate.md."""

SHOWN_PER_CODE = 10  # findings printed per code; the rest are counted (--json lists every one)
STYLES = {"error": ("Errors", "bold red", "x"), "warning": ("Warnings", "bold yellow", "!"),
          "info": ("Info", "bold blue", "i")}


def register(app: typer.Typer) -> None:
    app.command("validate", help=HELP)(validate)


@render.handle_errors
def validate(
    checkpoint: str = typer.Argument(
        ..., metavar="CHECKPOINT", help="Draft checkpoint: a local folder, a Hugging Face hub id or a llama.cpp "
                                        "draft .gguf file."
    ),
    target: Optional[str] = typer.Option(
        None, "--target", "-t", metavar="TARGET",
        help="Target model (folder, config.json or hub id; for a .gguf draft, the target's .gguf or folder); only its "
             "config and tokenizer are read.",
    ),
    revision: options.Revision = None,
    deep: bool = typer.Option(False, "--deep", help="Also load tensors one at a time to check their values."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 on warnings too."),
    probe: bool = typer.Option(False, "--probe", help="Also decode a few short greedy prompts with the pair (needs "
                               "--target, loads both models) and report τ; a draft whose acceptance is near zero "
                               "is an error (DSP608)."),
    device: options.device() = "auto",
    json_path: options.json_path("the findings (also when CHECKPOINT cannot be read)") = None,
    force: options.force("Replace an existing --json file.") = False,
    engine: options.engine("Engine to judge the draft for: vllm (default), sglang, trtllm, llamacpp, or all (a verdict per "
                           "engine; docs/engines.md).", choices=(*options.ENGINE_NAMES, "all")) = "vllm",
) -> None:
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.checkpoint.read import CheckpointError, open_checkpoint, read_target_config
    from dspark_cli.runtime.io.outputs import check_output_files, local_inputs
    from dspark_cli.runtime.io.paths import require_utf8_path
    from dspark_cli.runtime.checkpoint.rules import validate_checkpoint

    check_output_files([("--json file", json_path)],
                       local_inputs("checkpoint", [checkpoint]) + local_inputs("target", [target]), force)
    if probe and not target:
        raise DsparkError("the probe decodes with the pair, so it needs the target option.")
    from dspark_cli.runtime.checkpoint.gguf_read import is_gguf

    if is_gguf(checkpoint):
        if probe or engine not in ("vllm", "llamacpp"):
            raise DsparkError("a .gguf draft is judged for llama.cpp only and dspark cannot decode with it; leave out "
                              "the probe and engine options, or validate the draft's folder.")
        validate_gguf_file(checkpoint, target, deep, strict, json_path, force)
    if deep:  # only --deep opens tensors with the safetensors library; headers are read by dspark itself
        require_utf8_path(checkpoint, "CHECKPOINT")
    try:
        ckpt = open_checkpoint(checkpoint, revision)
        target_config = read_target_config(target) if target else None
        report = validate_checkpoint(ckpt, target_config, deep=deep)
    except CheckpointError as error:
        if json_path is not None:
            render.emit_json({"checkpoint": checkpoint, "exit_code": error.exit_code,
                              "error": {"code": error.code, "message": error.message}}, json_path, force)
        raise DsparkError(f"{error.code} {error.message}", error.exit_code) from None
    probed = run_probe(report, target, checkpoint, device) if probe else None
    exit_code = report.exit_code(strict)
    verdicts = engine_verdicts(engine, ckpt, report)
    if verdicts:
        refused = all(v.refused for v in verdicts)
        exit_code = 1 if refused or (strict and report.warnings) else 0
    if json_path is not None:
        document = render.with_flags(report.to_dict())  # the JSON names flags as the printed report does
        if verdicts:
            document["engines"] = {v.engine: render.with_flags(v.to_dict()) for v in verdicts}
        if probed is not None:
            document["probe"] = probed.to_dict()
        render.emit_json({**document, "strict": strict, "exit_code": exit_code}, json_path, force)
    if not options.to_stdout(json_path):
        print_report(report, strict, exit_code, verdicts, probed)
    raise typer.Exit(exit_code)


def validate_gguf_file(checkpoint: str, target: Optional[str], deep: bool, strict: bool, json_path,
                       force: bool) -> None:
    """A llama.cpp draft GGUF: the GGUF rules (rules/gguf.py), the same report, JSON and exit codes as a folder's."""
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.checkpoint.read import CheckpointError
    from dspark_cli.runtime.checkpoint.rules.gguf import validate_gguf

    try:
        report = validate_gguf(checkpoint, target, deep=deep)
    except CheckpointError as error:
        if json_path is not None:
            render.emit_json({"checkpoint": checkpoint, "exit_code": error.exit_code,
                              "error": {"code": error.code, "message": error.message}}, json_path, force)
        raise DsparkError(f"{error.code} {error.message}", error.exit_code) from None
    exit_code = report.exit_code(strict)
    if json_path is not None:
        render.emit_json({**render.with_flags(report.to_dict()), "strict": strict, "exit_code": exit_code}, json_path,
                         force)
    if not options.to_stdout(json_path):
        print_report(report, strict, exit_code)
    raise typer.Exit(exit_code)


def run_probe(report: "Report", target: str, checkpoint: str, device: str):
    """--probe: τ measured with the pair; its finding (DSP608) joins the report's. Skipped when the draft has errors
    (it would not load as trained)."""
    from dspark_cli.runtime.checkpoint.rules.codes import SkippedCheck, sort_findings
    from dspark_cli.runtime.probe import probe, probe_findings

    if report.errors:
        report.skipped.append(SkippedCheck("DSP608", "the probe runs only on a draft without errors"))
        return None
    with render.console.status("probing: greedy prompts through the pair"):
        result = probe(target, checkpoint, device=device)
    report.findings = sort_findings(report.findings + probe_findings(result))
    return result


def engine_verdicts(name: str, ckpt, report: "Report") -> list:
    """The per-engine verdicts `--engine` asks for. For vllm (the default) validate's own report is the verdict,
    unless vLLM's own engine rules refuse the draft (DSP731, DSP732: quantized Linear layers): then its verdict."""
    from dspark_cli.runtime.engines import ENGINES
    from dspark_cli.runtime.engines import engine as named_engine
    from dspark_cli.runtime.engines.seam import draft_config

    chosen = ENGINES.values() if name == "all" else [named_engine(name)]
    config = draft_config(ckpt, report)
    verdicts = [e.verdict(report, config) for e in chosen]
    if name == "vllm":
        return verdicts if any(f.code not in report.codes for f in verdicts[0].refused) else []
    return verdicts


def engine_table(verdicts: list) -> Table:
    """engine x verdict: serves / serves with losses / refuses, with the codes and what is lost."""
    styles = {"serves": "bold green", "serves with losses": "bold yellow", "refuses": "bold red"}
    table = Table(title="Engines", title_justify="left", show_edge=False)
    for column in ("engine", "verdict", "codes", "lost or changed"):
        table.add_column(column)
    for v in verdicts:
        table.add_row(v.label, Text(v.status, styles[v.status]), " ".join(f.code for f in v.refused) or "-",
                      Text(render.name_flags(" ".join(v.notes)) or "-"))
    return table


def print_report(report: "Report", strict: bool, exit_code: int, verdicts: list = (), probed=None) -> None:
    console = render.console
    console.print(Text.assemble(("dspark validate ", "bold"), report.source))
    console.print(resolved_table(report.resolved))
    if probed is not None:
        rate = "-" if probed.draft_acceptance_rate is None else f"{probed.draft_acceptance_rate:.0%}"
        console.print(Text(f"probe: τ {probed.tau:.2f}, draft acceptance {rate}, {probed.rounds} rounds, "
                           f"{probed.new_tokens} tokens from {probed.prompts} greedy prompts (block "
                           f"{probed.block_size})"))
    for severity, (title, style, mark) in STYLES.items():
        findings = [f for f in report.findings if f.severity == severity]
        if not findings:
            continue
        console.print(Text(f"\n{title} ({len(findings)})", style=style))
        table = Table.grid(padding=(0, 1))
        table.add_column(no_wrap=True)
        table.add_column()
        shown: dict[str, int] = {}
        for finding in findings:
            shown[finding.code] = shown.get(finding.code, 0) + 1
            if shown[finding.code] <= SHOWN_PER_CODE:
                table.add_row(Text(f"  {mark} {finding.code}", style=style), Text(render.name_flags(finding.message)))
                table.add_row("", Text(f"fix: {render.name_flags(finding.hint)}", style="dim"))
        for code, count in shown.items():
            if count > SHOWN_PER_CODE:
                table.add_row(Text(f"  {mark} {code}", style=style),
                              Text(f"... and {count - SHOWN_PER_CODE} more {code} findings (--json lists all).",
                                   style="dim"))
        console.print(table)
    if report.skipped:
        console.print(Text("\nSkipped", style="bold"))
        for skipped in report.skipped:
            console.print(Text(f"  - {skipped.check}: {render.name_flags(skipped.reason)}", style="dim"))
    engine_findings = [f for v in verdicts for f in v.refused if f.code not in report.codes]
    for finding in engine_findings:
        console.print(Text.assemble((f"  x {finding.code} ", "bold red"), render.name_flags(finding.message)))
        console.print(Text(f"    fix: {render.name_flags(finding.hint)}", style="dim"))
    if verdicts:
        console.print()
        console.print(engine_table(verdicts))
    console.print()
    console.print(summary_line(report, strict, exit_code) if not verdicts else verdict_line(verdicts, exit_code))


def resolved_table(resolved: dict) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="cyan", no_wrap=True)
    table.add_column()
    for label, value in resolved_rows(resolved):
        table.add_row(label, Text(value))
    return table


def resolved_rows(resolved: dict) -> list[tuple[str, str]]:
    """The values vLLM would resolve, each with the config key it came from."""
    if resolved.get("format") == "gguf-dflash":
        return gguf_rows(resolved)
    rows = [("format", str(resolved.get("format")))]
    if "mask_token" not in resolved:
        return rows + [("architecture", str(resolved.get("architecture")))]

    def sourced(entry: dict) -> str:
        return f"{entry['value']}  ({render.name_flags(entry['source'] or 'not set')})"

    layers = resolved["target_layer_ids"]
    rows += [
        ("mask token", sourced(resolved["mask_token"])),
        ("target layers", f"{layers['value']} = hidden_states {layers['hidden_states_indices']}  "
                          f"({layers['source'] or 'not set'})"),
        ("block size", sourced(resolved["block_size"])),
        ("vocab", f"input {resolved['vocab_size']}, draft {sourced(resolved['draft_vocab_size'])}"),
        ("target vocab", sourced(resolved["target_vocab_size"])),
        ("target depth", sourced(resolved["target_depth"])),
        ("markov head", f"{resolved['markov_head_type']}, rank {resolved['markov_rank']}, {resolved['head_format']}"
                        if resolved["markov_rank"] else "none"),
        ("confidence", str(resolved["confidence_head"])),
        ("layout", str(resolved["layout"])),
        ("linear layers", ", ".join(f"{count} {kind.upper()}" for kind, count
                                    in resolved["quantized_linear_layers"].items()) or "unquantized"),
        ("embed / lm_head", f"{resolved['embed_tokens']} / {resolved['lm_head']}"),
        ("weights", f"{resolved['tensors']} tensors in {resolved['shards']} file(s), "
                    f"{format_bytes(resolved['bytes'], decimal=True)}"),
    ]
    return rows


def gguf_rows(resolved: dict) -> list[tuple[str, str]]:
    """What llama.cpp reads from a draft GGUF (rules/gguf.py resolved)."""
    ids = resolved["target_layer_ids"]
    head = [("format", "GGUF (llama.cpp)"), ("architecture", str(resolved["architecture"]))]
    if resolved["architecture"] != "dflash":
        return head
    return head + [
        ("target layers", f"{resolved['target_layers']} (dflash.target_layers: layer inputs)"
                          + (f" = target_layer_ids {ids}" if ids is not None else "")),
        ("block size", str(resolved["block_size"])),
        ("sample_from_anchor", str(resolved["sample_from_anchor"])),
        ("causal", f"{resolved['causal']} (dflash.attention.causal)"),
        ("mask token", str(resolved["mask_token_id"])),
        ("vocab", f"{resolved['tokens']} tokens"),
        ("markov head", f"rank {resolved['markov_rank']}" if resolved["markov_rank"] else "none"),
        ("confidence", str(resolved["confidence_head"])),
        ("sliding window", str(resolved["sliding_window"] or "none")),
        ("weights", f"{resolved['tensors']} tensors"),
    ]


def verdict_line(verdicts: list, exit_code: int) -> Text:
    serving = [v.label for v in verdicts if not v.refused]
    if not serving:
        return Text(f"x no engine asked for serves this draft (exit {exit_code}).", "bold red")
    return Text(f"ok served by {', '.join(serving)} (exit {exit_code}).", "bold green")


def summary_line(report: "Report", strict: bool, exit_code: int) -> Text:
    counts = f"{len(report.errors)} errors, {len(report.warnings)} warnings, {len(report.infos)} info"
    engine = "llama.cpp" if report.format == "gguf-dflash" else "vLLM"
    if report.errors:
        return Text(f"x {counts}: {engine} would fail to load or mis-serve this draft (exit {exit_code}).", "bold red")
    if strict and report.warnings:
        return Text(f"! {counts}: warnings fail with --strict (exit {exit_code}).", "bold yellow")
    return Text(f"ok {counts}: {engine} can load this draft (exit {exit_code}).", "bold green")

