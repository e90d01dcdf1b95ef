"""Online distillation of a DSpark (or DFlash, Markov rank 0) draft against a frozen Hugging Face causal LM: the
trainer (one optimizer step on a batch, its checkpoints) and the loop.

The options are in `options.py`, the objective (anchored blocks, loss) in `loss.py`, a new draft's construction in
`new_draft.py`, a whole run's preparation in `run.py`. Target states are computed on the fly with the target frozen (no
gradient) as the feature contract of `features.py` (the chosen layers' outputs and the post-norm last hidden state,
no logits); the target's distribution is recomputed with its frozen lm_head at the anchor blocks' slots only. The
draft shares frozen copies of the target's embedding and lm_head.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.model.draft import DSparkDraft
from dspark_cli.runtime.model.draft_io import write_draft_files
from dspark_cli.runtime.train.tiny_target import cosine_lr
from dspark_cli.runtime.train.checks import ResumePoint
from dspark_cli.runtime.train.data import SequenceBank, TokenStream
from dspark_cli.runtime.train.feature_cache import FeatureBank
from dspark_cli.runtime.distributed import SINGLE, DistContext
from dspark_cli.runtime.train.new_draft import trainable_parameters
from dspark_cli.runtime.train.tau import HeldOut, TauEstimate, chained_tau
from dspark_cli.runtime.train.options import TRAINER_JSON, TRAINER_STATE, TrainOptions
from dspark_cli.runtime.train.features import TargetFeatures, TargetHead, capture_target_features
from dspark_cli.runtime.train.loss import (BlockBatch, DraftStep, LossSums, LossTerms, build_blocks, loss_sums,
                                              normalise, sample_anchors)

CHECKPOINT_PREFIX = "checkpoint-"


@dataclass(frozen=True)
class StepReport:
    step: int
    steps: int
    loss: float
    ce: float
    l1: float
    confidence: float
    accept: list[float]  # per block position: mean of 1 - TV(draft, target)
    expected_length: float  # 1 + sum_k prod_{j<=k} accept_j over the training anchors: NOT the loop's tau
    lr: float
    tokens_per_s: float  # all processes together
    blocks: int  # anchored blocks trained in this step, all processes together (batch x anchors)
    tau: float | None = None  # tau as generate / eval measure it (tau.py), at the steps where it is measured



def lr_at(step: int, options: TrainOptions) -> float:
    """Linear warm-up over warmup_ratio of the steps, then cosine decay to 10% of the peak (cosine_lr)."""
    return cosine_lr(step, options.steps, options.lr, warmup=max(1, round(options.steps * options.warmup_ratio)))


@dataclass
class DraftTrainer:
    """Trains one draft against a frozen target on windows of a token stream."""

    target: torch.nn.Module
    draft: DSparkDraft
    stream: TokenStream | SequenceBank | FeatureBank
    options: TrainOptions
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    step: int = 0
    dist: DistContext = SINGLE  # many processes: each trains its rows of every batch (runtime/distributed.py)
    held_out: HeldOut | None = None  # held-out prompts for measuring tau (tau.py); None: tau is not measured
    tau_every: int = 0  # measure tau every so many steps and after the last (with held_out)

    def __post_init__(self) -> None:
        self.target.eval().requires_grad_(False)
        self.draft.to(self.device).train()
        self.model: torch.nn.Module = DraftStep(self.draft)  # under DDP from the first run_step on
        self.optimizer = torch.optim.AdamW(trainable_parameters(self.draft), lr=self.options.lr, betas=(0.9, 0.95),
                                           weight_decay=self.options.weight_decay)
        self.head = TargetHead(self.target)  # the target's frozen lm_head (+ its logit transform)
        self.generator = torch.Generator().manual_seed(self.options.seed)
        self.seq_len = min(self.options.seq_len, self.stream.max_window)
        self.anchors = self.options.anchors_per_sequence(self.seq_len)

    def next_tokens(self) -> torch.Tensor:
        return self.stream.sample(self.options.batch_size, self.seq_len, self.generator)  # [B, T]

    def batch_loss(self, tokens: torch.Tensor, features: TargetFeatures, anchors: torch.Tensor,
                   loss_mask: torch.Tensor | None = None) -> LossTerms:
        """The distillation loss of tokens [B, T] with their target features at anchors [B, A]."""
        return normalise(self.batch_sums(tokens, features, anchors, loss_mask), self.options)

    def batch_sums(self, tokens: torch.Tensor, features: TargetFeatures, anchors: torch.Tensor,
                   loss_mask: torch.Tensor | None = None) -> LossSums:
        """The weighted loss sums of tokens [B, T] with their target features at anchors [B, A] (loss_mask [B, T]
        bool: the tokens that may be labels; None: all). The target's logits are computed at the valid slots of the
        anchor blocks only, from last_hidden with the frozen lm_head."""
        blocks = build_blocks(tokens.cpu(), anchors.cpu(), self.draft.config.block_size.value,
                              self.draft.config.mask_token_id, None if loss_mask is None else loss_mask.cpu(),
                              self.draft.config.sample_from_anchor)
        blocks = BlockBatch(**{k: v.to(self.device) for k, v in vars(blocks).items()})
        with self._autocast():
            target_logits = self.head.at(features.last_hidden, blocks.target_index, blocks.valid)  # [B, A, K, V]
            draft_logits, confidence = self.model(features.layers.float(), blocks)
        return loss_sums(draft_logits, target_logits, confidence, blocks, self.options)

    def train_step(self, tokens: torch.Tensor, features: TargetFeatures,
                   loss_mask: torch.Tensor | None = None) -> LossTerms:
        """One optimizer step on a batch whose target features are already computed (one process): the in-process
        target's (train_lockstep) or a cache's."""
        anchors = sample_anchors(tokens.shape[0], tokens.shape[1], self.anchors, self.generator)
        return self.optimize(self.batch_sums(tokens, features, anchors, loss_mask))

    def target_features(self, tokens: torch.Tensor) -> TargetFeatures:
        """The frozen target's features of tokens [B, T] for this draft's target layers (no logits computed)."""
        with self._autocast():
            return capture_target_features(self.target, tokens, self.draft.config.layer_ids)

    def run_step(self) -> LossTerms:
        """Draw the next global batch and its anchors (the same on every process), run the target and the draft
        on this process's rows, then take one optimizer step on the whole batch's loss."""
        def local() -> LossSums:
            tokens = self.next_tokens()  # [B, T]
            anchors = sample_anchors(tokens.shape[0], tokens.shape[1], self.anchors, self.generator)  # [B, A]
            rows = self.dist.rows(tokens.shape[0])
            tokens = tokens[rows].to(self.device)
            if isinstance(self.stream, FeatureBank):  # cached features (dspark features): the target never runs
                features, loss_mask = self.stream.batch(rows, self.device)
                return self.batch_sums(tokens, features, anchors[rows], loss_mask)
            return self.batch_sums(tokens, self.target_features(tokens), anchors[rows])

        self.model = self.dist.wrap(self.model)  # a collective, so outside the part that may fail on one rank
        return self.optimize(self.dist.together(local, f"step {self.step + 1}"))

    def optimize(self, sums: LossSums) -> LossTerms:
        """Normalise by the whole batch's weight (summed over processes) and take one optimizer step."""
        terms = normalise(sums, self.options, self.dist.sum(sums.stats))
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.options)
        self.optimizer.zero_grad(set_to_none=True)
        if not math.isfinite(terms.value):  # the whole batch's loss: every process stops at the same step
            raise Diverged(self.step + 1, f"the loss is {terms.value}")
        (terms.loss * self.dist.world_size).backward()  # DDP averages the processes' gradients: undo the 1/world
        norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(self.draft), self.options.max_grad_norm)
        if not torch.isfinite(norm):  # gradients are all-reduced: the same on every process
            raise Diverged(self.step + 1, f"the gradient norm is {norm.item()}")
        self.optimizer.step()
        self.step += 1
        return terms

    def measure_tau(self) -> TauEstimate:
        """τ of the greedy speculative loop on the held-out prompts with the draft as it is now (tau.py)."""
        with self._autocast():
            return chained_tau(self.draft, self.held_out, self.head.vocab_size)

    def tau_due(self) -> bool:
        return self.held_out is not None and self.tau_every > 0 and (
            self.step % self.tau_every == 0 or self.step == self.options.steps)

    def check_finite_weights(self) -> None:
        """Raise Diverged when an optimizer step left a non-finite trainable weight (checked before saving)."""
        for name, p in self.draft.named_parameters():
            if p.requires_grad and not torch.isfinite(p).all():
                raise Diverged(self.step, f"the weight {name} is not finite after it")

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    # --- checkpoints ---

    def save_checkpoint(self, folder: Path) -> Path:
        """A loadable draft (config.json + bf16 model.safetensors) plus the trainer state for --resume: fp32
        weights, AdamW moments and the data/anchor generator in trainer_state.safetensors, the rest in JSON
        (no pickle)."""
        from safetensors.torch import save_file

        from dspark_cli.runtime.io.outputs import atomic_output_dir

        optimizer = self.optimizer.state_dict()
        tensors = {f"draft.{name}": p.detach().cpu().contiguous() for name, p in self.draft.named_parameters()
                   if p.requires_grad}  # the frozen target weights are not part of the state
        for index, slots in optimizer["state"].items():
            tensors.update({f"optimizer.{index}.{k}": v.detach().cpu().contiguous() for k, v in slots.items()})
        tensors["generator"] = self.generator.get_state()
        state = {"step": self.step, "options": asdict(self.options), "param_groups": optimizer["param_groups"]}
        with atomic_output_dir(folder, force=True) as tmp:  # a checkpoint is there whole or not at all
            write_draft_files(self.draft, tmp, include_shared=True)
            save_file(tensors, str(tmp / TRAINER_STATE))
            (tmp / TRAINER_JSON).write_text(json.dumps(state, indent=2) + "\n")
        return folder

    def load_state(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what save_checkpoint wrote, as read_resume_point reads it (the draft must have the
        checkpoint's geometry)."""
        params = dict(self.draft.named_parameters())
        with torch.no_grad():
            for name, value in tensors.items():
                if name.startswith("draft."):
                    params[name.removeprefix("draft.")].copy_(value)
        slots: dict[int, dict] = {}
        for name, value in tensors.items():
            if name.startswith("optimizer."):
                _, index, key = name.split(".", 2)
                slots.setdefault(int(index), {})[key] = value
        self.optimizer.load_state_dict({"state": slots, "param_groups": state["param_groups"]})
        self.generator.set_state(tensors["generator"])
        self.step = state["step"]


class Diverged(DsparkError):
    """Training produced a non-finite loss, gradient or weight at `step` (1-based); nothing of it is saved."""

    def __init__(self, step: int, what: str):
        super().__init__(f"step {step}: {what}")
        self.step, self.what = step, what


def latest_checkpoint(out: Path) -> Path | None:
    found = [p for p in Path(out).glob(f"{CHECKPOINT_PREFIX}*")
             if p.name.removeprefix(CHECKPOINT_PREFIX).isdigit() and (p / TRAINER_STATE).is_file()]
    return max(found, key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)), default=None)


