"""Online distillation of a DSpark (or DFlash, Markov rank 0) draft against a frozen Hugging Face causal LM.

The objective follows DeepSpec (`deepspec/modeling/dspark/{common,loss}.py`), read for facts only:

- per training sequence, `anchors` distinct positions are drawn uniformly (each with at least one label inside
  the window); the draft's block for anchor a is [token_a, mask * (B-1)] at positions a..a+B-1 and slot j
  predicts the token at a+j+1;
- each block slot attends to the context strictly before its anchor (target features, keys at their own
  positions) and bidirectionally to its own block; all blocks of a sequence run in one forward;
- the Markov head is teacher-forced: slot j adds W2 W1[prev_j] with prev_0 = the anchor, prev_j = the true
  token a+j;
- loss = ce_alpha * CE(draft, true token) + l1_alpha * L1(draft probs, target probs) + confidence_alpha *
  BCE(confidence logit, 1 - L1/2), where L1 = sum |p - q| = 2 TV and the target distribution is the target's
  own next-token softmax at a+j (T = 1). Each term is a mean weighted by exp(-j / gamma) over valid slots.

Target states are computed on the fly with the target frozen (no gradient); the draft shares frozen copies of
the target's embedding and lm_head.
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
import torch.nn.functional as F

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.config import DraftConfig
from dspark_cli.runtime.draft import DSparkDraft
from dspark_cli.runtime.training_checks import TRAINER_JSON, TRAINER_STATE
from dspark_cli.runtime.training_data import SequenceBank, TokenStream
from dspark_cli.runtime.training_dist import SINGLE, DistContext

CHECKPOINT_PREFIX = "checkpoint-"


@dataclass(frozen=True)
class DraftShape:
    """Geometry of a new draft; the backbone width, heads and MLP are copied from the target."""

    layers: int = 1
    block_size: int = 7
    target_layers: tuple[int, ...] | None = None  # None: evenly spaced (default_target_layers)
    markov_rank: int = 256  # 0: a DFlash draft
    confidence: bool = True
    confidence_with_markov: bool = True
    mask_token_id: int | None = None  # None: the tokenizer's mask token, else a free or an added id
    train_embeddings: bool = False  # False: a frozen copy of the target's embedding (DeepSpec)
    train_lm_head: bool = False  # False: a frozen copy of the target's lm_head (DeepSpec)


@dataclass(frozen=True)
class TrainOptions:
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    anchors: int | None = None  # per sequence; None: seq_len // 8 (DeepSpec: 512 per 4096 tokens)
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    confidence_alpha: float = 1.0
    decay_gamma: float = 4.0  # position weight exp(-j / gamma)
    seed: int = 0
    save_every: int = 0  # 0: only the final checkpoint

    def anchors_per_sequence(self, seq_len: int) -> int:
        return max(1, min(self.anchors or seq_len // 8, seq_len - 1))


@dataclass(frozen=True)
class StepReport:
    step: int
    steps: int
    loss: float
    ce: float
    l1: float
    confidence: float
    accept: list[float]  # per block position: mean of 1 - TV(draft, target)
    tau: float  # expected acceptance length per round at T = 1: 1 + sum_k prod_{j<=k} accept_j, per block
    lr: float
    tokens_per_s: float  # all processes together
    blocks: int  # anchored blocks trained in this step, all processes together (batch x anchors)


@dataclass
class MaskChoice:
    token_id: int
    vocab_size: int  # draft input vocabulary (target rows, + 1 when the mask token was added)
    note: str


# --- draft construction --------------------------------------------------------------------------------------

def default_target_layers(num_target_layers: int, count: int) -> list[int]:
    """Evenly spaced target layers as DeepSpec / z-lab choose them (1 .. L-3; one draft layer: the middle one).

    Small targets (under 6 layers) use 0 .. L-2; the last layer is never used (HF's last hidden state is
    post-norm). Duplicates after rounding are dropped.
    """
    if num_target_layers < 2:
        raise DsparkError(f"the target has {num_target_layers} layer(s); a draft needs a target with at least 2.")
    if count == 1:
        return [num_target_layers // 2 - (1 if num_target_layers <= 2 else 0)]
    start, end = (1, num_target_layers - 3) if num_target_layers >= 6 else (0, num_target_layers - 2)
    if count > end - start:  # every layer in range (and no loop over a huge count)
        return list(range(start, end + 1))
    ids = {round(start + i * (end - start) / (count - 1)) for i in range(count)}
    return sorted(ids)


def choose_mask_token(tokenizer, embedding_rows: int, requested: int | None) -> MaskChoice:
    """The draft's mask token: as requested, the tokenizer's mask token, a free embedding row, or one added."""
    if requested is not None:
        if not 0 <= requested <= embedding_rows:
            raise DsparkError(f"--mask-token-id {requested} is outside the target's vocabulary (0..{embedding_rows - 1}"
                              f", or {embedding_rows} to add one).")
        if requested == embedding_rows:
            return MaskChoice(requested, embedding_rows + 1, f"mask token {requested} added to the vocabulary")
        return MaskChoice(requested, embedding_rows, f"mask token {requested} (as requested)")
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        mask_id = tokenizer.convert_tokens_to_ids("<|mask|>") if "<|mask|>" in tokenizer.get_vocab() else None
    if mask_id is not None and mask_id < embedding_rows:
        return MaskChoice(mask_id, embedding_rows, f"mask token {mask_id} (the tokenizer's mask token)")
    if len(tokenizer) < embedding_rows:
        return MaskChoice(len(tokenizer), embedding_rows,
                          f"mask token {len(tokenizer)} (the first embedding row the tokenizer never produces)")
    return MaskChoice(embedding_rows, embedding_rows + 1,
                      f"the tokenizer has no free id: mask token {embedding_rows} added to the draft's vocabulary "
                      "(the draft ships its own embed_tokens with one extra row)")


def draft_config_dict(target_config: dict, shape: DraftShape, target_layers: list[int], mask: MaskChoice,
                      anchors: int) -> dict:
    """DeepSpec's layout: the target's Qwen3 config with the draft fields overridden."""
    config = {k: v for k, v in target_config.items()
              if k not in ("_name_or_path", "dtype", "torch_dtype", "transformers_version", "auto_map",
                           "sliding_window", "use_sliding_window", "max_window_layers")}
    target_vocab = target_config["vocab_size"]
    config.update(
        architectures=["Qwen3DSparkModel"],
        model_type="qwen3",
        num_hidden_layers=shape.layers,
        num_target_layers=target_config["num_hidden_layers"],
        layer_types=["full_attention"] * shape.layers,
        target_layer_ids=list(target_layers),
        mask_token_id=mask.token_id,
        block_size=shape.block_size,
        num_anchors=anchors,
        markov_rank=shape.markov_rank,
        enable_confidence_head=shape.confidence,
        confidence_head_with_markov=bool(shape.confidence and shape.confidence_with_markov and shape.markov_rank),
        tie_word_embeddings=False,
        vocab_size=mask.vocab_size,
        use_cache=True,
    )
    if shape.markov_rank:
        config["markov_head_type"] = "vanilla"
    if mask.vocab_size != target_vocab:
        config["draft_vocab_size"] = target_vocab
    return config


def new_draft(target, tokenizer, shape: DraftShape, anchors: int) -> tuple[DSparkDraft, MaskChoice]:
    """A freshly initialised draft for `target`, sharing (frozen) its embedding and lm_head."""
    config, mask = new_draft_config(target.config.to_dict(), tokenizer, shape, anchors)
    draft = build_draft(config, target)
    train_shared_weights(draft, shape)
    return draft, mask


def new_draft_config(target_config: dict, tokenizer, shape: DraftShape, anchors: int) -> tuple[dict, MaskChoice]:
    """The config.json of a new draft for a target (its config.json as a dict) and the mask token chosen."""
    layers = draft_target_layers(target_config, shape)
    mask = choose_mask_token(tokenizer, target_config["vocab_size"], shape.mask_token_id)
    return draft_config_dict(target_config, shape, layers, mask, anchors), mask


def draft_target_layers(target_config: dict, shape: DraftShape) -> list[int]:
    """The target layers feeding a new draft: as the shape asks, else evenly spaced; checked against the target."""
    num_layers = target_config["num_hidden_layers"]
    layers = list(shape.target_layers) if shape.target_layers else default_target_layers(num_layers, shape.layers)
    if layers != sorted(set(layers)) or layers[0] < -1 or layers[-1] > num_layers - 2:
        raise DsparkError(f"--target-layers {layers} must be strictly increasing ids in -1..{num_layers - 2} (the "
                          f"target has {num_layers} layers; its last layer's output is post-norm and unusable).")
    return layers


def build_draft(config: dict, target) -> DSparkDraft:
    """A draft for this config whose embedding and lm_head are the target's, frozen (plus a trainable mask row
    when the config's vocabulary has one row more than the target's)."""
    embed = target.get_input_embeddings().weight.detach().float()
    lm_head = target.get_output_embeddings().weight.detach().float()
    draft = DSparkDraft(DraftConfig.from_dict(config))
    if draft.config.vocab_size == embed.shape[0]:
        draft.tie_to_target(embed, lm_head)
    else:
        draft.tie_to_target(None, lm_head)
        _extend_embedding(draft, embed)
    return draft


def _extend_embedding(draft: DSparkDraft, target_embed: torch.Tensor) -> None:
    """Own embedding = the target's rows (frozen) + one trainable mask row, initialised to their mean."""
    weight = torch.cat([target_embed, target_embed.mean(0, keepdim=True)])  # [V+1, H]
    draft.embed_tokens.weight = torch.nn.Parameter(weight)
    trainable_row = torch.zeros(weight.shape[0], 1)
    trainable_row[-1] = 1.0
    draft.embed_tokens.weight.register_hook(lambda grad: grad * trainable_row.to(grad))


