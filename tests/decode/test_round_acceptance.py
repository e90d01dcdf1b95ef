"""Per-context acceptance of dspark's own round at T > 0 against the exact values from p and q.

A fixed context (prompt [2, 0, 3]) on the 4-token bigram pair of tests/fixtures/pair_factory.py (draft vocabulary 3 through
d2t, so target token 1 only comes from residual resampling). Each draw runs the round's own functions on that
context: the Markov stage (speculative.markov_stage: the walk samples d1, d2 and returns q), then the accept step
(speculative.accept_block: rejection sampling on the target's probabilities and q). The target's logits of
[anchor, d1, d2] are computed once per (d1, d2) by target.score and reused, because they do not depend on the draw.

Exact values, computed here from the models without the walk: p1 = target_probs(target logits after the context),
p2(x1) = the same after the context and x1; q1 = target_probs(base_1 + W2 W1[anchor]), q2(x1) =
target_probs(base_2 + W2 W1[x1]) (draft ids scattered to target ids through d2t). Then
  P(position 1 accepted)    = sum_x min(p1, q1)(x)
  P(positions 1, 2 accepted) = sum_x1 min(p1, q1)(x1) * sum_x min(p2(.|x1), q2(.|x1))(x)
and the first committed token (d1 if accepted, else the residual sample) is distributed as p1. Each acceptance
rate must lie within Z_SE standard errors of its exact value (binomial, DRAWS draws); the first token's law is
checked per token the same way (a Bonferroni-style 5 SE bound over 4 tokens: false alarm < 1e-5 per check).
"""

import math

import pytest
import torch
from ckpt_factory import DraftSpec
from pair_factory import bigram_draft, bigram_target

from dspark_cli.runtime.settings import MarkovHead, resolve_markov
from dspark_cli.runtime.decode.sampling import target_probs
from dspark_cli.runtime.settings import SamplingParams
from dspark_cli.runtime.decode.speculative import Drafter, accept_block, draft_backbone, markov_stage, prefill
from dspark_cli.runtime.model.draft_io import load_draft
from dspark_cli.runtime.model.target import TargetModel

VOCAB = 4
SPEC = DraftSpec(vocab_size=VOCAB, draft_vocab_size=3, mask_token_id=3, markov_rank=64, num_hidden_layers=1,
                 target_layers=1, target_layer_ids=(0,), block_size=4, dtype=torch.float32)
PROMPT = [2, 0, 3]
DRAWS = 12_000
Z_SE = 5.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("per_context")
    target_dir = bigram_target(root / "target", SPEC, damp=0.0, logit_std=0.12, seed=3)
    draft_dir = bigram_draft(root / "draft", SPEC, target_dir, w2_gain=0.8, w2_noise=0.6)
    return TargetModel.load(target_dir, [1]), load_draft(draft_dir)


def draft_distribution(draft, base_row: torch.Tensor, prev: int, params: SamplingParams) -> torch.Tensor:
    """q over the target vocabulary at one position: target_probs(base + W2 W1[prev]) scattered through d2t."""
    with torch.no_grad():
        logits = base_row + draft.markov_bias(draft.markov_embed(torch.tensor([prev])))[0]  # [Vd]
    probs = target_probs(logits[None].float(), params)[0]  # [Vd]
    ids = torch.arange(probs.numel()) + (draft.d2t if draft.d2t is not None else 0)
    return torch.zeros(VOCAB).index_copy_(0, ids, probs)


def within(observed: float, exact: float, draws: int) -> bool:
    return abs(observed - exact) <= Z_SE * math.sqrt(max(exact * (1 - exact), 1e-12) / draws) + 1e-9


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6),
                                    SamplingParams(temperature=1.0, top_p=0.8),
                                    SamplingParams(temperature=1.3, top_k=3)],
                         ids=["T1", "T0.6", "T1-top-p", "T1.3-top-k3"])
def test_acceptance_of_positions_1_and_2_matches_p_and_q(pair, params):
    target, draft = pair
    generator = torch.Generator().manual_seed(1)
    anchor, context = prefill(target, draft, torch.tensor(PROMPT), params, generator, capacity=16)
    strategy = resolve_markov("auto", MarkovHead.of_config(draft.config, nvfp4=False), None, params, on_cuda=False)
    drafter = Drafter(draft, strategy, params, target.vocab_size)
    hidden, base = draft_backbone(drafter, context, anchor, 2)  # [2, H], [2, Vd]: fixed for this context
    length = target.cache_length

    scored: dict[tuple[int, int], torch.Tensor] = {}

    def target_logits(d1: int, d2: int) -> torch.Tensor:  # [3, V] of [anchor, d1, d2] after the context
        if (d1, d2) not in scored:
            scored[(d1, d2)] = target.score(torch.tensor([anchor, d1, d2]))[0]
            target.crop(length)
        return scored[(d1, d2)]

    first_accepted = both_accepted = 0
    first_tokens = torch.zeros(VOCAB)
    for _ in range(DRAWS):
        proposal = markov_stage(drafter, hidden, base, anchor, generator)
        drafted = proposal.tokens.tolist()
        accepted, next_token = accept_block(proposal, drafted, target_logits(*drafted), params, generator)
        first_accepted += accepted >= 1
        both_accepted += accepted >= 2
        first_tokens[drafted[0] if accepted >= 1 else next_token] += 1

    p1 = target_probs(target_logits(0, 0)[:1], params)[0]
    q1 = draft_distribution(draft, base[0], anchor, params)
    exact_first = float(torch.minimum(p1, q1).sum())
    exact_both = 0.0
    for x1 in range(VOCAB):
        p2 = target_probs(target_logits(x1, 0)[1:2], params)[0]
        q2 = draft_distribution(draft, base[1], x1, params)
        exact_both += float(torch.minimum(p1, q1)[x1]) * float(torch.minimum(p2, q2).sum())

    assert 0.1 < exact_first < 0.95 and 0.02 < exact_both < exact_first  # the test sees partial acceptance
    assert within(first_accepted / DRAWS, exact_first, DRAWS), (first_accepted / DRAWS, exact_first)
    assert within(both_accepted / DRAWS, exact_both, DRAWS), (both_accepted / DRAWS, exact_both)
    for token in range(VOCAB):
        assert within(float(first_tokens[token]) / DRAWS, float(p1[token]), DRAWS), (first_tokens / DRAWS, p1)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.6)],
                         ids=["top-k2", "top-p0.6"])
def test_the_first_token_after_the_prompt_is_drawn_within_top_k_and_top_p(pair, params):
    """prefill samples the first new token from the target's distribution under the request's top-k / top-p: it
    never lies outside the kept set (the 4-token target is near uniform, so unrestricted draws would)."""
    target, draft = pair
    logits, _ = target.prefill(torch.tensor(PROMPT))
    kept = set(target_probs(logits[None], params)[0].nonzero().flatten().tolist())
    assert 1 < len(kept) < VOCAB
    generator = torch.Generator().manual_seed(0)
    drawn = {prefill(target, draft, torch.tensor(PROMPT), params, generator, capacity=4)[0] for _ in range(60)}
    assert drawn == kept
