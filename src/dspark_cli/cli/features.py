"""`dspark features`: the target's training features of a corpus written to disk, for `dspark train --features`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.text import Text

from dspark_cli.cli import options as opts
from dspark_cli.cli import render
from dspark_cli.errors import DsparkError, Terminated


def register(app: typer.Typer) -> None:
    app.command(
        "features",
        help="Run the target once over a corpus and write its training features (token ids, the draft's target "
        "layers, the post-norm last hidden state) to a folder that `dspark train --features` reads; or convert "
        "speculators' hs_<i>.safetensors files. Resumable: run the same command again to continue.",
    )(features)


@render.handle_errors
def features(
    target: opts.target("Target causal LM: a Hugging Face folder or hub id.") = ...,
    out: Path = typer.Option(..., "--out", "-o", help="Output folder for the features (shards + manifest.json)."),
    data: Optional[List[Path]] = typer.Option(None, "--data", help="Text, JSONL (text or chat messages) or a folder; "
                                              "repeat (as for dspark train)."),
    chat_template: Optional[Path] = typer.Option(None, "--chat-template", help="Jinja chat template for JSONL "
                                                 "'messages' records (default: the tokenizer's)."),
    target_layers: Optional[str] = typer.Option(None, "--target-layers", help="Target layer ids to keep, e.g. 1,9,17 "
                                                "(default: the ones dspark train picks for --layers draft layers)."),
    layers: int = typer.Option(1, "--layers", min=1, help="Draft layers the default --target-layers are chosen for."),
    seq_len: int = typer.Option(512, "--seq-len", min=2, help="Tokens per record (the corpus is packed and cut into "
                                "records of this length, as dspark train's windows)."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Records per target forward."),
    records_per_shard: Optional[int] = typer.Option(None, "--records-per-shard", min=1, help="Records per shard file "
                                                    "(default: about 1 GiB of features per shard)."),
    from_speculators: Optional[Path] = typer.Option(None, "--from-speculators", help="Convert this folder of "
                                                    "speculators' hs_<i>.safetensors files instead of --data."),
    aux_layer_ids: Optional[str] = typer.Option(None, "--aux-layer-ids", help="With --from-speculators: the layer "
                                                "ids of its extraction (vLLM's aux ids, the last one the target's "
                                                "layer count), e.g. 2,18,33,36."),
    dtype: opts.dtype() = "auto",
    device: opts.device() = "auto",
    force: opts.force("Replace an output folder that holds anything else.") = False,
    dist_timeout: float = typer.Option(600.0, "--dist-timeout", help="Under torchrun: seconds a process waits for the "
                                       "others before the run fails."),
) -> None:
    from transformers.utils import logging as hf_logging

    from dspark_cli.runtime import distributed
    from dspark_cli.runtime.devices import resolve_dtype
    from dspark_cli.runtime.train import features_run

    hf_logging.disable_progress_bar()

    if (data is None) == (from_speculators is None):
        raise DsparkError("give the corpus with --data or speculators' files with --from-speculators (one of them).")
    if from_speculators is not None and aux_layer_ids is None:
        raise DsparkError("--from-speculators needs --aux-layer-ids: the layer ids its extraction used (speculators "
                          "does not store them in the files), e.g. 2,18,33,36 for a 36-layer target.")
    torch_device = opts.torch_device(device)
    try:
        torch_dtype = resolve_dtype(dtype, torch_device)
    except ValueError as error:
        raise DsparkError(f"--dtype {dtype!r}: {error}") from None
    dist = distributed.context_from_env()
    with distributed.on_ranks(dist, torch_device, dist_timeout, render.quiet) as backend:
        if backend is not None:
            render.console.print(f"writing features as {dist.world_size} processes (backend {backend}); rank 0 reports")
        device_here = dist.device(torch_device)

        def plan():
            if from_speculators is not None:
                aux_ids = opts.layer_ids(aux_layer_ids, "--aux-layer-ids", "2,18,33,36")
                return features_run.plan_speculators(target, from_speculators, aux_ids,
                                                     torch_dtype, device_here, records_per_shard=records_per_shard)
            ids = opts.layer_ids(target_layers, "--target-layers") or _default_layers(target, layers)
            return features_run.plan_corpus(target, data, ids, seq_len, torch_dtype, device_here,
                                            chat_template=chat_template, batch_size=batch_size,
                                            records_per_shard=records_per_shard)

        job = dist.together(plan, "reading the data")
        claim = dist.together(lambda: features_run.claim(job, out, force) if dist.is_main else None,
                              "checking the output folder")
        _print_cost(job)
        if dist.is_main:
            from dspark_cli.runtime.train.feature_cache import start_cache_folder

            start_cache_folder(out, job.spec, claim)
        dist.together(lambda: None, "creating the output folder")
        try:
            progress = dist.together(lambda: features_run.write(job, out, dist, _on_shard(job, dist)),
                                     "writing the shards")
        except (KeyboardInterrupt, Terminated) as stop:
            if dist.is_main:
                stop.kept = _kept(out, len(job.shards))
            raise
        manifest = dist.together(lambda: features_run.finish(job, out) if dist.is_main else None,
                                 "writing the manifest")
    if manifest is not None:
        from dspark_cli.runtime.units import format_bytes

        kept = f" ({progress.kept} of this process's shards were already whole)" if progress.kept else ""
        render.console.print(Text.assemble(
            f"{manifest['records']:,} records, {manifest['tokens']:,} tokens, "
            f"{format_bytes(manifest['bytes'], decimal=True)} written to ", (str(out), "bold"), kept))


def _default_layers(target: str, layers: int) -> list[int]:
    from dspark_cli.runtime.checkpoint.target_config import TargetConfig
    from dspark_cli.runtime.checkpoint.target_files import check_target_files
    from dspark_cli.runtime.train.new_draft import DraftShape, draft_target_layers

    config = TargetConfig.from_dict(check_target_files(target).to_dict())
    return list(draft_target_layers(config, DraftShape(layers=layers)))


def _print_cost(job) -> None:
    """The disk cost, printed before anything is written."""
    from dspark_cli.runtime.units import format_bytes

    spec = job.spec
    render.console.print(
        f"features of layers {list(spec.layer_ids)} + the last hidden state, {spec.dtype}: "
        f"{job.bytes_per_token:,} bytes per token ({len(spec.layer_ids) + 1} x {spec.hidden_size} x "
        f"{spec.torch_dtype.itemsize} + 9 for the id and mask); {job.records:,} records, {job.tokens:,} tokens: "
        f"about {format_bytes(job.total_bytes, decimal=True)} in {len(job.shards)} shard(s)")


def _on_shard(job, dist):
    def report(progress) -> None:
        if dist.is_main:
            render.console.print(Text(f"shard {progress.done} of {progress.mine} (this process) done", style="dim"))
    return report


def _kept(out: Path, shards: int) -> str | None:
    from dspark_cli.runtime.train.feature_cache import finished_shards

    if not out.is_dir():
        return None  # outputs.kept_sentence: nothing was written
    return (f"{finished_shards(out)} of {shards} shards in {out} are whole and kept; run the same command again to "
            "continue")
