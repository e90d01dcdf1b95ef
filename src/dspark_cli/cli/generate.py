"""`dspark generate`: speculative decoding with a DSpark draft, streamed, with an honest report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dspark_cli.cli import render

if TYPE_CHECKING:
    from dspark_cli.runtime.metrics import Summary

HELP = """Generate text with a target model and a DSpark draft (speculative decoding, lossless), stream it,
and report tau (incl. bonus), per-position acceptance, confidence calibration, timings and, with --baseline,
the speedup over plain decoding of the same target in the same run. Without --target/--draft the demo pair
shipped in the package is used. docs/generate.md describes the algorithm and every figure."""

MARKOV_CHOICES = ("auto", "dense", "topk", "nvfp4", "fused")
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}  # fmt: skip
BAR_WIDTH = 20
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits


def register(app: typer.Typer) -> None:
    app.command("generate", help=HELP)(generate)


@dataclass
class PromptRun:
    """One prompt's outputs, for the report and --json."""

    prompt: str
    prompt_tokens: int
    completion: str
    tokens: list[int]
    finished_by_stop: bool
    baseline_tokens: list[int] | None = None
    first_divergence: int | None = None  # greedy only: first index where speculative != baseline

    def to_dict(self) -> dict[str, Any]:
        doc = {"prompt": self.prompt, "prompt_tokens": self.prompt_tokens, "completion": self.completion,
               "new_tokens": len(self.tokens), "tokens": self.tokens, "finished_by_stop": self.finished_by_stop}  # fmt: skip
        if self.baseline_tokens is not None:
            doc.update(baseline_tokens=self.baseline_tokens, first_divergence=self.first_divergence)
        return doc


@dataclass
class Settings:
    target: str
    draft: str
    device: str
    dtype: str
    block_size: int
    trained_block_size: int | None
    markov: str
    draft_topk: int | None
    confidence_threshold: float | None
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int
    chat: bool
    warnings: list[str] = field(default_factory=list)


