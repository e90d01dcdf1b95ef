"""`dspark train`: distill a DSpark (or DFlash) draft for a Hugging Face causal LM, online."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.text import Text

from dspark_cli.cli import render
from dspark_cli.errors import Terminated


class ProgressWithStats(Progress):
    """A progress bar with the latest training figures on the lines below it."""

    stats = ""

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        if self.stats:
            yield Text(self.stats, style="dim")


def register(app: typer.Typer) -> None:
    app.command(
        "train",
        help="Train a DSpark draft for a causal LM by online distillation (target states computed on the fly). "
        "The demo pair is built by scripts/build_demo.py with the same code.",
    )(train)


def _parse_layers(text: Optional[str]) -> Optional[tuple[int, ...]]:
    if text is None:
        return None
    from dspark_cli.errors import DsparkError

    try:
        return tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise DsparkError(f"--target-layers {text!r}: give comma-separated layer ids, e.g. 1,9,17.") from None


@render.handle_errors
def train(
    target: str = typer.Option(..., "--target", help="Target causal LM: a Hugging Face folder or hub id."),
    data: List[Path] = typer.Option(..., "--data", help="Text, JSONL (text or chat messages) or a folder; repeat."),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder for the draft and its checkpoints."),
    layers: int = typer.Option(1, "--layers", help="Draft decoder layers."),
    block_size: int = typer.Option(7, "--block-size", help="Tokens proposed per round (the anchor's slot included)."),
    target_layers: Optional[str] = typer.Option(None, "--target-layers",
                                                help="Target layer ids feeding the draft, e.g. 1,9,17 "
                                                "(default: evenly spaced like DeepSpec)."),
    markov_rank: int = typer.Option(256, "--markov-rank", help="Markov head rank; 0 trains a DFlash draft."),
    confidence: bool = typer.Option(True, "--confidence/--no-confidence", help="Train a confidence head."),
    confidence_with_markov: bool = typer.Option(True, "--confidence-with-markov/--confidence-without-markov",
                                                help="Feed the Markov embedding to the confidence head."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id",
                                                help="Mask token id (default: the tokenizer's, else a free id, "
                                                "else one added to the draft's vocabulary)."),
    train_embeddings: bool = typer.Option(False, "--train-embeddings",
                                          help="Train the draft's own copy of the target's embedding (default: "
                                          "frozen, as DeepSpec)."),
    train_lm_head: bool = typer.Option(False, "--train-lm-head",
                                       help="Train the draft's own copy of the target's lm_head (default: frozen, "
                                       "as DeepSpec)."),
    steps: int = typer.Option(1000, "--steps", help="Optimizer steps."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per step."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per sequence."),
    anchors: Optional[int] = typer.Option(None, "--anchors", help="Anchors (blocks) per sequence (default seq-len/8)."),
    lr: float = typer.Option(6e-4, "--lr", help="Peak learning rate (AdamW, warm-up then cosine decay)."),
    seed: int = typer.Option(0, "--seed", help="Seed for initialisation, data windows and anchors."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    save_every: int = typer.Option(0, "--save-every", help="Write OUT/checkpoint-N every N steps (0: only the end)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue from OUT/checkpoint-N."),
    chat_template: Optional[Path] = typer.Option(None, "--chat-template",
                                                 help="Jinja chat template for JSONL 'messages' records "
                                                 "(default: the tokenizer's)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output folder."),
) -> None:

    from transformers.utils import logging as hf_logging

    from dspark_cli.runtime.training import DraftShape, TrainOptions

    hf_logging.disable_progress_bar()

    shape = DraftShape(layers=layers, block_size=block_size, target_layers=_parse_layers(target_layers),
                       markov_rank=markov_rank, confidence=confidence,
                       confidence_with_markov=confidence_with_markov, mask_token_id=mask_token_id,
                       train_embeddings=train_embeddings, train_lm_head=train_lm_head)
    options = TrainOptions(steps=steps, batch_size=batch_size, seq_len=seq_len, anchors=anchors, lr=lr, seed=seed,
                           save_every=save_every)
    _check_positive(steps=steps, batch_size=batch_size, seq_len=seq_len, layers=layers, block_size=block_size)
    existed = out.exists()
    try:
        final = _run(target, data, out, shape, options, device, resume, chat_template, force)
    except (KeyboardInterrupt, Terminated) as stop:
        stop.kept = _kept_after_interrupt(out, existed)  # render.handle_errors prints it
        raise
    render.console.print(Text.assemble("draft written to ", (str(final), "bold"),
                                       f" (check it with `dspark validate {final} --target {target}`)"))


def _run(target, data, out, shape, options, device, resume, chat_template, force) -> Path:
    from dspark_cli.runtime.training import prepare_run, train_loop

    steps = options.steps
    with render.console.status("loading the target and the data"):
        run = prepare_run(target, data, out, shape, options, device=device, resume=resume,
                          chat_template=chat_template, force=force)
    for note in run.notes:
        render.console.print(Text(note, style="dim"))
    columns = (TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with ProgressWithStats(*columns, console=render.console) as progress:
        task = progress.add_task("train", total=steps, completed=run.trainer.step)

        def on_step(report) -> None:
            accept = " ".join(f"{a:.2f}" for a in report.accept)
            progress.stats = (f"loss {report.loss:.3f} (ce {report.ce:.2f}, l1 {report.l1:.3f}, conf "
                              f"{report.confidence:.3f})  τ≈{report.tau:.2f}  {report.tokens_per_s:,.0f} tok/s\n"
                              f"acceptance per position ≈ {accept}")
            progress.update(task, completed=report.step)

        return train_loop(run.trainer, run.out, on_step)


def _kept_after_interrupt(out: Path, existed: bool) -> str:
    """What an interrupted run leaves in `out`, in one sentence (checkpoints are written whole or not at all)."""
    if not out.is_dir():
        return "nothing was written"
    from dspark_cli.runtime.training import latest_checkpoint

    latest = latest_checkpoint(out)
    if latest is not None:
        return f"the latest checkpoint {latest} was kept; continue with --resume {latest}"
    if not existed and not any(out.iterdir()):
        out.rmdir()  # the empty folder this run created
        return "nothing was written"
    return f"no checkpoint was written in {out}"


def _check_positive(**values: int) -> None:
    from dspark_cli.errors import DsparkError

    for name, value in values.items():
        if value < 1:
            raise DsparkError(f"--{name.replace('_', '-')} must be at least 1 (got {value}).")
