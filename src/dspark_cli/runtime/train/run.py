"""A whole `dspark train` run prepared: the target, the data and the draft (new or resumed) with its trainer.

Everything that can be checked without the weights is checked before the target and the draft are allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.devices import resolve_device, resolve_dtype
from dspark_cli.runtime.model.target import TargetModel, load_causal_lm
from dspark_cli.runtime.pair import stop_ids
from dspark_cli.runtime.checkpoint.target_config import TargetConfig
from dspark_cli.runtime.checkpoint.target_files import check_target_files, load_target_tokenizer
from dspark_cli.runtime.train.options import TrainOptions
from dspark_cli.runtime.train.features import TargetHead
from dspark_cli.runtime.train.tau import TauProbe, eval_prompts, held_out
from dspark_cli.runtime.train.data import TokenStream
from dspark_cli.runtime.train.trainer import DraftTrainer
from dspark_cli.runtime.train.new_draft import DraftShape, build_draft, train_shared_weights, trainable_parameters
from dspark_cli.runtime.distributed import SINGLE, DistContext


@dataclass
class TrainingRun:
    trainer: DraftTrainer
    out: Path
    notes: list[str]  # what was decided on the user's behalf (mask token, target layers, resume point)


def load_tokenizer_and_config(path: str | Path) -> tuple[object, TargetConfig]:
    """The target's tokenizer and its config (whose text config is the model AutoModelForCausalLM loads: the whole
    config.json for a text-only model, `text_config` for a multimodal one such as every released Qwen3.5 or a
    Gemma-4 with vision), without loading its weights."""
    config = check_target_files(path)  # config values and weight headers, one sentence naming the file
    return load_target_tokenizer(path), TargetConfig.from_dict(config.to_dict())


def load_target_model(path: str | Path, device: torch.device):
    """The frozen target (bf16 on CUDA, fp32 on CPU), loaded as `dspark generate` loads it (load_causal_lm)."""
    model = load_causal_lm(path, dtype=resolve_dtype("auto", device), device=device)
    return model.eval().requires_grad_(False)


def prepare_run(target_path: str | Path, data: list[Path], out: Path, shape: DraftShape, options: TrainOptions, *,
                device: str = "auto", resume: Path | None = None, chat_template: Path | None = None,
                force: bool = False, dist: DistContext = SINGLE, tau: TauProbe = TauProbe(), shard: bool = False,
                features: Path | None = None) -> TrainingRun:
    """Load the target and data, create (or resume) the draft and its trainer; `out` is created here (by rank 0
    alone when many processes train: the others never touch it). `shard`: the target's decoder layers are sharded
    across the processes (FSDP2, train/shard_target.py) once the draft has copied what it shares with the target.
    `features`: a feature cache (`dspark features`) replaces the data and the target's forward: its manifest is
    checked against this run, and only the target's embedding, final norm and lm_head are read (train/cached.py).

    Everything that can be checked without the weights (the output folder, the window, one step's memory, the
    resume checkpoint) is checked before the target and the draft are allocated. With `tau.every`, the tail of the
    data (tau.held_tokens tokens) is held out of training as the prompts on which τ is measured (tau.py), when the
    data holds at least ten times as much; with `tau.data`, the prompts of that prompt set, encoded as `dspark eval`
    encodes them."""
    from dspark_cli.runtime.train.checks import plan_draft, read_resume_point
    from dspark_cli.runtime.train.trainer import restore_trainer
    from dspark_cli.runtime.train.data import load_token_stream
    from dspark_cli.runtime.train.output import check_output, create_output

    torch_device = dist.device(resolve_device(device))
    out = Path(out)
    inputs = data if features is None else [Path(features)]
    claim = check_output(out, target_path, inputs, resume, chat_template, force) if dist.is_main else None
    tokenizer, target = load_tokenizer_and_config(target_path)
    if features is None:
        stream = load_token_stream(data, tokenizer, chat_template)
    else:
        from dspark_cli.runtime.train.cached import open_features

        stream, shape = open_features(features, shape)
    if features is not None or shard:  # rank 0 alone measures τ: it needs a whole target of its own
        prompts, tau_note = None, ("τ is not measured: training from cached features runs no target"
                                   if features is not None else "τ is not measured with a sharded target (it runs "
                                   "only when every process runs it)")
    else:
        stream, prompts, tau_note = hold_out_prompts(stream, tau)
        if tau.every and tau.data is not None:
            prompts = [torch.tensor(ids, dtype=torch.long) for ids in eval_prompts(tau.data, tokenizer,
                                                                                   str(target_path))]
    seq_len = min(options.seq_len, stream.max_window)
    point = read_resume_point(resume) if resume is not None else None
    resident = 0 if features is not None else -(-target.num_hidden_layers // dist.world_size) if shard else None
    config, notes = plan_draft(target, tokenizer, shape, options, seq_len, len(stream), point, torch_device, resident)
    if features is None:
        target = load_target_model(target_path, torch_device)
        TargetHead(target).check(target, stream.tokens[None, :16].to(torch_device), str(target_path))
    else:
        from dspark_cli.runtime.train.cached import check_features, load_head_target

        check_features(stream.cache, config, target, tokenizer, chat_template, torch_device)
        target = load_head_target(target_path, torch_device)
    torch.manual_seed(options.seed)
    draft = build_draft(config, target)
    train_shared_weights(draft, shape)
    if shard:
        from dspark_cli.runtime.train.shard_target import shard_target

        notes.append(shard_target(target, dist).note(dist.world_size))
    if point is not None:
        saved = {name.removeprefix("draft.") for name in point.tensors if name.startswith("draft.")}
        if saved != {name for name, p in draft.named_parameters() if p.requires_grad}:
            raise DsparkError(f"the resume option {resume}: the checkpoint was trained with other values of the train-embeddings option / "
                              "the train-lm-head option than this run's; resume with the same values.")
    notes.append(f"target layers {draft.config.layer_ids}, {len(stream):,} training tokens, "
                 f"{sum(p.numel() for p in trainable_parameters(draft)):,} trainable parameters")
    trainer = DraftTrainer(target, draft, stream, options, torch_device, dist=dist)
    if prompts is not None and dist.is_main:  # rank 0 alone reports, and so measures
        baseline = TargetModel(target)
        stops = tuple(stop_ids(baseline, tokenizer)) if tau.data is not None else ()  # eval's; none for the tail
        trainer.held_out = held_out(baseline, [p.to(torch_device) for p in prompts], tau.new_tokens,
                                    draft.config.block_size.value, draft.config.layer_ids, stops)
        trainer.tau_every = tau.every
    notes.append(tau_note)
    if point is not None:
        restore_trainer(trainer, point)
    if dist.is_main:
        create_output(out, claim)
    return TrainingRun(trainer, out, notes)


def hold_out_prompts(stream: TokenStream, tau: TauProbe) -> tuple[TokenStream, torch.Tensor | None, str]:
    """Split the probe's prompts [S, P] off the end of the stream when τ is to be measured and the data holds ten
    times their tokens. -> (the training stream, the prompts or None, a note saying which)."""
    if not tau.every:
        return stream, None, "τ is not measured (the tau-every option is 0)"
    if tau.data is not None:
        return stream, None, (f"τ measured every {tau.every} steps and at the end: greedy loop on the prompts of "
                              f"{tau.data} (as eval encodes them, with its stop tokens), {tau.new_tokens} new tokens "
                              "each")
    if len(stream) < 10 * tau.held_tokens:
        return stream, None, (f"τ is not measured: the data ({len(stream):,} tokens) holds fewer than ten times the "
                              f"{tau.held_tokens:,} tokens its held-out prompts need")
    kept = len(stream) - tau.held_tokens
    prompts = stream.tokens[kept:].view(tau.prompts, tau.prompt_tokens)
    return TokenStream(stream.tokens[:kept]), prompts, (
        f"τ measured every {tau.every} steps and at the end: greedy loop on {tau.prompts} prompts of "
        f"{tau.prompt_tokens} tokens held out from the end of the data, {tau.new_tokens} new tokens each")
