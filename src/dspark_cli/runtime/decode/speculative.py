"""The speculative decoding loop (batch 1): prefill, then rounds of draft -> score -> accept -> commit -> rollback ->
advance.

    settings = resolve_settings(draft.config, MarkovHead.of_config(draft.config, nvfp4=False), on_cuda=False)
    result = speculative_generate(target, draft, prompt_ids, settings, max_new_tokens=128)
    result.tokens, result.stats      # new token ids; metrics.GenerationStats with one RoundRecord per round

A round (anchor a = the last committed token, at position p; invariant, checked each round by check_lengths:
target cache length == draft context length == p, the committed positions before the anchor):
  draft    draft_backbone: one parallel pass over the query block, attending to the cached context K/V
           (sample_from_anchor: N queries [a, mask*(N-1)] at p..p+N-1, slot j predicts p+j+1; otherwise the
           DFlash layout: N+1 queries [a, mask*N] at p..p+N, slot j>0 predicts p+j); then markov_stage
           (runtime/decode/markov.py): N sequential steps -> draft tokens d_1..d_N, their distribution q, and the
           confidence head's c_i (survival s_i = c_1 * ... * c_i);
  score    the target forward over [a, d_1..d_n] (n_scored = N, or the positions kept by scored_length with a
           confidence threshold); the target cache grows by n_scored + 1;
  accept   accept_block keeps a prefix: exact match with the target's argmax at T = 0, rejection sampling with
           q at T > 0 (sampling.accept); one more token follows (the correction or the bonus);
  commit   the accepted prefix and that token join the output (up to an accepted stop token);
  rollback crop the target cache to p + accepted + 1; a Gated DeltaNet target copies in its states at that
           position (kept by its score pass, model/gdn_scoring.py); another stateful target (model/target_state.py)
           restores the recurrent / conv states it copied before the score pass (`snapshot`) and re-advances them
           over the kept positions; a round that keeps every scored position restores nothing;
  advance  append the draft context K/V of the anchor and the accepted tokens (their features come from the
           score pass): target and draft both hold p + accepted + 1 again.
Counts: n_draft (= block_size) positions are drafted, n_scored <= n_draft of them scored. Query-block K/V are never
kept. Timing: a SectionTimer records ms per step per round (GenerationStats.sections). Stop tokens follow
DeepSpec's evaluator; so does the length limit with length_rule="deepspec" (docs/eval.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dspark_cli.runtime.decode import sampling
from dspark_cli.runtime.model.draft import DraftContext
from dspark_cli.runtime.decode.markov import MarkovWeights, markov_walk
from dspark_cli.runtime.decode.selector import selector_walk
from dspark_cli.runtime.rounds import GenerationStats, RoundRecord, scored_length
from dspark_cli.runtime.settings import DecodeSettings, SamplingParams
from dspark_cli.runtime.decode.timing import SectionTimer

TokenCallback = Callable[[list[int]], None]
# New positions the draft context reserves up front: a huge --max-new-tokens (generation may end at a stop token
# long before) must not allocate its whole length at once.
INITIAL_NEW_CAPACITY = 4096


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens, trimmed to max_new_tokens and at the first stop token (kept)
    stats: GenerationStats
    finished_by_stop: bool = False


@dataclass
class Proposal:
    """One drafted block of N positions."""

    tokens: torch.Tensor  # [N] int64 target ids
    draft_probs: torch.Tensor | None  # [N, V] fp32 q over the target vocabulary; None when greedy (q one-hot)
    confidences: torch.Tensor | None  # [N] fp32 c_i = sigmoid(logit_i / T_i); None without a confidence head
    confidence_logits: torch.Tensor | None = None  # [N] fp32 the head's raw logits (before any temperature)


@dataclass
class Drafter:
    """What the draft step needs besides the context: the draft model, the resolved Markov strategy, the
    sampling, and the query-block ids [anchor, mask, ...] reused from round to round (one per block length)."""

    draft: object  # runtime.draft.DSparkDraft
    strategy: str  # one of markov.STRATEGIES
    params: SamplingParams
    target_vocab: int
    draft_topk: int | None = None
    weights: MarkovWeights | None = field(init=False)
    query_ids: dict[int, torch.Tensor] = field(init=False, default_factory=dict)  # n_queries -> [1, Q] int64
    draft_vocab_ids: torch.Tensor | None = field(init=False)  # [Vd] target id of each draft id; None: identity

    @classmethod
    def of(cls, draft, settings: DecodeSettings, target_vocab: int) -> "Drafter":
        return cls(draft, settings.markov, settings.sampling, target_vocab, settings.draft_topk)

    def __post_init__(self) -> None:
        self.weights = MarkovWeights.from_draft(self.draft)
        d2t, draft_vocab = self.draft.d2t, self.draft.lm_head.weight.shape[0]
        self.draft_vocab_ids = None
        if d2t is not None or draft_vocab != self.target_vocab:
            ids = torch.arange(draft_vocab, device=self.draft.lm_head.weight.device)
            self.draft_vocab_ids = ids if d2t is None else ids + d2t

    def queries(self, anchor: int, n_queries: int, device: torch.device) -> torch.Tensor:
        """[1, Q] int64 [anchor, mask * (Q-1)] in a buffer kept across rounds (only the anchor is written)."""
        ids = self.query_ids.get(n_queries)
        if ids is None:
            ids = torch.full((1, n_queries), self.draft.config.mask_token_id, dtype=torch.long, device=device)
            self.query_ids[n_queries] = ids
        ids[0, 0] = anchor
        return ids


def prefill(
    target, draft, prompt_ids: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, capacity: int
) -> tuple[int, DraftContext]:
    """Run the prompt [P] through the target, sample the first new token, and fill the draft context."""
    logits, features = target.prefill(prompt_ids)  # [V], [P, n*Ht]
    if params.greedy:
        first = int(logits.argmax())
    else:
        first = int(sampling.sample(sampling.target_probs(logits[None], params), generator)[0])
    context = DraftContext(draft, capacity)
    context.append(draft, features)
    return first, context


@torch.inference_mode()
def draft_backbone(drafter: Drafter, context: DraftContext, anchor: int, n_draft: int) -> tuple[torch.Tensor, ...]:
    """The draft's parallel pass over the query block at position context.length -> (hidden [N, H], base [N, Vd])."""
    draft = drafter.draft
    n_queries = n_draft if draft.config.sample_from_anchor else n_draft + 1
    device = context.keys[0].device
    ids = drafter.queries(anchor, n_queries, device)  # [1, Q]
    positions = context.position_ids(context.length, n_queries)  # [1, Q]
    hidden = draft.block_hidden(ids, positions, context.kv())[0, n_queries - n_draft :]  # [N, H]
    return hidden, draft.base_logits(hidden)  # [N, H], [N, Vd]

