"""The speculative decoding loop: prefill -> draft a block -> verify -> accept -> repeat (batch 1).

    result = speculative_generate(target, draft, prompt_ids, SamplingParams(), block_size=7, max_new_tokens=128)
    result.tokens, result.stats      # new token ids; metrics.GenerationStats with one RoundRecord per round

A round (anchor a = the last committed token, at position p = the target cache length = the number
of positions in the draft's context):
  1. draft backbone: one parallel pass over the query block, attending to the cached context K/V
     (sample_from_anchor: N queries [a, mask*(N-1)] at p..p+N-1, slot j predicts p+j+1;
     otherwise the DFlash layout: N+1 queries [a, mask*N] at p..p+N, slot j>0 predicts p+j);
  2. Markov stage (runtime/markov.py): N sequential steps -> draft tokens d_1..d_N, their draft
     distribution q, and the confidence head's c_i (survival s_i = c_1 * ... * c_i);
  3. verify: the target scores [a, d_1..d_k] in one forward (k = N, or the number of positions whose
     survival >= --confidence-threshold); sampling.verify accepts a prefix (exact match at T = 0,
     rejection sampling with q at T > 0) and emits one more token (correction or bonus);
  4. bookkeeping: crop the target cache to p + accepted + 1; append the draft context K/V of the
     anchor and the accepted tokens (their target features come from the verify pass), so the
     draft's per-round context work is proportional to the new tokens. Query-block K/V are never kept.
Stop tokens follow DeepSpec's evaluator; so does the length limit with length_rule="deepspec" (docs/eval.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dspark_cli.runtime import sampling
from dspark_cli.runtime.markov import MarkovWeights, choose_strategy, draft_to_target, markov_walk
from dspark_cli.runtime.metrics import GenerationStats, RoundRecord
from dspark_cli.runtime.sampling import SamplingParams

TokenCallback = Callable[[list[int]], None]
# New positions the draft context reserves up front: a huge --max-new-tokens (generation may end at a stop token
# long before) must not allocate its whole length at once.
INITIAL_NEW_CAPACITY = 4096


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens, trimmed to max_new_tokens and at the first stop token (kept)
    stats: GenerationStats
    finished_by_stop: bool = False


def max_block_size(config) -> int | None:
    """The most draft tokens per round the draft was trained for: block_size query slots, one of them
    the anchor's own slot in the DFlash layout (sample_from_anchor false). None when the config says nothing."""
    trained = config.block_size.value
    if trained is None:
        return None
    return trained if config.sample_from_anchor else trained - 1


class DraftContext:
    """Context K/V of the draft for positions 0..length-1, in buffers that grow by doubling."""

    def __init__(self, draft, capacity: int):
        config, weight = draft.config, draft.fc.weight
        shape = (1, config.num_key_value_heads, max(capacity, 1), config.head_dim)
        self.keys = [torch.empty(shape, dtype=weight.dtype, device=weight.device) for _ in draft.layers]
        self.values = [torch.empty_like(k) for k in self.keys]
        self.length = 0

    def append(self, draft, features: torch.Tensor) -> None:
        """Project the target features of the next T positions and store their K/V. [T, n*Ht] -> cache."""
        count = features.shape[0]
        end = self.length + count
        if end > self.keys[0].shape[2]:
            self._grow(2 * end)
        positions = torch.arange(self.length, end, device=features.device)[None]  # [1, T]
        with torch.inference_mode():
            new_kv = draft.context_kv(draft.project_context(features[None]), positions)  # layers x [1, kvh, T, D]
        for keys, values, (k, v) in zip(self.keys, self.values, new_kv):
            keys[:, :, self.length : end] = k
            values[:, :, self.length : end] = v
        self.length = end

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [1, kv_heads, length, head_dim] views."""
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in zip(self.keys, self.values)]

    def _grow(self, capacity: int) -> None:
        def grown(buffer: torch.Tensor) -> torch.Tensor:
            bigger = buffer.new_empty(*buffer.shape[:2], capacity, buffer.shape[3])
            bigger[:, :, : self.length] = buffer[:, :, : self.length]
            return bigger

        self.keys = [grown(k) for k in self.keys]
        self.values = [grown(v) for v in self.values]


@dataclass
class Proposal:
    """One drafted block of N positions."""

    tokens: torch.Tensor  # [N] int64 target ids
    draft_probs: torch.Tensor | None  # [N, V] fp32 q over the target vocabulary; None when greedy (q one-hot)
    confidences: torch.Tensor | None  # [N] fp32 c_i; None without a confidence head
    backbone_s: float = 0.0
    markov_s: float = 0.0


@dataclass
class Drafter:
    """What draft_block needs besides the draft model: the resolved Markov strategy and the sampling."""

    draft: object  # runtime.draft.DSparkDraft
    strategy: str  # one of markov.STRATEGIES
    params: SamplingParams
    target_vocab: int
    draft_topk: int | None = None
    weights: MarkovWeights | None = field(init=False)

    def __post_init__(self) -> None:
        self.weights = MarkovWeights.from_draft(self.draft)


class _Clock:
    """Wall-clock laps; synchronizes CUDA first so that each lap covers the work it names."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.last = self.now()

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self) -> float:
        now = self.now()
        elapsed, self.last = now - self.last, now
        return elapsed


