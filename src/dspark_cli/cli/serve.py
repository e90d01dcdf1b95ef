"""`dspark serve`: check a target + draft pair, then hand it to the chosen engine (vLLM, SGLang, TensorRT-LLM or
llama.cpp) with the right speculative settings."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.markup import escape

from dspark_cli.cli import options, render

if TYPE_CHECKING:
    from dspark_cli.runtime.checkpoint.rules import Finding, Report
    from dspark_cli.runtime.engines.seam import ServePlan

HELP = """Serve a DSpark (or DFlash) draft with its target in one of four engines: vLLM (the default), SGLang,
TensorRT-LLM or llama.cpp (--engine; docs/engines.md). Runs validate's header-only checks on the pair (no weights
are loaded) and refuses a draft the engine cannot load; then prints the engine's command with the speculative
settings it reads (TensorRT-LLM's in a config file, dspark-trtllm.yaml), and runs it in place of this process
when the engine is installed. Arguments after `--` go to the engine's command unchanged. Exit codes: 1 the draft
is refused (validate found errors), 2 bad input or the engine is not installed; otherwise the engine's own exit
code. Details: docs/serve.md."""


def register(app: typer.Typer) -> None:
    app.command("serve", help=HELP)(serve)


@render.handle_errors
def serve(
    target: options.target("Target model: folder or hub id (only its config.json is read here).") = ...,
    draft: options.draft("Draft checkpoint: folder or hub id.") = ...,
    block_size: options.block_size("Draft tokens per round, the engine's draft length (vLLM's "
                                   "num_speculative_tokens; default and maximum: what the draft was trained "
                                   "for).") = None,
    draft_topk: options.draft_topk("Markov candidates per position (dspark_draft_topk; default: the draft config's, "
                                   "else dense).") = None,
    draft_sample_method: Optional[str] = typer.Option(None, "--draft-sample-method", help="vLLM: probabilistic "
                                                      "(the default: sample drafts from q, as dspark generate does) "
                                                      "or greedy (argmax drafts, less GPU memory), both lossless; "
                                                      "llama.cpp drafts greedily only; SGLang and TensorRT-LLM take "
                                                      "none."),
    port: Optional[int] = typer.Option(None, "--port", help="Port of the engine's OpenAI-compatible server."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only print the command."),
    json_path: options.json_path("the speculative config and argv (implies --dry-run)") = None,
    from_plan: Optional[Path] = typer.Option(None, "--from-plan", metavar="PLAN.json", help="Take "
                                             "num_speculative_tokens (and a survival threshold, "
                                             "dspark_confidence_threshold) from `dspark plan -o`."),
    engine_name: options.engine("Serving engine: vllm (default), sglang, trtllm or llamacpp "
                                "(docs/engines.md).") = "vllm",
    calibration: options.calibration("STS temperatures of `dspark calibrate`, handed to SGLang or TensorRT-LLM "
                                     "(their confidence head's calibration).") = None,
    force: options.force("Replace an existing --json file, and an existing engine config file beside it "
                         "(TensorRT-LLM's dspark-trtllm.yaml).") = False,
    vllm_args: Optional[list[str]] = typer.Argument(None, metavar="ENGINE_ARGS",
                                                    help="Extra arguments for the engine's command, after `--`."),
) -> None:
    from dspark_cli.errors import EXIT_BAD_INPUT, DsparkError
    from dspark_cli.runtime.engines import engine
    from dspark_cli.runtime.engines.seam import DraftRefused, ServeRequest
    from dspark_cli.runtime.engines.vllm import exec_vllm, find_vllm
    from dspark_cli.runtime.io.outputs import check_output_files, local_inputs

    inputs = (local_inputs("target", [target]) + local_inputs("draft", [draft])
              + local_inputs("--from-plan file", [from_plan]) + local_inputs("--calibration file", [calibration]))
    check_output_files([("--json file", json_path)], inputs, force)
    fields = {} if from_plan is None else plan_fields(from_plan, engine_name)
    block_size, threshold = plan_settings(fields, from_plan, block_size)
    chosen = engine(engine_name)
    if fields.get("num_speculative_tokens") == 0:
        refuse_draft_options(from_plan, draft_topk=draft_topk, draft_sample_method=draft_sample_method,
                             calibration=calibration)
        serve_plain(chosen, ServeRequest(target=target, draft=draft, port=port, engine_args=tuple(vllm_args or ())),
                    fields["reason"], dry_run, json_path, force)
        return
    try:
        request = ServeRequest(target=target, draft=draft, block_size=block_size, draft_topk=draft_topk,
                               draft_sample_method=draft_sample_method, port=port,
                               engine_args=tuple(vllm_args or ()), confidence_threshold=threshold,
                               calibration=None if calibration is None else str(calibration.expanduser().resolve()),
                               files_dir=files_dir(json_path, dry_run))
        plan = chosen.plan(request)
    except DraftRefused as refused:
        if json_path is not None:
            render.emit_json({**refusal_document(refused.report), "exit_code": refused.exit_code}, json_path, force)
        if not options.to_stdout(json_path):
            print_refusal(refused.findings)
        raise
    except DsparkError as error:
        code = getattr(error, "code", None)  # a CheckpointError's DSP5xx code, printed as validate prints it
        if json_path is not None:
            render.emit_json({"exit_code": error.exit_code, "error": {"code": code, "message": error.message}},
                             json_path, force)
        if code:
            raise DsparkError(f"{code} {error.message}", error.exit_code) from None
        raise from_plan_worded(error, from_plan) from None
    writes_files = not (dry_run and json_path is None) and not options.to_stdout(json_path)
    if writes_files:
        written = [] if json_path is None else [("--json file", json_path)]  # written first
        check_side_files(plan, request.files_dir, inputs + written, force)
    installed, hint = chosen.installed(), chosen.install_hint
    if json_path is not None:
        extra = {"vllm": find_vllm()} if chosen.name == "vllm" else {"installed": installed}
        render.emit_json(render.with_flags({**plan.to_dict(), **extra, "exit_code": 0}), json_path, force)
        if options.to_stdout(json_path):
            return
    print_notes(plan)
    write_files(plan, request.files_dir, printed=not writes_files, force=force)
    print(plan.command, flush=True)  # plain print: rich would wrap the line and break copy-paste
    if dry_run or json_path is not None:
        return
    if not installed:
        render.err_console.print(f"[bold red]error:[/] {escape(hint)}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    render.err_console.print(f"[dim]starting {chosen.label} in place of dspark (signals and exit code are "
                             f"{chosen.label}'s)[/]")
    sys.stderr.flush()
    exec_vllm(plan.argv)


def files_dir(json_path: Path | None, dry_run: bool) -> str:
    """Where the plan's files go: beside a --json file; the current folder for --dry-run (they are printed, to be
    saved there); a fresh temporary folder when the engine is started."""
    if json_path is not None and not options.to_stdout(json_path):
        return str(json_path.expanduser().resolve().parent)
    if dry_run or json_path is not None:
        return "."
    import tempfile

    return tempfile.mkdtemp(prefix="dspark-serve-")


def check_side_files(plan: "ServePlan", folder: str, inputs: list, force: bool) -> None:
    """The engine's config files go through the output check before anything is written: not an input, not the
    --json file, not an existing file unless --force."""
    from dspark_cli.runtime.io.outputs import check_output_files

    check_output_files([(f"{plan.engine}'s config file", Path(folder) / name) for name in plan.files], inputs, force)


def write_files(plan: "ServePlan", folder: str, printed: bool, force: bool) -> None:
    """The engine's config files: printed on stderr under their names (--dry-run), else written exclusively."""
    from dspark_cli.runtime.io.outputs import write_output_file

    for name, text in plan.files.items():
        path = Path(folder) / name
        if printed:
            render.err_console.print(f"[dim]save as {escape(str(path))}:[/]\n{escape(text)}", highlight=False,
                                     soft_wrap=True)
            continue
        write_output_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), force)
        render.err_console.print(f"[dim]wrote {escape(str(path))}[/]", highlight=False)


