"""`dspark generate`: speculative decoding with a DSpark draft, streamed, with an honest report.

Option parsing and rendering only: runtime/pair.py checks, loads and generates; generate_report.py renders."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.text import Text

from dspark_cli.cli import options, render

HELP = """Generate text with a target model and a DSpark draft (speculative decoding, lossless), stream it,
and report tau (incl. bonus), per-position acceptance, confidence calibration, timings and, with --baseline,
the speedup over plain decoding of the same target in the same run. Without --target/--draft the demo pair
shipped in the package is used; --pair demo-hybrid picks the hybrid (Qwen3.5-style) one. docs/generate.md describes
the algorithm and every figure."""

def register(app: typer.Typer) -> None:
    app.command("generate", help=HELP)(generate)


@render.handle_errors
def generate(
    prompt: Optional[str] = typer.Argument(None, metavar="PROMPT", help="Prompt text (or use --prompts; the demo "
                                           "pair has defaults)."),
    target: options.target() = None,
    draft: options.draft() = None,
    pair_name: options.pair() = None,
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="File of prompts: .txt (one per line) or .jsonl "
                                           "(strings, objects with a 'prompt' field, or dspark eval's prompt-set "
                                           "records: first of 'turns')."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1, help="Tokens to generate per prompt."),
    temperature: options.temperature() = 0.0,
    top_p: options.top_p() = 1.0,
    top_k: options.top_k() = 0,
    block_size: options.block_size() = None,
    draft_topk: options.draft_topk() = None,
    markov: options.markov() = "auto",
    confidence_threshold: options.confidence_threshold() = None,
    confidence_rule: options.confidence_rule() = "survival",
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Wrap each prompt in the tokenizer's chat "
                                        "template (default: when it has one)."),
    baseline: bool = typer.Option(False, "--baseline", help="Also decode plainly with the target and report the "
                                  "speedup (and, when greedy, any divergence)."),
    seed: options.seed("Seed of every random draw (reproducible runs)") = 0,
    device: options.device() = "auto",
    dtype: options.dtype() = "auto",
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="CPU threads for torch (default: 1 for "
                                          "models under 100 M parameters, whose small matmuls do not scale; else "
                                          "the cores the load average shows idle)."),
    json_path: options.json_path("every number (with '-', the streamed text goes to stderr)") = None,
    force: options.force("Replace an existing --json file.") = False,
    calibration: options.calibration() = None,
) -> None:
    from dspark_cli.cli.generate_report import json_document, print_report, settings_document
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.demo import DEMO_PROMPTS
    from dspark_cli.runtime.io.outputs import check_output_files, local_inputs
    from dspark_cli.runtime.measure.metrics import summarize
    from dspark_cli.runtime.pair import Pair
    from dspark_cli.runtime.threads import check_threads, set_threads

    out = render.err_console if options.to_stdout(json_path) else render.console
    if (target is None) != (draft is None):
        raise DsparkError("pass both --target and --draft, or neither to use the demo pair.")
    demo = target is None
    target, draft = options.pair_paths(pair_name, target, draft)
    texts = _prompt_texts(prompt, prompts) or (list(DEMO_PROMPTS) if demo else [])
    if not texts:
        raise DsparkError("give a PROMPT argument or --prompts FILE.")
    try:
        check_threads(threads)  # before anything loads: --threads 100000 would exhaust the host's process ids
    except ValueError as error:
        raise DsparkError(f"--threads: {error}.") from None
    checked = Pair.check(target, draft, device=device, dtype=dtype, temperatures=_temperatures(calibration),
                         block_size=block_size, draft_topk=draft_topk, markov=markov, temperature=temperature,
                         top_p=top_p, top_k=top_k, confidence_threshold=confidence_threshold,
                         confidence_rule=confidence_rule)
    inputs = (local_inputs("prompts file", [prompts]) + local_inputs("target", [checked.target_source])
              + local_inputs("--calibration file", [calibration]))
    check_output_files([("--json file", json_path)], inputs + [("draft checkpoint", checked.checkpoint.local_dir)],
                       force)
    _warn(out, checked.warnings)
    use_chat = checked.chat(chat)
    prompt_ids = [checked.encode(text, use_chat) for text in texts]
    checked.check_context([len(ids) for ids in prompt_ids], max_new_tokens)

    with out.status("loading the target and the draft"):
        pair = checked.load(progress=False)
        set_threads(threads, pair.target.model, pair.draft)
    _warn(out, pair.warnings[len(checked.warnings) :])
    settings = settings_document(checked, pair, max_new_tokens, seed, use_chat)
    with out.status("warming up"):
        pair.warm_up(prompt_ids[0], max_new_tokens=max_new_tokens, baseline=baseline, seed=seed)
    runs, stats, baseline_stats = _run_prompts(pair, texts, prompt_ids, out, baseline, max_new_tokens=max_new_tokens,
                                               seed=seed)
    summary = summarize(stats, baseline_stats if baseline else None, pair.block_size)
    print_report(out, settings, summary, runs, baseline, pair.settings.sampling.greedy)
    if json_path is not None:
        render.emit_json(json_document(settings, summary, runs, stats), json_path, force)


def _warn(out, warnings: list[str]) -> None:
    for warning in warnings:
        out.print(Text(f"warning: {warning}", style="yellow"))


def _temperatures(path: Optional[Path]) -> list[float] | None:
    """--calibration's STS temperatures (None without the option); Pair.check checks they cover the block."""
    if path is None:
        return None
    from dspark_cli.runtime.measure.calibration import load_temperatures

    return load_temperatures(path)