@render.handle_errors
def generate(
    prompt: Optional[str] = typer.Argument(None, metavar="PROMPT", help="Prompt text (or use --prompts; the demo "
                                           "pair has defaults)."),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="Target causal LM: folder or hub id."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="DSpark draft checkpoint: folder or hub id."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="File of prompts: .txt (one per line) or .jsonl "
                                           "(strings or objects with a 'prompt' field)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1, help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off); applied to target and draft."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Top-k sampling (0 = off); applied to target and draft."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Draft tokens per round (default: the "
                                             "trained block size, which is also the maximum)."),
    draft_topk: Optional[int] = typer.Option(None, "--draft-topk", help="Markov candidates per position, taken "
                                             "from the base logits (default: the config's dspark_draft_topk, "
                                             "else the dense Markov stage)."),
    markov: str = typer.Option("auto", "--markov", help="Markov stage: auto, dense, topk, nvfp4 or fused "
                               "(same tokens, different cost)."),
    confidence_threshold: Optional[float] = typer.Option(None, "--confidence-threshold", help="Verify only the "
                                                         "positions whose survival prod(c_i) >= X (needs a "
                                                         "confidence head; never changes the output distribution)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Wrap each prompt in the tokenizer's chat "
                                        "template (default: when it has one)."),
    baseline: bool = typer.Option(False, "--baseline", help="Also decode plainly with the target and report the "
                                  "speedup (and, when greedy, any divergence)."),
    seed: int = typer.Option(0, "--seed", min=0, max=SEED_MAX, help="Seed of every random draw (reproducible "
                             "runs; 0 to 2^64 - 1)."),
    device: str = typer.Option("auto", "--device", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bfloat16 on CUDA, float32 on CPU), float32, "
                              "bfloat16 or float16."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="CPU threads for torch (default: 1 for "
                                          "models under 100 M parameters, whose small matmuls do not scale; else "
                                          "the cores the load average shows idle)."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write every number to this JSON file ('-' = "
                                            "stdout; the streamed text then goes to stderr)."),
) -> None:
    import torch

    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.chat import encode_prompt
    from dspark_cli.runtime.checkpoint import open_checkpoint, read_target_config
    from dspark_cli.runtime.demo import DEMO_PROMPTS, demo_pair
    from dspark_cli.runtime.draft import DSparkDraft
    from dspark_cli.runtime.files import check_output_file, local_inputs
    from dspark_cli.runtime.markov import MarkovWeights, choose_strategy
    from dspark_cli.runtime.metrics import summarize
    from dspark_cli.runtime.paths import require_utf8_path
    from dspark_cli.runtime.sampling import SamplingParams
    from dspark_cli.runtime.speculative import (
        autoregressive_generate,
        check_context,
        check_pair,
        context_limit,
        nonfinite_warning,
        nonfinite_weights,
        speculative_generate,
    )
    from dspark_cli.runtime.target import TargetModel
    from dspark_cli.runtime.threads import set_threads

    out = render.err_console if json_path == "-" else render.console
    if (target is None) != (draft is None):
        raise DsparkError("pass both --target and --draft, or neither to use the demo pair.")
    texts = _prompt_texts(prompt, prompts)
    if target is None:
        target_path, draft_path = demo_pair()
        target, draft = str(target_path), str(draft_path)
        texts = texts or list(DEMO_PROMPTS)
    if not texts:
        raise DsparkError("give a PROMPT argument or --prompts FILE.")
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    except ValueError as error:
        raise DsparkError(f"{error}.") from None
    if confidence_threshold is not None and not 0.0 < confidence_threshold <= 1.0:
        raise DsparkError(f"--confidence-threshold must be in (0, 1], got {confidence_threshold}.")
    if markov not in MARKOV_CHOICES:
        raise DsparkError(f"--markov must be one of {', '.join(MARKOV_CHOICES)}, got {markov!r}.")
    torch_device = _device(device, torch)
    torch_dtype = _dtype(dtype, torch_device, torch)

    require_utf8_path(target, "--target")
    require_utf8_path(draft, "--draft")
    ckpt = open_checkpoint(draft)  # headers only: every check below runs before any weight is loaded
    inputs = local_inputs("prompts file", [prompts]) + local_inputs("target", [target])
    check_output_file(json_path, inputs + [("draft checkpoint", ckpt.local_dir)], "--json file")
    target_config = read_target_config(target)
    pair = check_pair(ckpt, target_config, block_size, draft_topk)
    for warning in pair.warnings:
        out.print(Text(f"warning: {warning}", style="yellow"))
    tokenizer = _tokenizer(target)
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if use_chat and not getattr(tokenizer, "chat_template", None):
        raise DsparkError(f"--chat: the tokenizer of {target} has no chat template; pass --no-chat.")
    prompt_ids = [encode_prompt(tokenizer, text, use_chat, target) for text in texts]
    check_context([len(ids) for ids in prompt_ids], max_new_tokens, context_limit(target_config), target)

    with out.status("loading the target and the draft"):
        from transformers.utils import logging as transformers_logging

        from dspark_cli.runtime.config import DraftConfig

        transformers_logging.disable_progress_bar()

        indices = DraftConfig.from_dict(ckpt.config).hidden_state_indices
        target_model = TargetModel.load(target, indices, dtype=torch_dtype, device=torch_device)
        draft_model = DSparkDraft.from_checkpoint(ckpt, target_embed=target_model.embed_weight,
                                                  target_lm_head=target_model.lm_head_weight,
                                                  dtype=torch_dtype, device=torch_device)  # fmt: skip
        set_threads(threads, target_model.model, draft_model)
    corrupt = nonfinite_warning(draft, nonfinite_weights(draft_model))
    if corrupt is not None:
        pair.warnings.append(corrupt)
        out.print(Text(f"warning: {corrupt}", style="yellow"))
    if confidence_threshold is not None and draft_model.confidence_head is None:
        raise DsparkError(f"{draft} has no confidence head, so --confidence-threshold cannot be used.")
    try:
        strategy = choose_strategy(markov, MarkovWeights.from_draft(draft_model), pair.draft_topk, params,
                                   torch_device.type == "cuda")  # fmt: skip
    except ValueError as error:
        raise DsparkError(f"--markov {markov}: {error}.") from None

    stop_ids = _stop_ids(target_model, tokenizer)
    settings = Settings(target, draft, str(torch_device), str(torch_dtype).removeprefix("torch."), pair.block_size,
                        pair.trained_block_size, strategy, pair.draft_topk, confidence_threshold, temperature, top_p,
                        top_k, max_new_tokens, seed, use_chat, pair.warnings)  # fmt: skip

    def run_speculative(ids, tokens, on_tokens=None):
        generator = torch.Generator(device=torch_device).manual_seed(seed)
        return speculative_generate(target_model, draft_model, ids, params, block_size=pair.block_size,
                                    max_new_tokens=tokens, strategy=strategy, draft_topk=pair.draft_topk,
                                    confidence_threshold=confidence_threshold, stop_ids=stop_ids,
                                    generator=generator, on_tokens=on_tokens)  # fmt: skip

    def run_baseline(ids, tokens):
        generator = torch.Generator(device=torch_device).manual_seed(seed)
        return autoregressive_generate(target_model, ids, params, max_new_tokens=tokens, stop_ids=stop_ids,
                                       generator=generator)  # fmt: skip

    with out.status("warming up"):  # first-call costs (allocators, kernels) would otherwise land on prompt 1
        run_speculative(prompt_ids[0], min(max_new_tokens, pair.block_size + 2))
        if baseline:
            run_baseline(prompt_ids[0], min(max_new_tokens, 4))

    runs, stats, baseline_stats = [], [], []
    for index, (text, ids) in enumerate(zip(texts, prompt_ids)):
        out.print(Text(f"\n[{index + 1}/{len(texts)}] ", style="bold cyan") + Text(text, style="dim"))
        stream = _Stream(tokenizer, out)
        result = run_speculative(ids, max_new_tokens, stream)
        stream.finish()
        run = PromptRun(text, len(ids), stream.text(), result.tokens, result.finished_by_stop)
        stats.append(result.stats)
        if baseline:
            with out.status("baseline (plain decoding)"):
                plain = run_baseline(ids, max_new_tokens)
            baseline_stats.append(plain.stats)
            run.baseline_tokens = plain.tokens
            if params.greedy:
                run.first_divergence = _first_divergence(result.tokens, plain.tokens)
        runs.append(run)

    summary = summarize(stats, baseline_stats if baseline else None, pair.block_size)
    print_report(out, settings, summary, runs, baseline, params.greedy)
    if json_path is not None:
        from dspark_cli.runtime.evaluation import stats_tau_interval
        from dspark_cli.runtime.metrics import round_dicts

        tau = stats_tau_interval(stats)
        render.emit_json({"settings": settings.__dict__, "summary": summary.to_dict(), "tau_ci": [tau.low, tau.high],
                          "prompts": [run.to_dict() for run in runs],
                          "rounds": [round_dicts(s) for s in stats]}, json_path)  # fmt: skip