def print_notes(plan: "ServePlan") -> None:
    """Validate's warnings and what the engine takes from the draft itself, on stderr (stdout is the command)."""
    console = render.err_console
    for finding in plan.report.warnings:
        message = escape(render.name_flags(finding.message))
        console.print(f"[bold yellow]! {finding.code}[/] {message}", highlight=False, soft_wrap=True)
    console.print(f"[green]ok[/] {escape(plan.draft)}: validate found no errors against {escape(plan.target)}; "
                  f"{plan.draft_tokens} draft tokens per round, "
                  f"{escape(plan.draft_quantization)}.", highlight=False, soft_wrap=True)
    for note in plan.notes:
        console.print(f"[dim]{escape(render.name_flags(note))}[/]", highlight=False, soft_wrap=True)


def print_refusal(findings: "list[Finding]") -> None:
    """The errors the engine refuses, with their fixes."""
    console = render.err_console
    for finding in findings:
        console.print(f"[bold red]x {finding.code}[/] {escape(finding.message)}", highlight=False, soft_wrap=True)
        console.print(f"  [dim]fix: {escape(finding.hint)}[/]", highlight=False, soft_wrap=True)


def refusal_document(report: "Report") -> dict:
    return {"checkpoint": report.source, "refused": True,
            "findings": [f.to_dict() for f in report.findings]}