def train_shared_weights(draft: DSparkDraft, shape: DraftShape) -> None:
    """Give the draft its own trainable copies of the target's embedding / lm_head when the shape asks for them
    (cloned: the frozen target keeps its weights; a trained embedding trains every row, an added mask row too)."""
    if shape.train_embeddings:
        draft.embed_tokens.weight = torch.nn.Parameter(draft.embed_tokens.weight.detach().clone())
        draft.shares_embed = False
    if shape.train_lm_head:
        draft.lm_head.weight = torch.nn.Parameter(draft.lm_head.weight.detach().clone())
        draft.shares_lm_head = False


def trainable_parameters(draft: DSparkDraft) -> list[torch.nn.Parameter]:
    return [p for p in draft.parameters() if p.requires_grad]


# --- one training step ---------------------------------------------------------------------------------------

def sample_anchors(batch: int, seq_len: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct random anchors per sequence in 0..seq_len-2 (sorted). -> [batch, count]"""
    scores = torch.rand(batch, seq_len - 1, generator=generator)
    return scores.argsort(dim=1)[:, :count].sort(dim=1).values


@dataclass
class BlockBatch:
    input_ids: torch.Tensor  # [B, A*K]: per block [anchor, mask * (K-1)]
    positions: torch.Tensor  # [B, A*K]: a .. a+K-1
    labels: torch.Tensor  # [B, A, K]: token at a+j+1 (0 where outside the window)
    prev_ids: torch.Tensor  # [B, A, K]: Markov inputs: anchor, then the true tokens a+1 .. a+K-1
    valid: torch.Tensor  # [B, A, K] bool: a+j+1 inside the window
    target_index: torch.Tensor  # [B, A, K]: a+j, where the target predicts label j (clamped)
    attn_mask: torch.Tensor  # [B, A*K, T + A*K] bool: True = may attend


def build_blocks(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> BlockBatch:
    """tokens [B, T], anchors [B, A] -> the draft's query blocks, labels and attention mask."""
    B, T = tokens.shape
    A, K = anchors.shape[1], block_size
    offsets = torch.arange(K, device=tokens.device)
    positions = anchors[..., None] + offsets  # [B, A, K]
    label_index = positions + 1
    valid = label_index < T
    labels = tokens.gather(1, label_index.clamp(max=T - 1).flatten(1)).view(B, A, K) * valid
    anchor_ids = tokens.gather(1, anchors)  # [B, A]
    input_ids = torch.full((B, A, K), mask_token_id, dtype=tokens.dtype, device=tokens.device)
    input_ids[..., 0] = anchor_ids
    prev_ids = torch.cat([anchor_ids[..., None], labels[..., :-1]], dim=-1)
    context_visible = torch.arange(T, device=tokens.device) < anchors.repeat_interleave(K, dim=1)[..., None]
    block_id = torch.arange(A * K, device=tokens.device) // K
    same_block = (block_id[:, None] == block_id[None, :]).expand(B, -1, -1)
    return BlockBatch(
        input_ids=input_ids.flatten(1),
        positions=positions.flatten(1),
        labels=labels,
        prev_ids=prev_ids,
        valid=valid,
        target_index=positions.clamp(max=T - 1),
        attn_mask=torch.cat([context_visible, same_block], dim=-1),
    )


@dataclass
class LossTerms:
    loss: torch.Tensor  # this process's share of the loss (the whole loss in one process), for backward
    ce: float
    l1: float
    confidence: float
    accept: list[float]
    tau: float
    value: float  # the loss of the whole batch, over all processes
    blocks: int  # blocks in the whole batch


@dataclass
class LossSums:
    """The position-weighted sums of one batch (or one process's rows of it), before normalisation."""

    ce: torch.Tensor  # sum of w * CE (with grad)
    l1: torch.Tensor  # sum of w * L1 (with grad)
    confidence: torch.Tensor | None  # sum of w * BCE (with grad), None without a confidence head
    stats: torch.Tensor  # [4 + 2K + 2] float64, detached: sum w, the three sums above, per-position sums of
    # accept * valid (K) and valid (K), the sum over blocks of tau - 1, the number of blocks


def position_weights(valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """[B, A, K] bool -> exp(-j / gamma) on valid slots, 0 elsewhere."""
    j = torch.arange(valid.shape[-1], device=valid.device, dtype=torch.float32)
    return valid.float() * torch.exp(-j / gamma) if gamma > 0 else valid.float()


def loss_sums(draft_logits: torch.Tensor, target_logits: torch.Tensor, confidence_logits, blocks: BlockBatch,
              options: TrainOptions) -> LossSums:
    """draft / target logits [B, A, K, V], confidence logits [B, A, K] | None -> the weighted sums of the loss."""
    weights = position_weights(blocks.valid, options.decay_gamma)
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    ce = -(log_q.gather(-1, blocks.labels[..., None]).squeeze(-1) * weights).sum()
    p = F.softmax(target_logits.float(), dim=-1)
    l1_per_slot = (log_q.exp() - p).abs().sum(-1)  # [B, A, K] = 2 TV
    l1 = (l1_per_slot * weights).sum()
    accept = (1.0 - 0.5 * l1_per_slot).clamp(0.0, 1.0).detach()  # acceptance probability at T = 1
    confidence = None
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept, reduction="none")
        confidence = (bce * weights).sum()
    valid = blocks.valid.float()
    tau_sum = (accept * valid).cumprod(-1).sum(-1).sum()  # over blocks: accepted length - 1
    sums = [weights.sum(), ce, l1, confidence if confidence is not None else torch.zeros((), device=ce.device)]
    stats = torch.cat([torch.stack(sums).detach(), (accept * valid).sum((0, 1)), valid.sum((0, 1)),
                       tau_sum[None], torch.tensor([float(valid.shape[0] * valid.shape[1])], device=ce.device)])
    return LossSums(ce, l1, confidence, stats.double())


def normalise(sums: LossSums, options: TrainOptions, stats: torch.Tensor | None = None) -> LossTerms:
    """The loss terms of a batch: `sums` divided by the batch's total weight, read from `stats` (the sums of
    every process's stats; this process's own when None). Each process's loss is then its share of the whole."""
    stats = sums.stats if stats is None else stats
    K = (stats.numel() - 6) // 2
    total = stats[0].float().clamp_min(1e-6)
    ce, l1 = sums.ce / total, sums.l1 / total
    loss = options.ce_alpha * ce + options.l1_alpha * l1
    whole = options.ce_alpha * (stats[1].float() / total) + options.l1_alpha * (stats[2].float() / total)
    if sums.confidence is not None:
        loss = loss + options.confidence_alpha * (sums.confidence / total)
        whole = whole + options.confidence_alpha * (stats[3].float() / total)
    per_position = stats[4:4 + K] / stats[4 + K:4 + 2 * K].clamp_min(1.0)
    blocks = int(stats[-1])
    return LossTerms(loss, (stats[1].float() / total).item(), (stats[2].float() / total).item(),
                     (stats[3].float() / total).item(), per_position.tolist(), 1.0 + (stats[-2] / blocks).item(),
                     whole.item(), blocks)


def distillation_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, confidence_logits, blocks: BlockBatch,
                      options: TrainOptions) -> LossTerms:
    """draft / target logits [B, A, K, V], confidence logits [B, A, K] | None -> the weighted DSpark loss."""
    return normalise(loss_sums(draft_logits, target_logits, confidence_logits, blocks, options), options)


