"""`dspark train`: distill a DSpark (or DFlash) draft for a Hugging Face causal LM, online."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.text import Text

from dspark_cli.cli import options as opts
from dspark_cli.cli import render
from dspark_cli.errors import DsparkError, Terminated


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


@render.handle_errors
def train(
    target: opts.target("Target causal LM: a Hugging Face folder or hub id.") = ...,
    data: Optional[List[Path]] = typer.Option(None, "--data", help="Text, JSONL (text or chat messages) or a folder; "
                                              "repeat (or --features)."),
    features: Optional[Path] = typer.Option(None, "--features", help="Train from a feature cache written by dspark "
                                            "features instead of --data (the target's decoder layers never load)."),
    shard_target: bool = typer.Option(False, "--shard-target", help="Under torchrun: shard the frozen target's "
                                      "decoder layers across the processes (FSDP2); the draft stays under DDP."),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder for the draft and its checkpoints."),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, help="Draft decoder layers (default: 1; on "
                                         "--resume: the checkpoint's)."),
    block_size: opts.block_size("Tokens proposed per round (the anchor's slot included) (default: 7; on --resume: "
                                "the checkpoint's).", min=1) = None,
    target_layers: Optional[str] = typer.Option(None, "--target-layers",
                                                help="Target layer ids feeding the draft, e.g. 1,9,17 "
                                                "(default: evenly spaced like DeepSpec)."),
    markov_rank: Optional[int] = typer.Option(None, "--markov-rank", min=0, help="Markov head rank; 0 trains a "
                                              "DFlash draft (default: 256; on --resume: the checkpoint's)."),
    markov_head_type: Optional[str] = typer.Option(None, "--markov-head-type", help="Markov head type: vanilla, "
                                                   "gated or rnn (DeepSpec's; vLLM serves only vanilla) (default: "
                                                   "vanilla; on --resume: the checkpoint's)."),
    draft_arch: str = typer.Option("auto", "--draft-arch", help="Draft family: auto (gemma4 for a Gemma-4 target, "
                                   "else qwen3, as DeepSpec), qwen3, gemma4 or dflash2 (a DFlash2 draft)."),
    confidence: Optional[bool] = typer.Option(None, "--confidence/--no-confidence", help="Train a confidence head "
                                              "(default: on; on --resume: as the checkpoint)."),
    confidence_with_markov: Optional[bool] = typer.Option(None, "--confidence-with-markov/--confidence-without-markov",
                                                          help="Feed the Markov embedding to the confidence head "
                                                          "(default: on; on --resume: as the checkpoint)."),
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
    seed: opts.seed("Seed for initialisation, data windows and anchors") = 0,
    device: opts.device() = "auto",
    save_every: int = typer.Option(0, "--save-every", min=0, help="Write OUT/checkpoint-N every N steps (0: only "
                                   "the end)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue from OUT/checkpoint-N."),
    chat_template: Optional[Path] = typer.Option(None, "--chat-template",
                                                 help="Jinja chat template for JSONL 'messages' records "
                                                 "(default: the tokenizer's)."),
    force: opts.force("Replace a non-empty output folder.") = False,
    log: Optional[Path] = typer.Option(None, "--log-jsonl", help="Append one JSON line per step (loss, its terms, τ, "
                                       "lr, tokens/s) to this file."),
    tau_every: int = typer.Option(100, "--tau-every", min=0, help="Measure τ (greedy speculative loop, as generate "
                                  "and eval measure it) every N steps and at the end, on prompts held out from the "
                                  "end of the data (0: never; the data is then all trained on)."),
    tau_prompts: int = typer.Option(8, "--tau-prompts", min=1, help="Prompts of 64 tokens held out from the end of "
                                    "the data to measure τ on."),
    tau_data: Optional[Path] = typer.Option(None, "--tau-data", help="Measure τ on this prompt set instead, read and "
                                            "encoded as `dspark eval --data` does (with its stop tokens); the data is "
                                            "then all trained on."),
    tau_new_tokens: int = typer.Option(64, "--tau-new-tokens", min=1, help="New tokens per prompt when measuring τ "
                                       "(eval's --max-new-tokens)."),
    dist_timeout: float = typer.Option(600.0, "--dist-timeout",
                                       help="Under torchrun: seconds a process waits for the others in a "
                                       "collective before the run fails."),
    engine_name: opts.engine("Serving engine the draft is for: auto (the first that serves the head type: vllm for "
                             "vanilla, sglang for gated / rnn), vllm, sglang, trtllm or llamacpp; a head type it "
                             "cannot serve is refused before training, and the run ends with its verdict.",
                             choices=("auto", *opts.ENGINE_NAMES)) = "auto",
) -> None:

    from transformers.utils import logging as hf_logging

    from dspark_cli.runtime import distributed
    from dspark_cli.runtime.train.options import TrainOptions
    from dspark_cli.runtime.train.checks import checkpoint_shape
    from dspark_cli.runtime.train.new_draft import DraftShape
    from dspark_cli.runtime.io.outputs import is_disk_error, written_outputs
    from dspark_cli.runtime.train.output import check_log_file
    from dspark_cli.runtime.train.verdict import engine_for_head
    from dspark_cli.runtime.train.tau import TauProbe

    hf_logging.disable_progress_bar()

    if not (math.isfinite(lr) and lr > 0):
        raise DsparkError(f"--lr must be a finite number above 0 (got {lr}); the default is 6e-4.")
    from dspark_cli.runtime.checkpoint.heads import HEAD_TYPES
    from dspark_cli.runtime.checkpoint.families import FAMILIES

    if markov_head_type is not None and markov_head_type not in HEAD_TYPES:
        raise DsparkError(f"--markov-head-type {markov_head_type!r} is not a head type; choose "
                          f"{', '.join(HEAD_TYPES)}.")
    if draft_arch != "auto" and draft_arch not in FAMILIES:
        raise DsparkError(f"--draft-arch {draft_arch!r} is not a draft family; choose auto, {', '.join(FAMILIES)}.")
    given = {name: value for name, value in dict(
        layers=layers, block_size=block_size, target_layers=opts.layer_ids(target_layers, "--target-layers"),
        markov_rank=markov_rank,
        confidence=confidence, confidence_with_markov=confidence_with_markov, mask_token_id=mask_token_id,
        markov_head_type=markov_head_type, arch=None if draft_arch == "auto" else draft_arch,
    ).items() if value is not None}
    base = checkpoint_shape(resume) if resume is not None else DraftShape()
    shape = replace(base, **given, train_embeddings=train_embeddings, train_lm_head=train_lm_head)
    chosen = engine_for_head(engine_name, shape.markov_head_type)  # before anything loads
    options = TrainOptions(steps=steps, batch_size=batch_size, seq_len=seq_len, anchors=anchors, lr=lr, seed=seed,
                           save_every=save_every)
    dist = distributed.context_from_env()
    if (data is None) == (features is None):
        raise DsparkError("give the training data with --data or a feature cache with --features (one of them).")
    if shard_target and not dist.enabled:
        raise DsparkError("--shard-target shards the target across the processes of a torchrun job, but this is one "
                          "process; start it with torchrun (e.g. --nproc-per-node 2) or leave the option out.")
    if shard_target and features is not None:
        raise DsparkError("--shard-target and --features do not go together: training from features runs no target "
                          "to shard; leave one out.")
    if batch_size < dist.world_size:
        raise DsparkError(f"--batch-size {batch_size} is the global batch and must be at least the number of "
                          f"processes ({dist.world_size}).")
    with distributed.on_ranks(dist, opts.torch_device(device), dist_timeout, render.quiet) as backend:
        if backend is not None:
            render.console.print(f"training as {dist.world_size} processes (backend {backend}); rank 0 reports")
        if dist.is_main:
            check_log_file(log, out, target, data or [features], resume, chat_template)
        existed = out.exists()
        try:
            probe = TauProbe(every=tau_every, prompts=tau_prompts, new_tokens=tau_new_tokens, data=tau_data)
            final = _run(target, data, out, shape, options, device, resume, chat_template, force, log, dist, probe,
                         shard_target, features)
        except (KeyboardInterrupt, Terminated) as stop:
            if dist.is_main:  # rank 0 says what was kept; the others never write to `out`
                stop.kept = _kept_after_interrupt(out, existed)  # render.handle_errors prints it
            raise
        except OSError as error:  # a full disk or a read-only place while writing a checkpoint, the draft or the log
            if not (dist.is_main and is_disk_error(error)):
                raise
            where = f" {error.filename}" if error.filename else ""
            kept = _kept_after_interrupt(out, existed)  # the other outputs (the log) are named by handle_errors
            raise DsparkError(f"cannot write{where}: {error.strerror or error}; "
                              f"{kept or ('no checkpoint was written' if written_outputs() else 'nothing was written')}"
                              ".") from None
    render.console.print(Text.assemble("draft written to ", (str(final), "bold")))
    if dist.is_main:
        _judge(final, target, chosen, named=engine_name != "auto")


def _judge(final: Path, target: str, chosen, named: bool) -> None:
    """Each engine's verdict on the written draft (the one it was trained for marked); exit 1 (findings) when
    dspark's own checks refuse it, or the engine named with --engine does."""
    from dspark_cli.errors import EXIT_FINDINGS
    from dspark_cli.runtime.train.verdict import judge_written_draft

    written = judge_written_draft(final, target)
    for verdict in written.verdicts:
        codes = f" ({', '.join(f.code for f in verdict.refused)})" if verdict.refused else ""
        mark = "  (trained for)" if chosen is not None and verdict.engine == chosen.name else ""
        render.console.print(Text(f"  {verdict.label}: {verdict.status}{codes}{mark}", style="dim"))
    if written.refusals:
        raise DsparkError(f"the draft written to {final} fails dspark's own checks with this target: "
                          f"{written.refusals[0]} (`dspark validate {final} --target {target}` lists every finding; "
                          "the draft is kept).", EXIT_FINDINGS)
    ours = next((v for v in written.verdicts if chosen is not None and v.engine == chosen.name), None)
    if named and ours is not None and ours.refused:
        first = ours.refused[0]
        raise DsparkError(f"{chosen.label}, the engine this draft was trained for, refuses {final}: {first.code} "
                          f"{first.message} (the draft is kept; `dspark validate {final} --target {target} --engine "
                          f"{chosen.name}` lists every finding).", EXIT_FINDINGS)