def prefill(
    target, draft, prompt_ids: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, capacity: int
) -> tuple[int, DraftContext]:
    """Run the prompt [P] through the target, sample the first new token, and fill the draft context."""
    logits, features = target.prefill(prompt_ids)  # [V], [P, n*Ht]
    first = int(sampling.sample(sampling.target_probs(logits[None], params), generator)[0])
    context = DraftContext(draft, capacity)
    context.append(draft, features)
    return first, context


@torch.inference_mode()
def draft_block(
    drafter: Drafter, context: DraftContext, anchor: int, n_draft: int, generator: torch.Generator | None
) -> Proposal:
    """Propose n_draft tokens after `anchor` (at position context.length)."""
    draft, params = drafter.draft, drafter.params
    device = context.keys[0].device
    clock = _Clock(device)
    start = context.length
    n_queries = n_draft if draft.config.sample_from_anchor else n_draft + 1
    ids = torch.full((1, n_queries), draft.config.mask_token_id, dtype=torch.long, device=device)
    ids[0, 0] = anchor
    positions = torch.arange(start, start + n_queries, device=device)[None]  # [1, Q]
    hidden = draft.block_hidden(ids, positions, context.kv())[0, n_queries - n_draft :]  # [N, H]
    base = draft.base_logits(hidden)  # [N, Vd]
    backbone_s = clock.lap()

    noise = None if params.greedy else sampling.gumbel_noise((1, *base.shape), generator, device)  # [1, N, Vd]
    first_prev = torch.tensor([anchor], device=device)  # [1]: the walk is batch-first, here a batch of one block
    walk = markov_walk(drafter.strategy, drafter.weights, base[None], first_prev, params, noise, drafter.draft_topk)
    embeds = None if walk.embeds is None else walk.embeds[0]  # [N, r]
    confidences = None
    if draft.confidence_head is not None:
        confidences = torch.sigmoid(draft.confidence_logit(hidden, embeds))  # [N]
    draft_probs = None if params.greedy else _target_vocab_probs(drafter, walk.logits[0])
    return Proposal(walk.tokens[0], draft_probs, confidences, backbone_s, clock.lap())


def _target_vocab_probs(drafter: Drafter, logits: torch.Tensor) -> torch.Tensor:
    """q over the target vocabulary: the processed draft distribution of logits [N, Vd] scattered through d2t
    -> [N, V]."""
    probs = sampling.target_probs(logits, drafter.params)  # [N, Vd]
    d2t = drafter.draft.d2t
    if d2t is None and probs.shape[-1] == drafter.target_vocab:
        return probs
    target_ids = draft_to_target(d2t, torch.arange(probs.shape[-1], device=probs.device))  # [Vd]
    full = probs.new_zeros(probs.shape[0], drafter.target_vocab)
    return full.index_copy_(1, target_ids, probs)


CONFIDENCE_RULES = ("survival", "per-slot")
LENGTH_RULES = ("stop", "deepspec")


def verified_length(confidences: torch.Tensor, threshold: float, rule: str = "survival") -> int:
    """How many drafted positions to verify. [N] fp32 -> 0..N.

    survival (vLLM's capacity rule): the positions whose survival Π_{i<=j} c_i >= threshold (survival never
    increases, so they form a prefix). per-slot (DeepSpec's evaluator): the positions before the first slot
    whose own c_j < threshold."""
    if rule == "per-slot":
        below = (confidences < threshold).nonzero()
        return int(below[0, 0]) if below.numel() else int(confidences.shape[0])
    survival = torch.cumprod(confidences.double(), dim=0)  # [N]
    return int((survival >= threshold).sum())


def verify_block(
    target, anchor: int, proposal: Proposal, k: int, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, int, torch.Tensor]:
    """Score [anchor, d_1..d_k] with the target and verify. -> (accepted, next token, features [k+1, n*Ht])."""
    device = proposal.tokens.device
    block = torch.cat([torch.tensor([anchor], device=device), proposal.tokens[:k]])  # [k+1]
    logits, features = target.verify(block)  # [k+1, V], [k+1, n*Ht]
    target_probs = sampling.target_probs(logits, params)  # [k+1, V]
    draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[:k]
    accepted, next_token = sampling.verify(proposal.tokens[:k], draft_probs, target_probs, generator)
    return accepted, next_token, features