def draft_forward(draft: DSparkDraft, features: torch.Tensor, blocks: BlockBatch):
    """features [B, T, n*Ht] -> draft logits [B, A, K, V] (Markov-corrected, teacher-forced), confidence [B, A, K]."""
    B, T = features.shape[:2]
    A, K = blocks.labels.shape[1:]
    context = draft.project_context(features)  # [B, T, H]
    context_positions = torch.arange(T, device=features.device).expand(B, T)
    kv = draft.context_kv(context, context_positions)
    hidden = draft.block_hidden(blocks.input_ids, blocks.positions, kv, blocks.attn_mask).view(B, A, K, -1)
    logits = draft.base_logits(hidden)  # [B, A, K, Vd]
    embed = None
    if draft.config.markov_rank:
        embed = draft.markov_embed(blocks.prev_ids)  # [B, A, K, r]
        logits = logits + draft.markov_bias(embed)
    confidence = draft.confidence_logit(hidden, embed) if draft.confidence_head is not None else None
    return logits, confidence


class DraftStep(torch.nn.Module):
    """draft_forward as a module, so that DistributedDataParallel can wrap it (DDP hooks the module's forward)."""

    def __init__(self, draft: DSparkDraft):
        super().__init__()
        self.draft = draft

    def forward(self, features: torch.Tensor, blocks: BlockBatch):
        return draft_forward(self.draft, features, blocks)


