"""`dspark train`: distill a DSpark (or DFlash) draft for a Hugging Face causal LM, online."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.text import Text

from dspark_cli.cli import render
from dspark_cli.errors import DsparkError


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
    try:
        ids = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        ids = ()
    if not ids:
        raise DsparkError(f"--target-layers {text!r}: give comma-separated layer ids, e.g. 1,9,17.")
    return ids


@render.handle_errors
def train(
    target: str = typer.Option(..., "--target", help="Target causal LM: a Hugging Face folder or hub id."),
    data: List[Path] = typer.Option(..., "--data", help="Text, JSONL (text or chat messages) or a folder; repeat."),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder for the draft and its checkpoints."),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, help="Draft decoder layers [default: 1; on "
                                         "--resume: the checkpoint's]."),
    block_size: Optional[int] = typer.Option(None, "--block-size", min=1, help="Tokens proposed per round (the "
                                             "anchor's slot included) [default: 7; on --resume: the checkpoint's]."),
    target_layers: Optional[str] = typer.Option(None, "--target-layers",
                                                help="Target layer ids feeding the draft, e.g. 1,9,17 "
                                                "(default: evenly spaced like DeepSpec)."),
    markov_rank: Optional[int] = typer.Option(None, "--markov-rank", min=0, help="Markov head rank; 0 trains a "
                                              "DFlash draft [default: 256; on --resume: the checkpoint's]."),
    confidence: Optional[bool] = typer.Option(None, "--confidence/--no-confidence", help="Train a confidence head "
                                              "[default: on; on --resume: as the checkpoint]."),
    confidence_with_markov: Optional[bool] = typer.Option(None, "--confidence-with-markov/--confidence-without-markov",
                                                          help="Feed the Markov embedding to the confidence head "
                                                          "[default: on; on --resume: as the checkpoint]."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", min=0,
                                                help="Mask token id (default: the tokenizer's, else a free id, "
                                                "else one added to the draft's vocabulary)."),
    train_embeddings: bool = typer.Option(False, "--train-embeddings",
                                          help="Train the draft's own copy of the target's embedding (default: "
                                          "frozen, as DeepSpec)."),
    train_lm_head: bool = typer.Option(False, "--train-lm-head",
                                       help="Train the draft's own copy of the target's lm_head (default: frozen, "
                                       "as DeepSpec)."),
    steps: int = typer.Option(1000, "--steps", min=1, help="Optimizer steps."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Sequences per step."),
    seq_len: int = typer.Option(512, "--seq-len", min=2, help="Tokens per sequence (more than --block-size, at "
                                "most the target's max_position_embeddings)."),
    anchors: Optional[int] = typer.Option(None, "--anchors", min=1, help="Anchors (blocks) per sequence (default "
                                          "seq-len/8)."),
    lr: float = typer.Option(6e-4, "--lr", help="Peak learning rate (AdamW, warm-up then cosine decay)."),
    seed: int = typer.Option(0, "--seed", min=0, max=2**64 - 1, help="Seed for initialisation, data windows and "
                             "anchors."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    save_every: int = typer.Option(0, "--save-every", min=0, help="Write OUT/checkpoint-N every N steps (0: only "
                                   "the end)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue from OUT/checkpoint-N."),
    chat_template: Optional[Path] = typer.Option(None, "--chat-template",
                                                 help="Jinja chat template for JSONL 'messages' records "
                                                 "(default: the tokenizer's)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output folder."),
) -> None:

    from transformers.utils import logging as hf_logging

    from dspark_cli.runtime.training import DraftShape, TrainOptions, prepare_run, train_loop
    from dspark_cli.runtime.training_checks import checkpoint_shape

    hf_logging.disable_progress_bar()

    if not (math.isfinite(lr) and lr > 0):
        raise DsparkError(f"--lr must be a finite number above 0 (got {lr}); the default is 6e-4.")
    given = {name: value for name, value in dict(
        layers=layers, block_size=block_size, target_layers=_parse_layers(target_layers), markov_rank=markov_rank,
        confidence=confidence, confidence_with_markov=confidence_with_markov, mask_token_id=mask_token_id,
    ).items() if value is not None}
    base = checkpoint_shape(resume) if resume is not None else DraftShape()
    shape = replace(base, **given, train_embeddings=train_embeddings, train_lm_head=train_lm_head)
    options = TrainOptions(steps=steps, batch_size=batch_size, seq_len=seq_len, anchors=anchors, lr=lr, seed=seed,
                           save_every=save_every)
    with render.console.status("loading the target and the data"):
        run = prepare_run(target, data, out, shape, options, device=device, resume=resume,
                          chat_template=chat_template, force=force)
    for note in run.notes:
        render.console.print(f"[dim]{note}[/]")
    columns = (TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with ProgressWithStats(*columns, console=render.console) as progress:
        task = progress.add_task("train", total=steps, completed=run.trainer.step)

        def on_step(report) -> None:
            accept = " ".join(f"{a:.2f}" for a in report.accept)
            progress.stats = (f"loss {report.loss:.3f} (ce {report.ce:.2f}, l1 {report.l1:.3f}, conf "
                              f"{report.confidence:.3f})  τ≈{report.tau:.2f}  {report.tokens_per_s:,.0f} tok/s\n"
                              f"acceptance per position ≈ {accept}")
            progress.update(task, completed=report.step)

        final = train_loop(run.trainer, run.out, on_step)
    render.console.print(f"draft written to [bold]{final}[/] (check it with `dspark validate {final} --target "
                         f"{target}`)")

