"""Speculative sampling at T > 0 emits exactly the target's distribution, end to end through speculative_generate.

Setup: a 4-token target that is an exact bigram model (every decoder layer adds zero to the residual stream,
tests/fixtures/pair_factory.py), so the exact distribution of each emitted token given the previous one is known:
p(. | x) = target_probs(logits of the one-token sequence [x]), checked below to be context-free. The draft
(draft vocabulary 3 via d2t, so one token can only come from residual resampling) has a noisy copy of the
bigram in its Markov head and a random confidence head; sampling uses T = 0.9 and top-k 3, so one token per
row has probability 0 and must never appear. Every other generation uses a confidence threshold that cuts
most of its rounds short. Every emitted token is
one draw from p(. | previous token), so the transition counts of N = 27,000 emitted tokens are tested with a
Pearson chi-square against the exact conditionals (df = 4 rows x (3 - 1) = 8).

Threshold and power: the false-alarm rate is 1e-3 (chi-square(8) quantile, Wilson-Hilferty, slightly
conservative). A "2% bias" is an emitted conditional at total-variation distance >= 0.02 from the target's,
averaged over transitions; its noncentrality is >= 4 N 0.02^2 = 43.2 (Cauchy-Schwarz and Jensen), which this
test misses with probability < 0.05 (the helper re-derives the power and asserts it). The run is seeded, so
the test is deterministic.
"""

import math

import pytest
import torch
from ckpt_factory import DraftSpec
from pair_factory import bigram_draft, bigram_target, dflash2_bigram_draft
from dspark_cli.runtime.model.draft_io import load_draft
from dspark_cli.runtime.decode.sampling import target_probs
from dspark_cli.runtime.settings import SamplingParams
from loop import generate
from dspark_cli.runtime.model.target import TargetModel

VOCAB = 4
SPEC = DraftSpec(vocab_size=VOCAB, draft_vocab_size=3, mask_token_id=3, markov_rank=64, num_hidden_layers=1,
                 target_layers=1, target_layer_ids=(0,), block_size=4, dtype=torch.float32)
PARAMS = SamplingParams(temperature=0.9, top_k=3)
GENERATIONS, TOKENS_EACH = 9, 3000
Z_FALSE_ALARM = 3.090232  # standard normal upper quantile for 1e-3
MIN_BIAS_TV = 0.02
MIN_POWER = 0.95


def chi_square_threshold(df: int) -> float:
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_FALSE_ALARM * math.sqrt(a)) ** 3