def _run_prompts(pair, texts: list[str], prompt_ids: list[list[int]], out, baseline: bool, **options):
    """Each prompt streamed as it is accepted, then (with baseline) decoded plainly. -> runs, stats, baseline stats."""
    from dspark_cli.cli.generate_report import PromptRun, Stream
    from dspark_cli.runtime.pair import first_divergence

    runs, stats, baseline_stats = [], [], []
    for index, (text, ids) in enumerate(zip(texts, prompt_ids)):
        out.print(Text(f"\n[{index + 1}/{len(texts)}] ", style="bold cyan") + Text(text, style="dim"))
        stream = Stream(pair.tokenizer, out)
        result = pair.generate(ids, on_tokens=stream, **options)
        stream.finish()
        run = PromptRun(text, len(ids), stream.text(), result.tokens, result.finished_by_stop)
        stats.append(result.stats)
        if baseline:
            with out.status("baseline (plain decoding)"):
                plain = pair.baseline(ids, **options)
            baseline_stats.append(plain.stats)
            run.baseline_tokens = plain.tokens
            if pair.settings.sampling.greedy:
                run.first_divergence = first_divergence(result.tokens, plain.tokens)
        runs.append(run)
    return runs, stats, baseline_stats


# --- inputs ----------------------------------------------------------------------------------------------------------


def _prompt_texts(prompt: Optional[str], prompts: Optional[Path]) -> list[str]:
    from dspark_cli.errors import DsparkError

    texts = [prompt] if prompt is not None else []
    if prompts is not None:
        texts += read_prompts(prompts)
    if any(not text for text in texts):
        raise DsparkError("a prompt is empty; give some text.")
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (Python keeps them as surrogates)
            shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            raise DsparkError(f"the prompt {shown[:80]!r} is not valid UTF-8; give it as UTF-8 text.") from None
    return texts


def read_prompts(path: Path) -> list[str]:
    """Prompts from a .txt file (one per non-empty line) or a .jsonl file (per line a JSON string, an object with
    a 'prompt' string, or a `dspark eval` prompt-set record whose 'turns' list gives the first turn)."""
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.io.reading import parse_json_text, read_bounded_text
    from dspark_cli.runtime.measure.evaluation import MAX_PROMPT_SET_BYTES, prompt_of_record

    lines = read_bounded_text(path, "prompts file", MAX_PROMPT_SET_BYTES).splitlines()  # ReadError: one sentence
    if path.suffix == ".txt":
        return [line for line in lines if line.strip()]
    if path.suffix != ".jsonl":
        raise DsparkError(f"--prompts {path}: use a .txt file (one prompt per line) or a .jsonl file.")
    texts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = parse_json_text(line, f"--prompts {path} line {number}", "give one JSON string or object per line",
                                 invalid="is not JSON")
        text = prompt_of_record(record)
        if not isinstance(text, str):
            raise DsparkError(f"--prompts {path} line {number}: give a JSON string, an object with a 'prompt' "
                              "string, or one with a 'turns' list of strings (the first turn is used).")
        texts.append(text)
    return texts
