"""`dspark bench audit`: a live engine's speculative output against its plain output and dspark's reference
(docs/bench.md); the library half is runtime/bench/audit.py."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from dspark_cli.cli import options, render
from dspark_cli.cli.render import console, emit_json, err_console, handle_errors, name_flags
from dspark_cli.errors import DsparkError


def register(bench_app: typer.Typer) -> None:
    bench_app.command("audit")(handle_errors(audit))


def audit(
    url: str = typer.Argument(..., metavar="URL", help="The engine serving the target with its draft, e.g. "
                              "http://127.0.0.1:8081."),
    plain: str = typer.Option(..., "--plain", metavar="URL", help="The same engine serving the target alone."),
    target: options.target("The target (folder or hub id) for dspark's reference decoding; with --draft.") = None,
    draft: options.draft("The draft of the pair (folder or hub id), with --target.") = None,
    prompts: Path = typer.Option(None, "--prompts", metavar="FILE", help="Prompts: .jsonl (DeepSpec's `turns`, or "
                                 "`prompt`) or .txt (default: the shipped audit set: code, prose, tool calls, JSON, "
                                 "chat-template and long prompts)."),
    requests: int = typer.Option(None, "--requests", min=1, max=1000, help="Audit only the first N prompts."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, max=100_000, help="Tokens generated per prompt at "
                                   "T = 0, every one compared."),
    samples: int = typer.Option(400, "--samples", min=0, max=100_000, help="Requests per server and sampling check "
                                "at T > 0 (0: no T > 0 check)."),
    alpha: float = typer.Option(0.01, "--alpha", help="Significance level of the T > 0 check, over all its tests."),
    sample_prompt: int = typer.Option(0, "--sample-prompt", min=0, help="Index of the prompt the T > 0 check "
                                      "continues."),
    tie_margin: float = typer.Option(0.01, "--tie-margin", min=0.0, help="Logits within which the reference's two "
                                     "best tokens are a near tie, not a difference (needs --target)."),
    seed: options.seed("First seed of the sampled requests") = 0,
    concurrency: int = typer.Option(2, "--concurrency", min=1, max=256, help="Sampled requests in flight."),
    timeout: float = typer.Option(120.0, "--timeout", min=0.001, help="Seconds one request may take."),
    engine: str = typer.Option("auto", "--engine", help="auto, llamacpp, vllm or sglang (auto: told from the "
                               "server)."),
    model: str = typer.Option(None, "--model", help="The model name sent with each request to vLLM / SGLang "
                              "(default: the server's first /v1/models entry)."),
    device: options.device("Device of the reference decoding: auto, cpu, cuda or cuda:N.") = "auto",
    json_out: options.json_path("the audit (the tables then go to stderr)") = None,
    force: options.force("Replace an existing --json file.") = False,
) -> None:
    """Check a running engine's speculation for losslessness: at T = 0 every generated token of every prompt
    against the same engine without its draft and against dspark's reference; at T > 0 the sampled tokens'
    distributions (chi-square test at fixed positions).

    Exit code 0 when identical and the T > 0 check passes, 1 when a prompt differs or the T > 0 check fails,
    3 when inconclusive (no difference, but the engine drafted or accepted nothing for a prompt), 2 on bad
    input or an unreachable server.
    """
    from dspark_cli.cli.bench import _check_exclusive
    from dspark_cli.runtime.bench.audit import AuditConfig, read_audit_prompts, run_audit, shipped_prompts

    if (target is None) != (draft is None):
        raise DsparkError("give both --target and --draft for dspark's reference decoding, or neither to compare "
                          "the engine with itself only.")
    if not math.isfinite(timeout):
        raise DsparkError(f"--timeout must be a finite number of seconds, got {timeout}.")
    inputs = [] if prompts is None else [("prompts file", prompts)]
    _check_exclusive([("--json file", json_out)], inputs, force)
    chosen = (read_audit_prompts(prompts) if prompts else shipped_prompts())[:requests]
    config = AuditConfig(speculative=url, plain=plain, prompts=chosen,
                         reference=None if target is None else (target, draft), max_tokens=max_tokens,
                         samples=samples, alpha=alpha, sample_prompt=sample_prompt, seed=seed,
                         concurrency=concurrency, timeout_s=timeout, engine=engine, model=model, device=device,
                         tie_margin=tie_margin)
    with err_console.status("auditing") as status:
        report = run_audit(config, on_progress=status.update)
    out = err_console if options.to_stdout(json_out) else console
    out.print(render.fitted(out, lambda padding: _prompt_table(report, padding)))
    if report.checks:
        out.print(render.fitted(out, lambda padding: _check_table(report, padding)))
    for note in _notes(report):
        out.print(Text(f"• {name_flags(note)}", style="dim"), highlight=False)
    if json_out is not None:
        emit_json(report.to_dict(), json_out, force)
    if report.verdict != "identical":
        raise DsparkError(_verdict_sentence(report), report.exit_code)
    out.print(Text(_verdict_sentence(report), style="bold green"), highlight=False)


def _difference_cell(difference) -> str:
    if difference is None:
        return "="
    text = "" if difference.speculative_text is None else f" {difference.speculative_text!r}≠{difference.other_text!r}"
    return f"@{difference.position}: {difference.speculative}≠{difference.other}{text}"


def _prompt_table(report, padding: tuple[int, int]) -> Table:
    spec = report.servers["speculative"]
    table = Table(title=Text(f"bench audit · {spec.url} ({spec.engine}) · T = 0, {report.config.max_tokens} tokens"),
                  title_justify="left", box=box.SIMPLE_HEAD, padding=padding)
    render.columns(table, ("#", "kind", "prompt", "drafted", "accepted", "vs plain", "vs reference", "ties",
                           "verdict"))
    for p in report.prompts:
        table.add_row(str(p.index), p.kind, str(len(p.prompt_ids)), _count(p.drafted), _count(p.accepted),
                      _difference_cell(p.vs_plain),
                      "" if p.reference is None else _difference_cell(p.vs_reference), str(len(p.ties) or ""),
                      p.verdict)
    return table


def _check_table(report, padding: tuple[int, int]) -> Table:
    table = Table(title=Text(f"T > 0: {report.config.samples} samples per server and check, chi-square test, "
                             f"alpha {report.config.alpha:g}"), title_justify="left", box=box.SIMPLE_HEAD,
                  padding=padding)
    render.columns(table, ("check", "T", "top-p", "top-k", "position", "bins", "chi2", "p", "threshold", "TV",
                           "verdict"))
    for c in report.checks:
        table.add_row(c.name, f"{c.sampling.temperature:g}", f"{c.sampling.top_p:g}", str(c.sampling.top_k),
                      str(c.position), str(c.test.bins), f"{c.test.chi2:.1f}", f"{c.test.p:.3g}",
                      f"{c.threshold:.3g}", f"{c.test.tv:.3f}", "pass" if c.passed else "FAIL")
    return table


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


def _notes(report) -> list[str]:
    notes = ["vs plain / vs reference: = when every generated token is equal, else @position: the speculative "
             "token ≠ the other one and the text from there; ties: near ties of the reference (within the "
             "tie-margin option) where a server took the other candidate, passed over on the reference's token."]
    if report.config.reference is None:
        notes.append("no reference: pass the target and draft options to compare with dspark's own decoding too.")
    if any(p.plain_vs_reference is not None for p in report.prompts):
        notes.append("the plain server itself differs from dspark's reference on some prompt (the JSON's "
                     "plain_vs_reference): the engine's numerics, not its speculation.")
    if report.drafting_unknown:
        notes.append(f"the {report.servers['speculative'].engine} server reports no drafting counts, so equality "
                     "cannot show that speculation ran.")
    return notes


def _verdict_sentence(report) -> str:
    counts = report.to_dict()["greedy"]
    sampling = {None: "no T > 0 check", True: "the T > 0 check passed", False: "the T > 0 check FAILED"}[
        report.distribution_passed]
    summary = (f"{counts['identical']} of {counts['prompts']} prompts identical, {counts['differs']} differ, "
               f"{counts['inconclusive']} inconclusive; {sampling}")
    if report.verdict == "differs":
        return f"the engine's speculative output differs from its plain output: {summary}."
    if report.verdict == "inconclusive":
        return (f"inconclusive: {summary}; the engine drafted or accepted nothing where the table says so, so "
                "equality proves nothing there: check that its draft is loaded and used.")
    return f"identical: {summary}."