def power_lower_bound(df: int, total: int, bias_tv: float = MIN_BIAS_TV) -> float:
    """P(noncentral chi-square(df, 4 N TV^2) > threshold), normal approximation."""
    noncentrality = 4.0 * total * bias_tv**2
    mean, sd = df + noncentrality, math.sqrt(2.0 * (df + 2.0 * noncentrality))
    return 0.5 * math.erfc((chi_square_threshold(df) - mean) / (sd * math.sqrt(2.0)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossless")
    # seed 5: a target whose rounds accept 0..4 drafts in fair proportions (tau ~ 3), which keeps the test fast
    target_dir = bigram_target(root / "target", SPEC, damp=0.0, logit_std=0.15, seed=5)
    draft_dir = bigram_draft(root / "draft", SPEC, target_dir, w2_gain=1.0, w2_noise=0.1)
    target = TargetModel.load(target_dir, [1])
    return target, load_draft(draft_dir)


def exact_conditionals(target: TargetModel) -> torch.Tensor:
    """[V, V]: row x = the target's processed next-token distribution after token x."""
    with torch.no_grad():
        logits = target.model(torch.arange(VOCAB)[:, None]).logits[:, -1]  # [V, V]
        in_context = target.model(torch.tensor([[2, 0, 3, 1]])).logits[0]  # [4, V]
    torch.testing.assert_close(in_context, logits[[2, 0, 3, 1]], rtol=1e-5, atol=1e-5)  # the target is bigram
    return target_probs(logits, PARAMS).double()


def bigram_counts(target, draft, seed: int, threshold: float, tokens_each: int):
    """GENERATIONS generations from prompts [g % VOCAB], every other one with the confidence threshold: the counts of
    each emitted (previous, next) token pair [VOCAB, VOCAB] and every round's record."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    rounds = []
    for g in range(GENERATIONS):
        prompt = [g % VOCAB]
        result = generate(target, draft, prompt, PARAMS, block_size=4, max_new_tokens=tokens_each,
                          confidence_threshold=threshold if g % 2 else None, generator=generator)
        sequence = torch.tensor(prompt + result.tokens)
        counts.index_put_((sequence[:-1], sequence[1:]), torch.ones(len(result.tokens), dtype=torch.float64),
                          accumulate=True)
        rounds += result.stats.rounds
    return counts, rounds


def test_emitted_tokens_follow_the_target_distribution(pair):
    target, draft = pair
    exact = exact_conditionals(target)
    # every other generation verifies only confident prefixes
    counts, rounds = bigram_counts(target, draft, seed=0, threshold=0.05, tokens_each=TOKENS_EACH)

    # the run exercised what it claims: rejections, full acceptances, cut rounds, residual-only tokens
    assert {r.accepted for r in rounds} == {0, 1, 2, 3, 4}
    assert any(r.proposed < r.drafted for r in rounds) and any(r.proposed == r.drafted for r in rounds)
    assert counts[:, 1].sum() > 0  # token 1 is outside the draft vocabulary: residual resampling only

    support = exact > 0
    assert counts[~support].sum() == 0, "a token outside the target's top-k was emitted"
    expected = counts.sum(-1, keepdim=True) * exact
    statistic = float(((counts - expected)[support] ** 2 / expected[support]).sum())
    df = int((support.sum(-1) - 1).sum())
    total = int(counts.sum())
    assert total == GENERATIONS * TOKENS_EACH and df == 8
    assert power_lower_bound(df, total) >= MIN_POWER
    assert statistic < chi_square_threshold(df), f"chi-square {statistic:.1f} (df {df})"


# A DFlash2 draft (docs/formats-other.md §7.4) on the same target: its path selector holds a noisy copy of the bigram
# and proposes from 2 of the 4 tokens per slot (selector_top_k 2), so q is 0 on the other two and every token there
# comes from residual resampling; the threshold runs on the selector's top-1 share. Its rounds are short (τ ~ 1.6),
# so it runs 9 x 1334 tokens: power >= 0.95 against a 3% bias (total variation), at the same false-alarm rate.
DFLASH2_TOKENS_EACH, DFLASH2_BIAS_TV = 1334, 0.03
DFLASH2 = SPEC.with_(family="dflash2", markov_rank=0, confidence=False, draft_vocab_size=None, block_size=5,
                     selector_rank=64, selector_top_k=2)


@pytest.fixture(scope="module")
def dflash2_pair(pair, tmp_path_factory):
    target, _ = pair
    root = tmp_path_factory.mktemp("lossless-dflash2")
    target_dir = bigram_target(root / "target", SPEC, damp=0.0, logit_std=0.15, seed=5)
    draft_dir = dflash2_bigram_draft(root / "draft", DFLASH2, target_dir, gain=1.0, noise=0.3)
    return target, load_draft(draft_dir)


def test_dflash2_emitted_tokens_follow_the_target_distribution(dflash2_pair):
    target, draft = dflash2_pair
    exact = exact_conditionals(target)
    counts, rounds = bigram_counts(target, draft, seed=1, threshold=0.3, tokens_each=DFLASH2_TOKENS_EACH)

    assert {r.accepted for r in rounds} == {0, 1, 2, 3, 4}
    assert any(r.proposed < r.drafted for r in rounds) and any(r.proposed == r.drafted for r in rounds)
    support = exact > 0
    assert counts[~support].sum() == 0, "a token outside the target's top-k was emitted"
    expected = counts.sum(-1, keepdim=True) * exact
    statistic = float(((counts - expected)[support] ** 2 / expected[support]).sum())
    df = int((support.sum(-1) - 1).sum())
    assert int(counts.sum()) == GENERATIONS * DFLASH2_TOKENS_EACH and df == 8
    assert power_lower_bound(df, int(counts.sum()), DFLASH2_BIAS_TV) >= MIN_POWER
    assert statistic < chi_square_threshold(df), f"chi-square {statistic:.1f} (df {df})"