def train_loop(trainer: DraftTrainer, out: Path, on_step: Callable[[StepReport], None] | None = None) -> Path:
    """Run the remaining steps; periodic checkpoints under out/checkpoint-N; the final draft in `out` (written by
    rank 0 alone when many processes train)."""
    options = trainer.options
    started, start_step = time.perf_counter(), trainer.step
    measuring = 0.0  # seconds spent measuring tau, left out of the training rate
    tokens_per_step = options.batch_size * trainer.seq_len
    last_saved: Path | None = None
    try:
        while trainer.step < options.steps:
            terms = trainer.run_step()
            main = trainer.dist.is_main  # many processes: only rank 0 reports and writes
            if on_step is not None and main:
                rate = (trainer.step - start_step) * tokens_per_step / (time.perf_counter() - started - measuring)
                tau = None
                if trainer.tau_due():
                    began = time.perf_counter()
                    tau = trainer.measure_tau().tau
                    measuring += time.perf_counter() - began
                on_step(StepReport(trainer.step, options.steps, terms.value, terms.ce, terms.l1, terms.confidence,
                                   terms.accept, terms.expected_length, lr_at(trainer.step - 1, options), rate,
                                   terms.blocks, tau))
            if options.save_every and trainer.step % options.save_every == 0 and trainer.step < options.steps:
                trainer.check_finite_weights()  # on every process: the weights are the same everywhere
                if main:
                    last_saved = trainer.save_checkpoint(out / f"{CHECKPOINT_PREFIX}{trainer.step}")
        trainer.check_finite_weights()
    except Diverged as error:
        kept = (f"the last checkpoint written is {last_saved}: lower the lr option and resume it with the resume option" if last_saved else
                "no checkpoint was written by this run: lower the lr option and start again")
        raise DsparkError(f"training diverged at {error.message} (not finite), so no final draft was written; "
                          f"{kept}.") from None
    return save_final(trainer.draft, out) if trainer.dist.is_main else out