@torch.no_grad()
def target_forward(target, tokens: torch.Tensor):
    """tokens [B, T] -> HF hidden states (L+1 x [B, T, Ht]) and target logits [B, T, V]."""
    out = target(input_ids=tokens, output_hidden_states=True)
    return out.hidden_states, out.logits


# --- the training loop ---------------------------------------------------------------------------------------

def lr_at(step: int, options: TrainOptions) -> float:
    """Linear warm-up over warmup_ratio of the steps, then cosine decay to 10% of the peak."""
    warmup = max(1, round(options.steps * options.warmup_ratio))
    if step < warmup:
        return options.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, options.steps - warmup))
    return options.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@dataclass
class DraftTrainer:
    """Trains one draft against a frozen target on windows of a token stream."""

    target: torch.nn.Module
    draft: DSparkDraft
    stream: TokenStream | SequenceBank
    options: TrainOptions
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    step: int = 0
    dist: DistContext = SINGLE  # many processes: each trains its rows of every batch (training_dist.py)

    def __post_init__(self) -> None:
        self.target.eval().requires_grad_(False)
        self.draft.to(self.device).train()
        self.model: torch.nn.Module = DraftStep(self.draft)  # under DDP from the first run_step on
        self.optimizer = torch.optim.AdamW(trainable_parameters(self.draft), lr=self.options.lr, betas=(0.9, 0.95),
                                           weight_decay=self.options.weight_decay)
        self.generator = torch.Generator().manual_seed(self.options.seed)
        self.seq_len = min(self.options.seq_len, self.stream.max_window)
        self.anchors = self.options.anchors_per_sequence(self.seq_len)

    def next_tokens(self) -> torch.Tensor:
        return self.stream.sample(self.options.batch_size, self.seq_len, self.generator)  # [B, T]

    def batch_loss(self, tokens: torch.Tensor, features: torch.Tensor, target_logits: torch.Tensor,
                   anchors: torch.Tensor) -> LossTerms:
        """The distillation loss of tokens [B, T] with their target features / logits at anchors [B, A]."""
        return normalise(self.batch_sums(tokens, features, target_logits, anchors), self.options)

    def batch_sums(self, tokens: torch.Tensor, features: torch.Tensor, target_logits: torch.Tensor,
                   anchors: torch.Tensor) -> LossSums:
        """The weighted loss sums of tokens [B, T] with their target features / logits at anchors [B, A]."""
        blocks = build_blocks(tokens.cpu(), anchors.cpu(), self.draft.config.block_size.value,
                              self.draft.config.mask_token_id)
        blocks = BlockBatch(**{k: v.to(self.device) for k, v in vars(blocks).items()})
        B, A, K = blocks.labels.shape
        index = blocks.target_index.view(B, A * K, 1).expand(-1, -1, target_logits.shape[-1])
        aligned = target_logits.gather(1, index).view(B, A, K, -1)  # the target's distribution for each slot
        with self._autocast():
            draft_logits, confidence = self.model(features, blocks)
        return loss_sums(draft_logits, aligned, confidence, blocks, self.options)

    def train_step(self, tokens: torch.Tensor, features: torch.Tensor, target_logits: torch.Tensor) -> LossTerms:
        """One optimizer step on a batch whose target states are already computed (one process)."""
        anchors = sample_anchors(tokens.shape[0], tokens.shape[1], self.anchors, self.generator)
        return self.optimize(self.batch_sums(tokens, features, target_logits, anchors))

    def run_step(self) -> LossTerms:
        """Draw the next global batch and its anchors (the same on every process), run the target and the draft
        on this process's rows, then take one optimizer step on the whole batch's loss."""
        def local() -> LossSums:
            tokens = self.next_tokens()  # [B, T]
            anchors = sample_anchors(tokens.shape[0], tokens.shape[1], self.anchors, self.generator)  # [B, A]
            rows = self.dist.rows(tokens.shape[0])
            tokens = tokens[rows].to(self.device)
            with self._autocast():
                hidden_states, logits = target_forward(self.target, tokens)
            return self.batch_sums(tokens, self.draft.target_features(hidden_states).float(), logits.float(),
                                   anchors[rows])

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

        from dspark_cli.runtime.files import atomic_output_dir

        optimizer = self.optimizer.state_dict()
        tensors = {f"draft.{name}": p.detach().cpu().contiguous() for name, p in self.draft.named_parameters()
                   if p.requires_grad}  # the frozen target weights are not part of the state
        for index, slots in optimizer["state"].items():
            tensors.update({f"optimizer.{index}.{k}": v.detach().cpu().contiguous() for k, v in slots.items()})
        tensors["generator"] = self.generator.get_state()
        state = {"step": self.step, "options": asdict(self.options), "param_groups": optimizer["param_groups"]}
        with atomic_output_dir(folder, force=True) as tmp:  # a checkpoint is there whole or not at all
            self.draft.write_files(tmp, include_shared=True)
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
    tokens_per_step = options.batch_size * trainer.seq_len
    last_saved: Path | None = None
    try:
        while trainer.step < options.steps:
            terms = trainer.run_step()
            main = trainer.dist.is_main  # many processes: only rank 0 reports and writes
            if on_step is not None and main:
                rate = (trainer.step - start_step) * tokens_per_step / (time.perf_counter() - started)
                on_step(StepReport(trainer.step, options.steps, terms.value, terms.ce, terms.l1, terms.confidence,
                                   terms.accept, terms.tau, lr_at(trainer.step - 1, options), rate, terms.blocks))
            if options.save_every and trainer.step % options.save_every == 0 and trainer.step < options.steps:
                trainer.check_finite_weights()  # on every process: the weights are the same everywhere
                if main:
                    last_saved = trainer.save_checkpoint(out / f"{CHECKPOINT_PREFIX}{trainer.step}")
        trainer.check_finite_weights()
    except Diverged as error:
        kept = (f"the last checkpoint written is {last_saved}: lower --lr and --resume it" if last_saved else
                "no checkpoint was written by this run: lower --lr and start again")
        raise DsparkError(f"training diverged at {error.message} (not finite), so no final draft was written; "
                          f"{kept}.") from None
    return save_final(trainer.draft, out) if trainer.dist.is_main else out


