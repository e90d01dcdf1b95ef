"""`dspark generate`'s rendering: the streamed text, the report tables, and the records behind --json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dspark_cli.cli.render import drafting_stage, stage_label

if TYPE_CHECKING:
    from dspark_cli.runtime.measure.metrics import Summary

BAR_WIDTH = 20


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
               "new_tokens": len(self.tokens), "tokens": self.tokens, "finished_by_stop": self.finished_by_stop}
        if self.baseline_tokens is not None:
            doc.update(baseline_tokens=self.baseline_tokens, first_divergence=self.first_divergence)
        return doc


def settings_document(checked, pair, max_new_tokens: int, seed: int, chat: bool) -> dict[str, Any]:
    """The run's settings as --json writes them (the keys and their order are the document's): the checked pair's
    resolved DecodeSettings plus what the command added."""
    s = checked.settings
    return {"target": checked.target_source, "draft": checked.draft_source, "device": str(pair.device),
            "dtype": str(checked.dtype).removeprefix("torch."), "block_size": s.block_size,
            "trained_block_size": s.trained_block_size, "markov": s.markov, "draft_topk": s.draft_topk,
            "confidence_threshold": s.verify.threshold, "temperature": s.sampling.temperature,
            "top_p": s.sampling.top_p, "top_k": s.sampling.top_k, "max_new_tokens": max_new_tokens, "seed": seed,
            "chat": chat, "warnings": pair.warnings, "draft_kind": pair.draft_kind}


class Stream:
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


def json_document(settings: dict[str, Any], summary: "Summary", runs: list[PromptRun], stats: list) -> dict[str, Any]:
    """Every number of the run for --json: settings, summary, τ's interval, per prompt, and every round."""
    from dspark_cli.runtime.measure.evaluation import stats_tau_interval
    from dspark_cli.runtime.measure.metrics import round_dicts

    tau = stats_tau_interval(stats)
    return {"settings": settings, "summary": summary.to_dict(), "tau_ci": [tau.low, tau.high],
            "prompts": [run.to_dict() for run in runs], "rounds": [round_dicts(s) for s in stats]}


def print_report(out: Console, settings: dict[str, Any], summary: "Summary", runs: list[PromptRun], baseline: bool,
                 greedy: bool) -> None:
    out.print(Text("\ndspark generate", style="bold") + Text(
        f"  {settings['draft_kind'] + ', ' if settings['draft_kind'] else ''}block {settings['block_size']}, "
        f"{drafting_stage(settings)}"
        + (f", confidence >= {settings['confidence_threshold']}" if settings["confidence_threshold"] else "")
        + f", T={settings['temperature']}, {settings['device']} {settings['dtype']}", style="dim"))
    out.print(_acceptance_chart(summary))
    out.print(_histogram_chart(summary))
    out.print(_metrics_table(summary, stage_label(settings["markov"])))
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
            out.print(Text(f"greedy output differs from plain decoding: {where}. In {settings['dtype']} a block score "
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
                      _percent(conditional))
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


def _metrics_table(summary: "Summary", stage: str) -> Table:
    table = Table(title="metrics", title_justify="left", show_header=False, box=None, padding=(0, 1))
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    rows = [
        ("τ (incl. bonus)", _number(summary.tau), "tokens per round (target forward)"),
        ("target forwards / token", _number(summary.target_forwards_per_token, 3), "1 / τ"),
        ("mean scored", _number(summary.mean_proposed), f"of {summary.block_size} drafted per round"),
        ("draft acceptance rate", _percent(summary.draft_acceptance_rate), "accepted / scored draft tokens"),
        ("prompts / rounds / new tokens", f"{summary.prompts} / {summary.rounds} / {summary.new_tokens}", ""),
        ("TTFT", _ms(summary.ttft_ms), "prefill + first token"),
        ("time per output token", _ms(summary.tpot_ms), "after the first token"),
        ("tokens / s", _number(summary.tokens_per_s, 1), "new tokens / wall clock"),
    ]
    breakdown = summary.round_breakdown
    if breakdown is not None:
        for name, ms, share in (
            ("draft backbone", breakdown.draft_backbone_ms, breakdown.draft_backbone_share),
            (stage, breakdown.markov_ms, breakdown.markov_share),
            ("verify (score + accept)", breakdown.verify_ms, breakdown.verify_share),
            ("rollback (crop, state restore)", breakdown.rollback_ms, breakdown.rollback_share),
            ("other (commit + advance)", breakdown.other_ms, breakdown.other_share),
        ):
            rows.append((f"  {name}", _ms(ms), f"per round, {_percent(share).strip()}"))
    if summary.baseline is not None:
        rows += [
            ("baseline tokens / s", _number(summary.baseline.tokens_per_s, 1), "plain decoding, same prompts"),
            ("baseline time per token", _ms(summary.baseline.tpot_ms), ""),
            ("speedup", _number(summary.baseline.speedup) + "x" if summary.baseline.speedup else "-",
             "tokens/s over baseline tokens/s"),
        ]
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
                      _number(cal.ece, 3), _number(cal.auroc, 3), _number(cal.brier, 3))
    return table