@torch.inference_mode()
def markov_stage(
    drafter: Drafter, hidden: torch.Tensor, base: torch.Tensor, anchor: int, generator: torch.Generator | None,
    temperatures: torch.Tensor | None = None,
) -> Proposal:
    """The sequential Markov walk over the base logits [N, Vd], the confidence head and q -> the proposal; a
    DFlash2 draft's selector walk instead (selector_stage). temperatures [N]: the confidence's STS calibration,
    c_i = sigmoid(logit_i / T_i) (None: T_i = 1)."""
    draft, params = drafter.draft, drafter.params
    if draft.candidate_selector is not None:
        return selector_stage(drafter, hidden, base, anchor, generator, temperatures)
    noise = None if params.greedy else sampling.gumbel_noise((1, *base.shape), generator, base.device)  # [1, N, Vd]
    first_prev = torch.tensor([anchor], device=base.device)  # [1]: the walk is batch-first, here one block
    walk = markov_walk(drafter.strategy, drafter.weights, base[None], first_prev, params, noise, drafter.draft_topk,
                       hidden=hidden[None])  # hidden [1, N, H]: the gated / RNN heads read it
    tokens = walk.tokens[0]  # [N] target ids (with a Markov head the walk maps them through d2t)
    if drafter.weights is None and drafter.draft_vocab_ids is not None:
        tokens = drafter.draft_vocab_ids[tokens]  # no Markov head: the walk returned draft ids
    embeds = None if walk.embeds is None else walk.embeds[0]  # [N, r]
    confidences = logits = None
    if draft.confidence_head is not None:
        logits = draft.confidence_logit(hidden, embeds).float()  # [N]
        confidences = torch.sigmoid(logits if temperatures is None else logits / temperatures)  # [N]
    draft_probs = None if params.greedy else _target_vocab_probs(drafter, walk.logits[0])
    return Proposal(tokens, draft_probs, confidences, logits)