# --- inputs ----------------------------------------------------------------------------------------------------------


def _prompt_texts(prompt: Optional[str], prompts: Optional[Path]) -> list[str]:
    from dspark_cli.errors import DsparkError

    texts = [prompt] if prompt is not None else []
    if prompts is not None:
        texts += read_prompts(prompts)
    if any(not text for text in texts):
        raise DsparkError("a prompt is empty; give some text.")
    return texts


def read_prompts(path: Path) -> list[str]:
    """Prompts from a .txt file (one per non-empty line) or a .jsonl file (a JSON string or an object with a
    'prompt' string per line)."""
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.checkpoint import parse_json_text

    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DsparkError(f"cannot read --prompts {path}: {error}.") from None
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
        text = record.get("prompt") if isinstance(record, dict) else record
        if not isinstance(text, str):
            raise DsparkError(f"--prompts {path} line {number}: give a JSON string or an object with a 'prompt' "
                              "string.")
        texts.append(text)
    return texts


def _device(name: str, torch):
    from dspark_cli.errors import DsparkError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DsparkError(f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DsparkError(f"--device {name}: CUDA is not available here; use --device cpu.")
    return device


def _dtype(name: str, device, torch):
    from dspark_cli.errors import DsparkError

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise DsparkError(f"--dtype must be auto, float32, bfloat16 or float16, got {name!r}.")
    return getattr(torch, DTYPES[name])


def _tokenizer(target: str):
    from transformers import AutoTokenizer

    from dspark_cli.errors import DsparkError

    try:
        return AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as error:
        raise DsparkError(f"cannot load a tokenizer from {target} ({error}); the target folder needs its tokenizer "
                          "files (tokenizer.json, tokenizer_config.json).") from None


def _stop_ids(target_model, tokenizer) -> list[int]:
    """The target's generation_config eos ids (int or list), else the tokenizer's eos."""
    config = getattr(target_model.model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def _first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    for index, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


class _Stream:
    """on_tokens callback: decodes everything so far and prints only the new text (multi-byte safe)."""

    def __init__(self, tokenizer, console: Console):
        self.tokenizer, self.console = tokenizer, console
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, new_tokens: list[int]) -> None:
        self.tokens += new_tokens
        text = self.text()
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            self.console.print(text[len(self.printed) :], end="", markup=False, highlight=False, soft_wrap=True)
            self.printed = text

    def finish(self) -> None:
        """Print whatever is left (an incomplete character at the very end) and end the line."""
        self.console.print(self.text()[len(self.printed) :], markup=False, highlight=False, soft_wrap=True)

    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)