def _run(target, data, out, shape, options, device, resume, chat_template, force, log, dist, probe, shard,
         features) -> Path:
    import json
    from dataclasses import asdict

    from dspark_cli.runtime import distributed
    from dspark_cli.runtime.train.output import open_log_file
    from dspark_cli.runtime.train.run import prepare_run
    from dspark_cli.runtime.train.trainer import train_loop

    with render.console.status("loading the target and the data"):
        run = dist.together(lambda: prepare_run(target, data, out, shape, options, device=device, resume=resume,
                                                chat_template=chat_template, force=force, dist=dist, tau=probe,
                                                shard=shard, features=features),
                            "loading the target, the data and the draft")
    trainer = run.trainer
    dist.same_everywhere(distributed.run_fingerprint(trainer.stream.tokens, trainer.options,
                                                       trainer.draft.config.raw, trainer.step),
                         "training data, options and starting point")
    for note in run.notes:
        render.console.print(Text(note, style="dim"))
    columns = (TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with ProgressWithStats(*columns, console=render.console) as progress:
        task = progress.add_task("train", total=options.steps, completed=run.trainer.step)
        log_file = open_log_file(log) if log is not None and dist.is_main else None

        measured = ["not measured yet"]

        def on_step(report) -> None:
            accept = " ".join(f"{a:.2f}" for a in report.accept)
            if report.tau is not None:
                measured[0] = f"{report.tau:.2f} (greedy, held-out prompts, step {report.step})"
                render.console.print(Text(f"step {report.step}: τ {report.tau:.2f}", style="dim"))
            progress.stats = (f"loss {report.loss:.3f} (ce {report.ce:.2f}, l1 {report.l1:.3f}, conf "
                              f"{report.confidence:.3f})  {report.tokens_per_s:,.0f} tok/s  τ {measured[0]}\n"
                              f"training anchors: 1 - TV per position {accept}")
            progress.update(task, completed=report.step)
            if log_file is not None:
                log_file.write(json.dumps(asdict(report)) + "\n")
                log_file.flush()

        try:
            return train_loop(run.trainer, run.out, on_step)
        finally:
            if log_file is not None:
                log_file.close()


def _kept_after_interrupt(out: Path, existed: bool) -> str | None:
    """What an interrupted run leaves in `out`, in one sentence (checkpoints are written whole or not at all); None
    when it leaves nothing there (outputs.kept_sentence then says what else, if anything, was written)."""
    if not out.is_dir():
        return None
    from dspark_cli.runtime.train.trainer import latest_checkpoint

    latest = latest_checkpoint(out)
    if latest is not None:
        return f"the latest checkpoint {latest} was kept; continue with --resume {latest}"
    if not existed and not any(out.iterdir()):
        out.rmdir()  # the empty folder this run created
        return None
    return f"no checkpoint was written in {out}"