def plan_fields(plan: Path, engine_name: str) -> dict:
    """A `dspark plan -o` file's fields; a verdict plan's engine must be the one served."""
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.measure.replay import read_plan_fields

    fields = read_plan_fields(plan)
    planned = fields.get("engine")
    if planned is not None and planned != engine_name:
        raise DsparkError(f"the plan {plan} was made with {planned}'s cost profile, and its draft length and verdict "
                          f"hold for that engine only; serve it with --engine {planned}, or plan with a profile of "
                          f"{engine_name}.")
    return fields


def plan_settings(fields: dict, plan: Path | None, block_size: int | None) -> tuple[int | None, float | None]:
    """The block size and threshold: a `dspark plan -o` file's (`fields`), else --block-size's and none."""
    if plan is None:
        return block_size, None
    from dspark_cli.errors import DsparkError

    if block_size is not None and block_size != fields["num_speculative_tokens"]:
        raise DsparkError(f"--block-size {block_size} contradicts the plan {plan} "
                          f"(num_speculative_tokens {fields['num_speculative_tokens']}); drop one.")
    return fields["num_speculative_tokens"] or None, fields.get("dspark_confidence_threshold")


def refuse_draft_options(plan: Path, **given) -> None:
    """A plan that says do not speculate serves the target alone, which would drop every option of the draft."""
    from dspark_cli.errors import DsparkError

    named = [f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None]
    if named:
        raise DsparkError(f"the plan {plan} says do not speculate, so the target is served alone and "
                          f"{' and '.join(named)} would be dropped; drop {'it' if len(named) == 1 else 'them'}.")


def serve_plain(chosen, request, reason: str, dry_run: bool, json_path: Path | None, force: bool) -> None:
    """The plan says speculation does not pay here: the engine's command for the target alone, and why."""
    from dspark_cli.errors import EXIT_BAD_INPUT, DsparkError
    from dspark_cli.runtime.engines.vllm import exec_vllm

    if chosen.plain is None:
        raise DsparkError(f"the plan says do not speculate ({reason}); serve the target with {chosen.label} alone.")
    argv = chosen.plain(request)
    command = shlex.join(argv)
    if json_path is not None:
        render.emit_json({"engine": chosen.name, "speculate": False, "reason": reason, "argv": argv,
                          "command": command, "exit_code": 0}, json_path, force)
        if options.to_stdout(json_path):
            return
    render.err_console.print(f"[bold yellow]plain decoding:[/] {escape(render.name_flags(reason))}; the plan's "
                             "verdict is to serve the target without its draft.", highlight=False, soft_wrap=True)
    print(command, flush=True)
    if dry_run or json_path is not None:
        return
    if not chosen.installed():
        render.err_console.print(f"[bold red]error:[/] {escape(chosen.install_hint)}", highlight=False,
                                 soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    sys.stderr.flush()
    exec_vllm(argv)


def from_plan_worded(error: Exception, plan: Path | None) -> Exception:
    """A block size the plan file set is the plan's num_speculative_tokens, not a --block-size the user gave."""
    from dspark_cli.errors import DsparkError, SettingError

    if plan is None or not (isinstance(error, SettingError) and error.setting == "block_size"):
        return error
    return DsparkError(f"{plan}: speculative_config.num_speculative_tokens {error.problem}", error.exit_code)