# --- report ----------------------------------------------------------------------------------------------------------


def print_report(out: Console, settings: Settings, summary: "Summary", runs: list[PromptRun], baseline: bool,
                 greedy: bool) -> None:  # fmt: skip
    out.print(Text("\ndspark generate", style="bold") + Text(
        f"  block {settings.block_size}, markov {settings.markov}"
        + (f" (top-{settings.draft_topk})" if settings.draft_topk and settings.markov != "dense" else "")
        + (f", confidence >= {settings.confidence_threshold}" if settings.confidence_threshold else "")
        + f", T={settings.temperature}, {settings.device} {settings.dtype}", style="dim"))
    out.print(_acceptance_chart(summary))
    out.print(_histogram_chart(summary))
    out.print(_metrics_table(summary))
    if summary.calibration is not None:
        out.print(_calibration_table(summary))
    elif summary.calibration_unavailable is not None:
        out.print(Text(f"confidence calibration unavailable: {summary.calibration_unavailable}.", style="yellow"))
    if baseline and greedy:
        diverged = [(i, run.first_divergence) for i, run in enumerate(runs) if run.first_divergence is not None]
        if not diverged:
            out.print(Text(f"greedy output identical to plain decoding on all {len(runs)} prompts", style="green"))
        else:
            where = ", ".join(f"prompt {i + 1} at token {j}" for i, j in diverged)
            out.print(Text(f"greedy output differs from plain decoding: {where}. In {settings.dtype} a block verify "
                           "and one-token decoding round differently, so logit near-ties can flip; float32 is "
                           "token-identical (docs/generate.md).", style="yellow"))


def _bar(value: float | None, width: int = BAR_WIDTH) -> Text:
    if value is None:
        return Text("-".ljust(width), style="dim")
    filled = round(value * width)
    return Text("█" * filled, style="green") + Text("░" * (width - filled), style="dim")


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:5.1f}%"