def train_lockstep(trainers: list[DraftTrainer], on_step: Callable[[int, list[LossTerms]], None] | None = None) -> None:
    """Train several drafts of one target on the same batches and anchors (same seed and options), running the
    target once per step for all of them. Every trainer draws its own windows; they must agree."""
    first = trainers[0]
    while first.step < first.options.steps:
        batches = [trainer.next_tokens() for trainer in trainers]
        if any(not torch.equal(batches[0], batch) for batch in batches[1:]):
            raise ValueError("lock-step trainers drew different batches; give them the same seed and options")
        tokens = batches[0].to(first.device)
        with first._autocast():
            hidden_states, logits = target_forward(first.target, tokens)
        terms = [trainer.train_step(tokens, trainer.draft.target_features(hidden_states).float(), logits.float())
                 for trainer in trainers]
        if on_step is not None:
            on_step(first.step, terms)


def save_final(draft: DSparkDraft, out: Path) -> Path:
    """Write the final draft's config.json and model.safetensors into `out` (beside any checkpoint-N folders)."""
    import tempfile

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".final.", suffix=".tmp", dir=out) as staging:  # removed on any error
        draft.write_files(Path(staging), include_shared=True)
        for name in ("model.safetensors", "config.json"):  # each replaced atomically
            os.replace(Path(staging) / name, out / name)
    return out