@torch.inference_mode()
def selector_stage(
    drafter: Drafter, hidden: torch.Tensor, base: torch.Tensor, anchor: int, generator: torch.Generator | None,
    temperatures: torch.Tensor | None = None,
) -> Proposal:
    """DFlash2: candidates = the top-k of the base logits [N, V], the selector's edge scores from the hidden states
    [N, H], the walk (decode/selector.py) -> the proposal; the confidence is the selector's top-1 share."""
    selector, params = drafter.draft.candidate_selector, drafter.params
    ids, unary = selector.candidates(base)  # [N, k], [N, k]
    scores = selector(hidden, ids, unary, torch.tensor(anchor, device=base.device))  # [N, k, k]
    noise = None if params.greedy else sampling.gumbel_noise((1, *base.shape), generator, base.device)  # [1, N, V]
    walk = selector_walk(scores[None], ids[None], base.shape[-1], params, noise)
    logits = walk.confidence_logits[0]  # [N]
    confidences = torch.sigmoid(logits if temperatures is None else logits / temperatures)
    draft_probs = None if params.greedy else sampling.target_probs(walk.rows[0], params)  # [N, V]
    return Proposal(walk.tokens[0], draft_probs, confidences, logits)


def draft_block(
    drafter: Drafter, context: DraftContext, anchor: int, n_draft: int, generator: torch.Generator | None
) -> Proposal:
    """Propose n_draft tokens after `anchor` (at position context.length): backbone, then the Markov stage."""
    hidden, base = draft_backbone(drafter, context, anchor, n_draft)
    return markov_stage(drafter, hidden, base, anchor, generator)


def _target_vocab_probs(drafter: Drafter, logits: torch.Tensor) -> torch.Tensor:
    """q over the target vocabulary: the processed draft distribution of logits [N, Vd] scattered through d2t
    -> [N, V]."""
    probs = sampling.target_probs(logits, drafter.params)  # [N, Vd]
    target_ids = drafter.draft_vocab_ids
    if target_ids is None:
        return probs
    full = probs.new_zeros(probs.shape[0], drafter.target_vocab)
    return full.index_copy_(1, target_ids, probs)


