"""The distillation objective of `dspark train`: anchored query blocks, the draft's teacher-forced forward, the loss.

The objective follows DeepSpec (`deepspec/modeling/dspark/{common,loss}.py`), read for facts only:

- per training sequence, `anchors` distinct positions are drawn uniformly (each with at least one label inside
  the window); the draft's block for anchor a is [token_a, mask * (B-1)] at positions a..a+B-1 and slot j
  predicts the token at a+j+1;
- each block slot attends to the context strictly before its anchor (target features, keys at their own
  positions) and bidirectionally to its own block; all blocks of a sequence run in one forward;
- the Markov head is teacher-forced: slot j adds W2 u_j, u_j = W1[prev_j] (vanilla; gated and RNN heads make
  u_j from it and the slot's hidden state, the RNN head's state starting at zero per block) with prev_0 = the
  anchor, prev_j = the true token a+j;
- a DFlash2 draft (DFlash layout: slot j predicts a+j) is teacher-forced the same way: its logits get the path
  selector's pairwise term on the top-k candidates of its own logits, the predecessor being the true token at a+j-1
  (`CandidateSelector.teacher_bias`), so CE and L1 train the distribution the walk samples from (on the candidates;
  the loop's q is -inf elsewhere, where CE drives the draft's mass down, as the top-k Markov strategy does);
- loss = ce_alpha * CE(draft, true token) + l1_alpha * L1(draft probs, target probs) + confidence_alpha *
  BCE(confidence logit, 1 - L1/2), where L1 = sum |p - q| = 2 TV and the target distribution is the target's
  own next-token softmax at a+j (T = 1), its logits recomputed from the target's post-norm last hidden state
  with its frozen lm_head at the valid slots only (features.TargetHead.at). Each term is a mean weighted by
  exp(-j / gamma) over valid slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dspark_cli.runtime.model.draft import DSparkDraft

if TYPE_CHECKING:
    from dspark_cli.runtime.train.options import TrainOptions


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
    drafting: torch.Tensor | None = None  # [K] bool: the slots that draft (the DFlash layout: all but the anchor's);
    # None: every slot


def build_blocks(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int,
                 loss_mask: torch.Tensor | None = None, sample_from_anchor: bool = True) -> BlockBatch:
    """tokens [B, T], anchors [B, A] -> the draft's query blocks, labels and attention mask. loss_mask [B, T] bool
    (None: every token): a slot whose label token is masked is not valid (no loss term reads it).
    sample_from_anchor False is the DFlash layout (DFlash2's): slot j predicts the token at its own position a+j, the
    anchor's slot predicts nothing, and slot j's predecessor is the token at a+j-1 (the anchor for slot 1)."""
    B, T = tokens.shape
    A, K = anchors.shape[1], block_size
    offsets = torch.arange(K, device=tokens.device)
    positions = anchors[..., None] + offsets  # [B, A, K]
    label_index = positions + (1 if sample_from_anchor else 0)
    valid = label_index < T
    if not sample_from_anchor:
        valid &= offsets > 0
    if loss_mask is not None:
        valid &= loss_mask.gather(1, label_index.clamp(max=T - 1).flatten(1)).view(B, A, K)
    labels = tokens.gather(1, label_index.clamp(max=T - 1).flatten(1)).view(B, A, K) * valid
    anchor_ids = tokens.gather(1, anchors)  # [B, A]
    input_ids = torch.full((B, A, K), mask_token_id, dtype=tokens.dtype, device=tokens.device)
    input_ids[..., 0] = anchor_ids
    prev_ids = torch.cat([anchor_ids[..., None], labels[..., :-1]], dim=-1)
    if not sample_from_anchor and K > 1:
        prev_ids[..., 1] = anchor_ids  # slot 0 has no label: slot 1's predecessor is the anchor
    context_visible = torch.arange(T, device=tokens.device) < anchors.repeat_interleave(K, dim=1)[..., None]
    block_id = torch.arange(A * K, device=tokens.device) // K
    same_block = (block_id[:, None] == block_id[None, :]).expand(B, -1, -1)
    return BlockBatch(
        input_ids=input_ids.flatten(1),
        positions=positions.flatten(1),
        labels=labels,
        prev_ids=prev_ids,
        valid=valid,
        target_index=(label_index - 1).clamp(0, T - 1),
        attn_mask=torch.cat([context_visible, same_block], dim=-1),
        drafting=offsets >= (0 if sample_from_anchor else 1),
    )


@dataclass
class LossTerms:
    loss: torch.Tensor  # this process's share of the loss (the whole loss in one process), for backward
    ce: float
    l1: float
    confidence: float
    accept: list[float]
    expected_length: float  # 1 + sum_k prod_{j<=k} accept_j per block over the training anchors: NOT tau (tau.py)
    value: float  # the loss of the whole batch, over all processes
    blocks: int  # blocks in the whole batch


@dataclass
class LossSums:
    """The position-weighted sums of one batch (or one process's rows of it), before normalisation."""

    ce: torch.Tensor  # sum of w * CE (with grad)
    l1: torch.Tensor  # sum of w * L1 (with grad)
    confidence: torch.Tensor | None  # sum of w * BCE (with grad), None without a confidence head
    stats: torch.Tensor  # [4 + 2K + 2] float64, detached: sum w, the three sums above, per-position sums of
    # accept * valid (K) and valid (K), the sum over blocks of expected_length - 1, the number of blocks


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
    chain = accept * valid if blocks.drafting is None else (accept * valid)[..., blocks.drafting]  # drafted slots
    length_sum = chain.cumprod(-1).sum(-1).sum()  # over blocks: accepted length - 1
    sums = [weights.sum(), ce, l1, confidence if confidence is not None else torch.zeros((), device=ce.device)]
    stats = torch.cat([torch.stack(sums).detach(), (accept * valid).sum((0, 1)), valid.sum((0, 1)),
                       length_sum[None], torch.tensor([float(valid.shape[0] * valid.shape[1])], device=ce.device)])
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



def block_hidden(draft: DSparkDraft, features: torch.Tensor, blocks: BlockBatch) -> torch.Tensor:
    """features [B, T, n*Ht] -> the draft's final-norm hidden state of every block slot [B, A, K, H]."""
    B, T = features.shape[:2]
    A, K = blocks.labels.shape[1:]
    context = draft.project_context(features)  # [B, T, H]
    context_positions = torch.arange(T, device=features.device).expand(B, T)
    kv = draft.context_kv(context, context_positions)
    return draft.block_hidden(blocks.input_ids, blocks.positions, kv, blocks.attn_mask, block_length=K).view(B, A, K, -1)


def draft_forward(draft: DSparkDraft, features: torch.Tensor, blocks: BlockBatch):
    """features [B, T, n*Ht] -> draft logits [B, A, K, V] (Markov-corrected, teacher-forced), confidence [B, A, K]."""
    hidden = block_hidden(draft, features, blocks)  # [B, A, K, H]
    logits = draft.base_logits(hidden)  # [B, A, K, Vd]
    embed = None
    if draft.config.markov_rank:
        embed = draft.markov_embed(blocks.prev_ids)  # [B, A, K, r]
        logits = logits + draft.markov_bias(draft.markov_latents(embed, hidden))  # gated / RNN: from hidden too
    if draft.candidate_selector is not None:  # DFlash2: the selector's pairwise term on the top-k candidates
        logits = logits + draft.candidate_selector.teacher_bias(hidden, logits, blocks.prev_ids)
    confidence = draft.confidence_logit(hidden, embed) if draft.confidence_head is not None else None
    return logits, confidence


class DraftStep(torch.nn.Module):
    """draft_forward as a module, so that DistributedDataParallel can wrap it (DDP hooks the module's forward)."""

    def __init__(self, draft: DSparkDraft):
        super().__init__()
        self.draft = draft

    def forward(self, features: torch.Tensor, blocks: BlockBatch):
        return draft_forward(self.draft, features, blocks)