# --- a whole run: target, data, draft (new or resumed) -------------------------------------------------------

@dataclass
class TrainingRun:
    trainer: DraftTrainer
    out: Path
    notes: list[str]  # what was decided on the user's behalf (mask token, target layers, resume point)


def load_tokenizer_and_config(path: str | Path) -> tuple[object, dict]:
    """The target's tokenizer and config.json as a dict, without loading its weights."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False).to_dict()
    except (OSError, ValueError, KeyError) as error:
        raise DsparkError(f"cannot load the target {path}: {error}. --target takes a Hugging Face causal LM folder "
                          "or hub id with its tokenizer.") from error
    return tokenizer, config


def load_target_model(path: str | Path, device: torch.device):
    """The frozen target (bf16 on CUDA, fp32 on CPU)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as error:
        raise DsparkError(f"cannot load the target {path}: {error}. --target takes a Hugging Face causal LM folder "
                          "or hub id with its tokenizer.") from error
    return model.to(device).eval().requires_grad_(False)


def prepare_run(target_path: str | Path, data: list[Path], out: Path, shape: DraftShape, options: TrainOptions, *,
                device: str = "auto", resume: Path | None = None, chat_template: Path | None = None,
                force: bool = False, dist: DistContext = SINGLE) -> TrainingRun:
    """Load the target and data, create (or resume) the draft and its trainer; `out` is created here (by rank 0
    alone when many processes train: the others never touch it).

    Everything that can be checked without the weights (the output folder, the window, one step's memory, the
    resume checkpoint) is checked before the target and the draft are allocated."""
    from dspark_cli.runtime.training_checks import plan_draft, read_resume_point, resolve_device, restore_trainer
    from dspark_cli.runtime.training_data import load_token_stream
    from dspark_cli.runtime.training_output import check_output, create_output

    torch_device = dist.device(resolve_device(device))
    out = Path(out)
    claim = check_output(out, target_path, data, resume, chat_template, force) if dist.is_main else None
    tokenizer, target_config = load_tokenizer_and_config(target_path)
    stream = load_token_stream(data, tokenizer, chat_template)
    seq_len = min(options.seq_len, stream.max_window)
    point = read_resume_point(resume) if resume is not None else None
    config, notes = plan_draft(target_config, tokenizer, shape, options, seq_len, len(stream), point, torch_device)
    target = load_target_model(target_path, torch_device)
    torch.manual_seed(options.seed)
    draft = build_draft(config, target)
    train_shared_weights(draft, shape)
    if point is not None:
        saved = {name.removeprefix("draft.") for name in point.tensors if name.startswith("draft.")}
        if saved != {name for name, p in draft.named_parameters() if p.requires_grad}:
            raise DsparkError(f"--resume {resume}: the checkpoint was trained with other --train-embeddings / "
                              "--train-lm-head flags than this run's; resume with the same flags.")
    notes.append(f"target layers {draft.config.layer_ids}, {len(stream):,} training tokens, "
                 f"{sum(p.numel() for p in trainable_parameters(draft)):,} trainable parameters")
    trainer = DraftTrainer(target, draft, stream, options, torch_device, dist=dist)
    if point is not None:
        restore_trainer(trainer, point)
    if dist.is_main:
        create_output(out, claim)
    return TrainingRun(trainer, out, notes)