def speculative_generate(
    target,
    draft,
    prompt_ids: Sequence[int] | torch.Tensor,
    params: SamplingParams,
    *,
    block_size: int,
    max_new_tokens: int,
    strategy: str = "auto",
    draft_topk: int | None = None,
    confidence_threshold: float | None = None,
    confidence_rule: str = "survival",
    length_rule: str = "stop",
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    on_tokens: TokenCallback | None = None,
) -> GenerationResult:
    """Generate up to max_new_tokens after the prompt with `draft` proposing block_size tokens per round.

    strategy: "auto" or one of markov.STRATEGIES (ValueError if it cannot run); confidence_threshold:
    verify only a prefix of the drafted positions chosen by confidence_rule (verified_length; None: all).
    length_rule: "stop" ends when max_new_tokens are committed; "deepspec" runs one more round when exactly
    max_new_tokens are committed (DeepSpec's evaluator loops while the anchor index is below the limit); that
    round's tokens are trimmed away but it is recorded. on_tokens receives each batch of newly committed tokens.
    """
    if block_size < 1 or max_new_tokens < 1:
        raise ValueError(f"block_size and max_new_tokens must be >= 1, got {block_size} and {max_new_tokens}")
    if confidence_rule not in CONFIDENCE_RULES or length_rule not in LENGTH_RULES:
        raise ValueError(f"confidence_rule must be one of {CONFIDENCE_RULES} and length_rule one of {LENGTH_RULES}, "
                         f"got {confidence_rule!r} and {length_rule!r}")
    if confidence_threshold is not None and draft.confidence_head is None:
        raise ValueError("a confidence threshold needs a draft with a confidence head")
    prompt = _as_ids(prompt_ids, target.device)
    on_cuda = target.device.type == "cuda"
    resolved = choose_strategy(strategy, MarkovWeights.from_draft(draft), draft_topk, params, on_cuda)
    drafter = Drafter(draft, resolved, params, target.vocab_size, draft_topk)
    stops = set(stop_ids)
    clock = _Clock(target.device)
    start = clock.last

    capacity = len(prompt) + min(max_new_tokens, INITIAL_NEW_CAPACITY) + block_size + 2  # grows by doubling beyond
    anchor, context = prefill(target, draft, prompt, params, generator, capacity)
    tokens = [anchor]
    ttft_s = clock.lap()
    if on_tokens is not None:
        on_tokens([anchor])
    rounds: list[RoundRecord] = []
    stopped = anchor in stops
    committed_total = 1  # before trimming to max_new_tokens
    limit = max_new_tokens + (1 if length_rule == "deepspec" else 0)  # loop while committed_total < limit
    while not stopped and committed_total < limit:
        proposal = draft_block(drafter, context, anchor, block_size, generator)
        clock.lap()  # already split into backbone and Markov time by draft_block
        k = block_size
        if confidence_threshold is not None:
            k = verified_length(proposal.confidences, confidence_threshold, confidence_rule)
        accepted, next_token, features = verify_block(target, anchor, proposal, k, params, generator)
        verify_s = clock.lap()

        drafted = proposal.tokens[:accepted].tolist()
        stop_at = next((j for j, token in enumerate(drafted) if token in stops), None)
        if stop_at is not None:  # an accepted stop token ends the round and generation (DeepSpec's rule)
            committed = drafted[: stop_at + 1]
            record = RoundRecord(proposed=stop_at + 1, accepted=stop_at + 1, emitted=stop_at + 1, drafted=block_size)
        else:
            committed = drafted + [next_token]
            record = RoundRecord(proposed=k, accepted=accepted, emitted=accepted + 1, drafted=block_size)
        new = committed[: max_new_tokens - len(tokens)]
        committed_total += len(committed)
        stopped = committed[-1] in stops
        tokens += new
        if on_tokens is not None and new:
            on_tokens(new)
        if not stopped and committed_total < limit:
            target.crop(context.length + accepted + 1)
            context.append(draft, features[: accepted + 1])
            anchor = next_token
        if proposal.confidences is not None:
            record.confidences = proposal.confidences.tolist()
        record.draft_backbone, record.markov, record.verify = proposal.backbone_s, proposal.markov_s, verify_s
        record.other = clock.lap()  # crop, context K/V of the new positions, streaming
        rounds.append(record)

    stats = GenerationStats(len(prompt), len(tokens), ttft_s, clock.last - start, rounds)
    return GenerationResult(tokens, stats, tokens[-1] in stops)


def autoregressive_generate(
    target,
    prompt_ids: Sequence[int] | torch.Tensor,
    params: SamplingParams,
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    on_tokens: TokenCallback | None = None,
) -> GenerationResult:
    """The baseline: plain one-token-at-a-time decoding of the same target (no feature capture)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompt = _as_ids(prompt_ids, target.device)
    stops = set(stop_ids)
    clock = _Clock(target.device)
    start = clock.last
    logits = target.prefill_plain(prompt)  # [V]
    tokens: list[int] = []
    ttft_s = 0.0
    while True:
        token = int(sampling.sample(sampling.target_probs(logits[None], params), generator)[0])
        tokens.append(token)
        if len(tokens) == 1:
            ttft_s = clock.now() - start
        if on_tokens is not None:
            on_tokens([token])
        if token in stops or len(tokens) >= max_new_tokens:
            break
        logits = target.decode_one(token)
    stats = GenerationStats(len(prompt), len(tokens), ttft_s, clock.now() - start, [])
    return GenerationResult(tokens, stats, tokens[-1] in stops)


def _as_ids(prompt_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).flatten()  # [P]
    if ids.numel() == 0:
        raise ValueError("the prompt is empty; give at least one token")
    return ids