def score_block(target, anchor: int, proposal: Proposal, n_scored: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target forward over [anchor, d_1..d_n_scored]; its cache grows by n_scored + 1.
    -> (logits [n_scored+1, V], features [n_scored+1, n*Ht])."""
    tokens = proposal.tokens
    block = torch.cat([tokens.new_full((1,), anchor), tokens[:n_scored]])  # [n_scored+1]
    return target.score(block)


def accept_block(
    proposal: Proposal, drafted: list[int], logits: torch.Tensor, params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Accept a prefix of the scored draft tokens -> (accepted, next token: the correction or the bonus).

    Greedy compares the drafted ids with the target's argmax ids (no distribution is built); sampling runs
    rejection sampling on the target's probabilities and q (sampling.accept). `drafted` are the scored ids."""
    n_scored = logits.shape[0] - 1
    if params.greedy:
        return sampling.accept_greedy(drafted, logits.argmax(-1).tolist())
    draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[:n_scored]
    target_probs = sampling.target_probs(logits, params)  # [n_scored+1, V]
    return sampling.accept(proposal.tokens[:n_scored], draft_probs, target_probs, generator)


def check_lengths(target, context: DraftContext) -> None:
    """The loop's invariant at the start of a round: the target cache and the draft context both hold
    exactly the committed positions before the anchor."""
    assert target.cache_length == context.length, (
        f"target cache holds {target.cache_length} positions, draft context {context.length}")


@dataclass
class _Loop:
    """The state speculative_generate carries from round to round (host-side values only)."""

    anchor: int
    tokens: list[int]
    committed_total: int  # before trimming to max_new_tokens
    stopped: bool
    # per round: (proposed, accepted, emitted, drafted, confidences, the confidence head's raw logits)
    rounds: list[tuple[int, int, int, int, list[float] | None, list[float] | None]] = field(default_factory=list)


def commit(loop: _Loop, drafted: list[int], accepted: int, next_token: int, n_scored: int,
           confidences: list[float] | None, logits: list[float] | None, stops: set[int], max_new_tokens: int
           ) -> list[int]:
    """Append the round's committed tokens (accepted prefix + next token, or up to an accepted stop token,
    DeepSpec's rule) and its (proposed, accepted, emitted, drafted, confidences, raw confidence logits).
    -> the new output tokens."""
    stop_at = next((j for j, token in enumerate(drafted[:accepted]) if token in stops), None)
    if stop_at is not None:  # an accepted stop token ends the round and generation
        committed = drafted[: stop_at + 1]
        loop.rounds.append((stop_at + 1, stop_at + 1, stop_at + 1, len(drafted), confidences, logits))
    else:
        committed = drafted[:accepted] + [next_token]
        loop.rounds.append((n_scored, accepted, accepted + 1, len(drafted), confidences, logits))
    new = committed[: max_new_tokens - len(loop.tokens)]
    loop.tokens += new
    loop.committed_total += len(committed)
    loop.stopped = committed[-1] in stops
    return new


def _record(proposed: int, accepted: int, emitted: int, drafted: int, confidences: list[float] | None,
            logits: list[float] | None) -> RoundRecord:
    """The RoundRecord of a finished round, with the confidence head's raw logits; confidences are kept as the head
    gave them, even NaN from a broken head (set after the range check: the report says why they cannot be scored,
    metrics.calibration_problem)."""
    record = RoundRecord(proposed, accepted, emitted, drafted)
    record.confidences = confidences
    record.confidence_logits = logits
    return record


def rollback(target, context: DraftContext, accepted: int) -> None:
    """Drop the rejected positions from the target: its cache then holds context.length + accepted + 1 positions
    (attention K/V cropped; a stateful target's states set to that position, model/target_state.py)."""
    target.crop(context.length + accepted + 1)


def advance(draft, context: DraftContext, features: torch.Tensor, accepted: int) -> None:
    """Give the draft context the anchor and the accepted tokens (their features came with the score pass)."""
    context.append(draft, features[: accepted + 1])


def speculative_generate(
    target,
    draft,
    prompt_ids: Sequence[int] | torch.Tensor,
    settings: DecodeSettings,
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    on_tokens: TokenCallback | None = None,
) -> GenerationResult:
    """Generate up to max_new_tokens after the prompt with `draft` proposing settings.block_size tokens per round.

    settings (settings.resolve_settings): the block size, the Markov strategy and draft top-k, the sampling, the
    verify rule (a confidence threshold scores only the prefix rounds.scored_length keeps; STS temperatures set
    c_i = sigmoid(logit_i / T_i) for it and for the recorded confidences, never the output) and the length rule
    ("stop" ends when max_new_tokens are committed; "deepspec" runs one more round when exactly max_new_tokens are
    committed, as DeepSpec's evaluator loops while the anchor index is below the limit; that round's tokens are
    trimmed away but it is recorded). on_tokens receives each batch of newly committed tokens.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    verify, block_size, params = settings.verify, settings.block_size, settings.sampling
    if verify.threshold is not None and not draft.config.has_confidence:
        raise ValueError("a confidence threshold needs a draft with a confidence head or a DFlash2 selector")
    temperatures = None
    if verify.temperatures is not None:
        temperatures = torch.tensor(verify.temperatures, dtype=torch.float32, device=target.device)  # [N]
    prompt = _as_ids(prompt_ids, target.device)
    drafter = Drafter.of(draft, settings, target.vocab_size)
    stops = set(stop_ids)
    timer = SectionTimer(target.device)

    capacity = len(prompt) + min(max_new_tokens, INITIAL_NEW_CAPACITY) + block_size + 2  # grows by doubling beyond
    anchor, context = prefill(target, draft, prompt, params, generator, capacity)
    ttft_s = timer.now() - timer.started
    loop = _Loop(anchor, [anchor], 1, anchor in stops)
    if on_tokens is not None:
        on_tokens([anchor])
    limit = max_new_tokens + (1 if settings.length_rule == "deepspec" else 0)  # loop while committed_total < limit
    while not loop.stopped and loop.committed_total < limit:
        check_lengths(target, context)
        timer.start_round()
        with timer.section("draft"):
            hidden, base = draft_backbone(drafter, context, loop.anchor, block_size)
        with timer.section("markov"):
            proposal = markov_stage(drafter, hidden, base, loop.anchor, generator, temperatures)
            drafted = proposal.tokens.tolist()  # [N] ids on the host: the one copy the round needs
            confidences = None if proposal.confidences is None else proposal.confidences.tolist()
            raw = None if proposal.confidence_logits is None else proposal.confidence_logits.tolist()
        n_scored = block_size
        if verify.threshold is not None:
            n_scored = scored_length(confidences, verify.threshold, verify.rule)
        with timer.section("snapshot"):
            target.save_state()  # a stateful target's states before the score pass; nothing for attention only
        with timer.section("score"):
            logits, features = score_block(target, loop.anchor, proposal, n_scored)  # [n+1, V], [n+1, n*Ht]
        with timer.section("accept"):
            accepted, next_token = accept_block(proposal, drafted[:n_scored], logits, params, generator)
        with timer.section("commit"):
            new = commit(loop, drafted, accepted, next_token, n_scored, confidences, raw, stops,
                         max_new_tokens)
            if on_tokens is not None and new:
                on_tokens(new)
        if not loop.stopped and loop.committed_total < limit:
            with timer.section("rollback"):
                rollback(target, context, accepted)
            with timer.section("advance"):
                advance(draft, context, features, accepted)
            loop.anchor = next_token

    rounds = [_record(*counts) for counts in loop.rounds]
    stats = GenerationStats(len(prompt), len(loop.tokens), ttft_s, timer.now() - timer.started, rounds, timer.rounds)
    return GenerationResult(loop.tokens, stats, loop.tokens[-1] in stops)


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
    timer = SectionTimer(target.device)
    logits = target.prefill_plain(prompt)  # [V]
    tokens: list[int] = []
    ttft_s = 0.0
    while True:
        token = int(sampling.sample(sampling.target_probs(logits[None], params), generator)[0])
        tokens.append(token)
        if len(tokens) == 1:
            ttft_s = timer.now() - timer.started
        if on_tokens is not None:
            on_tokens([token])
        if token in stops or len(tokens) >= max_new_tokens:
            break
        logits = target.decode_one(token)
    stats = GenerationStats(len(prompt), len(tokens), ttft_s, timer.now() - timer.started, [])
    return GenerationResult(tokens, stats, tokens[-1] in stops)


def _as_ids(prompt_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).flatten()  # [P]
    if ids.numel() == 0:
        raise ValueError("the prompt is empty; give at least one token")
    return ids