def _acceptance_chart(summary: "Summary") -> Table:
    table = Table(title="per-position acceptance", title_justify="left", box=None, padding=(0, 1))
    table.add_column("pos", justify="right")
    table.add_column("unconditional", no_wrap=True)
    table.add_column("", justify="right", no_wrap=True)
    table.add_column("conditional (previous accepted)", no_wrap=True)
    table.add_column("", justify="right", no_wrap=True)
    for j, (unconditional, conditional) in enumerate(
        zip(summary.acceptance_unconditional, summary.acceptance_conditional)
    ):
        table.add_row(str(j + 1), _bar(unconditional), _percent(unconditional), _bar(conditional),
                      _percent(conditional))  # fmt: skip
    return table


def _histogram_chart(summary: "Summary") -> Table:
    table = Table(title="accepted draft tokens per round", title_justify="left", box=None, padding=(0, 1))
    table.add_column("accepted", justify="right")
    table.add_column("rounds")
    table.add_column("", justify="right")
    most = max(summary.accepted_histogram, default=0)
    for accepted, count in enumerate(summary.accepted_histogram):
        table.add_row(str(accepted), _bar(count / most if most else 0.0), str(count))
    return table


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _metrics_table(summary: "Summary") -> Table:
    table = Table(title="metrics", title_justify="left", show_header=False, box=None, padding=(0, 1))
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    rows = [
        ("τ (incl. bonus)", _number(summary.tau), "tokens per round (target forward)"),
        ("target forwards / token", _number(summary.target_forwards_per_token, 3), "1 / τ"),
        ("mean verified", _number(summary.mean_proposed), f"of {summary.block_size} drafted per round"),
        ("draft acceptance rate", _percent(summary.draft_acceptance_rate), "accepted / verified draft tokens"),
        ("prompts / rounds / new tokens", f"{summary.prompts} / {summary.rounds} / {summary.new_tokens}", ""),
        ("TTFT", _ms(summary.ttft_ms), "prefill + first token"),
        ("time per output token", _ms(summary.tpot_ms), "after the first token"),
        ("tokens / s", _number(summary.tokens_per_s, 1), "new tokens / wall clock"),
    ]
    breakdown = summary.round_breakdown
    if breakdown is not None:
        for name, ms, share in (
            ("draft backbone", breakdown.draft_backbone_ms, breakdown.draft_backbone_share),
            ("Markov stage", breakdown.markov_ms, breakdown.markov_share),
            ("verify", breakdown.verify_ms, breakdown.verify_share),
            ("other", breakdown.other_ms, breakdown.other_share),
        ):
            rows.append((f"  {name}", _ms(ms), f"per round, {_percent(share).strip()}"))
    if summary.baseline is not None:
        rows += [
            ("baseline tokens / s", _number(summary.baseline.tokens_per_s, 1), "plain decoding, same prompts"),
            ("baseline time per token", _ms(summary.baseline.tpot_ms), ""),
            ("speedup", _number(summary.baseline.speedup) + "x" if summary.baseline.speedup else "-",
             "tokens/s over baseline tokens/s"),
        ]  # fmt: skip
    for row in rows:
        table.add_row(*row)
    return table


def _calibration_table(summary: "Summary") -> Table:
    calibration = summary.calibration
    table = Table(title="confidence calibration (docs/metrics.md)", title_justify="left", box=None, padding=(0, 1))
    for column in ("", "pairs", "predicted", "observed", "ECE", "AUROC", "Brier"):
        table.add_column(column, justify="right" if column else "left")
    for name, cal in (("survival Π c_i", calibration.survival), ("per slot c_j", calibration.per_slot)):
        table.add_row(name, str(cal.count), _number(cal.mean_predicted, 3), _number(cal.observed_rate, 3),
                      _number(cal.ece, 3), _number(cal.auroc, 3), _number(cal.brier, 3))  # fmt: skip
    return table