def train_lockstep(trainers: list[DraftTrainer], on_step: Callable[[int, list[LossTerms]], None] | None = None) -> None:
    """Train several drafts of one target on the same batches and anchors (same seed and options), running the
    target once per step for all of them. Every trainer draws its own windows; they must agree, and so must the
    target layers the drafts read."""
    first = trainers[0]
    if any(t.draft.config.layer_ids != first.draft.config.layer_ids for t in trainers[1:]):
        raise ValueError("lock-step trainers read different target layers; give their drafts the same target layers")
    while first.step < first.options.steps:
        batches = [trainer.next_tokens() for trainer in trainers]
        if any(not torch.equal(batches[0], batch) for batch in batches[1:]):
            raise ValueError("lock-step trainers drew different batches; give them the same seed and options")
        tokens = batches[0].to(first.device)
        features = first.target_features(tokens)
        terms = [trainer.train_step(tokens, features) for trainer in trainers]
        if on_step is not None:
            on_step(first.step, terms)


def save_final(draft: DSparkDraft, out: Path) -> Path:
    """Write the final draft's config.json and model.safetensors into `out` (beside any checkpoint-N folders)."""
    import tempfile

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".final.", suffix=".tmp", dir=out) as staging:  # removed on any error
        write_draft_files(draft, Path(staging), include_shared=True)
        for name in ("model.safetensors", "config.json"):  # each replaced atomically
            os.replace(Path(staging) / name, out / name)
    return out


def restore_trainer(trainer: DraftTrainer, point: ResumePoint) -> None:
    """Load the checkpoint's weights, AdamW state and generator into a trainer built from its config."""
    try:
        trainer.load_state(point.state, point.tensors)
    except (RuntimeError, ValueError, KeyError, IndexError, TypeError) as error:
        raise DsparkError(f"{point.folder / TRAINER_STATE} does not fit the draft of its config.json ("
                          f"{str(error).splitlines()[0]}); pick an earlier intact checkpoint.") from None
