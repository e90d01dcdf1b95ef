"""Sampling, top-k/top-p processing and lossless verification (runtime/decode/sampling.py).

The statistical tests run the real `accept_batch` (which `accept` wraps) on N = 200,000 independent
sequences at once and compare the emitted tokens with the exact target distribution by a Pearson
chi-square test at a false-alarm rate of 1e-6 (`assert_distribution`). Power: an emitted
distribution at total-variation distance >= 0.02 from the target (a "2% bias", however it is spread
over tokens) has chi-square noncentrality >= 4 * N * 0.02^2 = 320 (Cauchy-Schwarz), which the test
misses with probability < 1e-17 for every df used here (scipy ncx2: 1e-34 at df 4, 1e-31 at df 7,
5e-18 at df 63). The helper re-derives a lower bound of that power and asserts it.
"""

import math

import pytest
import torch

from dspark_cli.runtime.decode.sampling import (
    SamplingParams,
    gumbel_argmax,
    gumbel_noise,
    processed_logits,
    accept,
    accept_batch,
    accept_greedy,
    sample,
    target_probs,
)

N = 200_000
Z_FALSE_ALARM = 4.753424  # standard normal upper quantile for probability 1e-6
MIN_BIAS_TV = 0.02


def normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def chi_square_threshold(df: int) -> float:
    """Upper 1e-6 quantile of chi-square(df), Wilson-Hilferty (within 5% of the exact value, higher)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_FALSE_ALARM * math.sqrt(a)) ** 3


def assert_distribution(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Pearson chi-square test of `counts` (any shape) against the exact `probs` (same shape)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    total = float(counts.sum())
    assert counts[probs == 0].sum() == 0, "a token with target probability 0 was emitted"
    support = probs > 0
    expected = total * probs[support]
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    threshold = chi_square_threshold(df)
    noncentrality = 4.0 * total * MIN_BIAS_TV**2
    power = normal_cdf((df + noncentrality - threshold) / math.sqrt(2.0 * (df + 2.0 * noncentrality)))
    assert power > 1 - 1e-6, f"sample too small to catch a {MIN_BIAS_TV} bias (power {power})"
    assert statistic < threshold, f"chi-square {statistic:.1f} >= {threshold:.1f} (df {df})"


def histogram(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.flatten(), minlength=vocab)


# --- SamplingParams and logit processing -------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.2}, {"top_k": -1}]
)
def test_sampling_params_reject_bad_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_greedy_property():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_k=5).greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_greedy_probs_are_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 4.0]], dtype=torch.bfloat16)
    probs = target_probs(logits, SamplingParams(temperature=0.0, top_k=3, top_p=0.5))
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_temperature_scales_logits():
    logits = torch.tensor([[0.0, 2.0 * math.log(3.0)]])  # / T=2 -> [0, ln 3] -> [1/4, 3/4]
    probs = target_probs(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(probs, torch.tensor([[0.25, 0.75]]))


def test_top_k_keeps_k_largest_and_renormalises():
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0]])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    e2, e3 = math.exp(2.0), math.exp(3.0)
    torch.testing.assert_close(probs, torch.tensor([[e2 / (e2 + e3), 0.0, 0.0, e3 / (e2 + e3)]]))


def test_top_k_keeps_ties_at_the_kth_value():
    probs = target_probs(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0]]))


def test_top_k_larger_than_vocab_is_a_no_op():
    logits = torch.tensor([[0.3, -1.0, 2.0]])
    torch.testing.assert_close(
        target_probs(logits, SamplingParams(temperature=1.0, top_k=10)), logits.softmax(-1)
    )


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.7, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),  # 0.15 follows mass 0.8 >= 0.7: dropped
        (0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # 0.15 follows 0.8 < 0.85: kept
        (0.2, [1.0, 0.0, 0.0, 0.0]),  # the most likely token is always kept
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, expected):
    logits = torch.tensor([[0.3, 0.05, 0.5, 0.15]]).log()  # unsorted on purpose
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    order = [2, 0, 3, 1]  # probabilities 0.5, 0.3, 0.15, 0.05 in vocabulary order
    reordered = torch.zeros(4)
    reordered[order] = torch.tensor(expected)
    torch.testing.assert_close(probs, reordered[None])


def test_top_k_is_applied_before_top_p():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top-k 2 -> [4/7, 3/7]; then top-p 0.5: 3/7 follows mass 4/7 >= 0.5 -> dropped.
    # (top-p first would keep 0.4 and 0.3.)
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_processing_is_per_row():
    logits = torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0]])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=1))
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]))


# --- sample and Gumbel-max ---------------------------------------------------------------------


def test_sample_one_hot_rows_draw_no_random_numbers():
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    tokens = sample(torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]), generator)
    assert tokens.tolist() == [1, 2] and tokens.dtype == torch.int64
    assert torch.equal(generator.get_state(), state)


def test_sample_mixed_rows_keep_one_hot_argmax():
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 0.0, 1.0]] + [[0.5, 0.5, 0.0]] * 50)
    tokens = sample(probs, generator)
    assert tokens[0] == 2 and set(tokens[1:].tolist()) == {0, 1}


def test_sample_matches_distribution():
    probs = torch.tensor([0.05, 0.4, 0.25, 0.0, 0.3])
    tokens = sample(probs.expand(N, 5), torch.Generator().manual_seed(1))
    assert_distribution(histogram(tokens, 5), probs)


def test_gumbel_argmax_samples_softmax_over_temperature():
    logits = torch.tensor([1.0, -0.5, 0.0, 2.0, 0.7, -3.0, 0.2, 1.5])
    noise = gumbel_noise((N, 8), torch.Generator().manual_seed(2))
    assert noise.dtype == torch.float32 and torch.isfinite(noise).all()
    tokens = gumbel_argmax(logits.expand(N, 8), 0.8, noise)
    assert_distribution(histogram(tokens, 8), (logits / 0.8).softmax(-1))


def test_gumbel_argmax_with_processed_logits_follows_target_probs():
    params = SamplingParams(temperature=1.3, top_k=5, top_p=0.8)
    logits = torch.tensor([[1.0, -0.5, 0.0, 2.0, 0.7, -3.0, 0.2, 1.5]])
    noise = gumbel_noise((N, 8), torch.Generator().manual_seed(3))
    tokens = gumbel_argmax(processed_logits(logits, params).expand(N, 8), 1.0, noise)
    assert_distribution(histogram(tokens, 8), target_probs(logits, params)[0])


def test_gumbel_argmax_at_temperature_zero_is_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    noise = gumbel_noise((2, 3), torch.Generator().manual_seed(4))
    assert gumbel_argmax(logits, 0.0, noise * 100).tolist() == [1, 0]


# --- greedy verification -----------------------------------------------------------------------

V = 6


def one_hot_rows(*tokens: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


GREEDY_TARGET = one_hot_rows(1, 2, 3, 4)  # target argmax per row: 1, 2, 3, bonus 4


@pytest.mark.parametrize(
    "draft, expected",
    [
        ([1, 2, 3], (3, 4)),  # all accepted + bonus
        ([5, 2, 3], (0, 1)),  # first rejected: the target's token instead
        ([1, 0, 3], (1, 2)),  # mismatch in the middle: later matches do not count
        ([1, 2, 0], (2, 3)),  # last one rejected
    ],
)
def test_greedy_verify(draft, expected):
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    assert accept(torch.tensor(draft), None, GREEDY_TARGET, generator) == expected
    assert torch.equal(generator.get_state(), state), "greedy verification must not draw random numbers"
    assert accept_greedy(draft, GREEDY_TARGET.argmax(-1).tolist()) == expected  # ids only: the loop's greedy path


def test_accept_greedy_rejects_a_wrong_row_count():
    with pytest.raises(ValueError, match="target argmax"):
        accept_greedy([1, 2], [1, 2])


def test_greedy_verify_ignores_draft_probs():
    draft_probs = torch.full((3, V), 1.0 / V)
    assert accept(torch.tensor([1, 0, 3]), draft_probs, GREEDY_TARGET, None) == (1, 2)


def test_greedy_verify_k0_is_a_plain_target_step():
    assert accept(torch.zeros(0, dtype=torch.long), None, one_hot_rows(5), None) == (0, 5)


def test_k0_sampled_step_follows_target():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0, 0.0])
    accepted, tokens = accept_batch(
        torch.zeros(N, 0, dtype=torch.long), None, p.expand(N, 1, V), torch.Generator().manual_seed(5)
    )
    assert accepted.eq(0).all()
    assert_distribution(histogram(tokens, V), p)


def test_verify_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="target_probs"):
        accept(torch.tensor([1, 2]), None, GREEDY_TARGET, None)
    with pytest.raises(ValueError, match="draft_probs"):
        accept(torch.tensor([1, 2, 3]), torch.full((2, V), 1.0 / V), GREEDY_TARGET, None)


def test_verify_equals_verify_batch_of_one():
    p = torch.tensor([[0.2, 0.3, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25], [0.1, 0.1, 0.1, 0.7]])
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.1, 0.9, 0.0]])
    draft = torch.tensor([1, 2])
    for seed in range(20):
        single = accept(draft, q, p, torch.Generator().manual_seed(seed))
        accepted, token = accept_batch(draft[None], q[None], p[None], torch.Generator().manual_seed(seed))
        assert single == (int(accepted), int(token))


# --- rejection sampling is lossless ------------------------------------------------------------

P_GENERAL = [0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02]
CASES = {
    "general": (P_GENERAL, [0.05, 0.10, 0.40, 0.05, 0.20, 0.10, 0.05, 0.05]),
    "q_zero_where_p_positive": (P_GENERAL, [0.0, 0.0, 0.5, 0.0, 0.5, 0.0, 0.0, 0.0]),
    "q_equals_p": (P_GENERAL, P_GENERAL),
    "q_one_hot": (P_GENERAL, [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
    "p_zero_where_q_positive": ([0.5, 0.3, 0.2, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]),
}


@pytest.mark.parametrize(
    "name, greedy_draft", [(name, False) for name in CASES] + [("q_one_hot", True)]  # greedy: q one-hot
)
def test_first_emitted_token_follows_target(name, greedy_draft):
    """d ~ q, then one verification round (k = 1): the first emitted token (d if accepted, else the
    residual sample) must be distributed exactly as p, and the acceptance rate must be
    sum(min(p, q)) (checked at 5 standard errors)."""
    p, q = torch.tensor(CASES[name][0]), torch.tensor(CASES[name][1])
    vocab = p.numel()
    generator = torch.Generator().manual_seed(10)
    draft = sample(q.expand(N, vocab), generator)[:, None]  # [N, 1]
    draft_probs = None if greedy_draft else q.expand(N, 1, vocab)
    bonus_row = torch.full((vocab,), 1.0 / vocab)  # any distribution: only emitted after acceptance
    target = torch.stack([p, bonus_row]).expand(N, 2, vocab)
    accepted, next_token = accept_batch(draft, draft_probs, target, generator)

    first = torch.where(accepted == 1, draft[:, 0], next_token)
    assert_distribution(histogram(first, vocab), p)
    accept_rate, expected_rate = float(accepted.double().mean()), float(torch.minimum(p, q).sum())
    assert abs(accept_rate - expected_rate) <= 5 * math.sqrt(expected_rate * (1 - expected_rate) / N) + 1e-12


# A first-order target chain P and a different draft chain Q over V = 4 tokens; the anchor is token 0.
P_CHAIN = torch.tensor(
    [[0.1, 0.4, 0.3, 0.2], [0.5, 0.1, 0.1, 0.3], [0.25, 0.25, 0.0, 0.5], [0.2, 0.2, 0.2, 0.4]]
)
Q_CHAIN = torch.tensor(
    [[0.4, 0.1, 0.1, 0.4], [0.1, 0.6, 0.3, 0.0], [0.3, 0.3, 0.3, 0.1], [0.7, 0.1, 0.1, 0.1]]
)


@pytest.mark.parametrize("greedy_draft", [False, True])
def test_multi_token_joint_follows_target(greedy_draft):
    """Rounds of k = 2 drafts (d1 ~ Q[last], d2 ~ Q[d1], or their argmaxes) verified against
    [P[last], P[d1], P[d2]], repeated until each sequence has 3 tokens: the joint law of the first
    3 tokens (64 cells) must equal P[0, x1] * P[x1, x2] * P[x2, x3]."""
    generator = torch.Generator().manual_seed(11)
    rows = torch.arange(N)
    sequences = torch.full((N, 3), -1)
    length = torch.zeros(N, dtype=torch.long)
    last = torch.zeros(N, dtype=torch.long)
    while bool((length < 3).any()):
        if greedy_draft:
            d1 = Q_CHAIN[last].argmax(-1)
            d2 = Q_CHAIN[d1].argmax(-1)
            draft_probs = None
        else:
            d1 = sample(Q_CHAIN[last], generator)
            d2 = sample(Q_CHAIN[d1], generator)
            draft_probs = torch.stack([Q_CHAIN[last], Q_CHAIN[d1]], 1)  # [N, 2, V]
        draft = torch.stack([d1, d2], 1)  # [N, 2]
        target = torch.stack([P_CHAIN[last], P_CHAIN[d1], P_CHAIN[d2]], 1)  # [N, 3, V]
        accepted, next_token = accept_batch(draft, draft_probs, target, generator)

        emitted = torch.cat([draft, next_token[:, None]], 1)  # [N, 3]
        emitted[rows, accepted] = next_token
        for i in range(3):
            position = length + i
            write = (i <= accepted) & (position < 3)
            sequences[write, position[write]] = emitted[write, i]
        length += accepted + 1
        last = next_token

    x1, x2, x3 = sequences.unbind(1)
    counts = torch.bincount(x1 * 16 + x2 * 4 + x3, minlength=64).view(4, 4, 4)
    joint = P_CHAIN[0][:, None, None] * P_CHAIN[:, :, None] * P_CHAIN[None, :, :]
    assert_distribution(counts, joint)


def test_a_small_residual_is_still_sampled_within_its_support():
    """p and q differ by 0.004 on token 3 only: a rejection (about 0.4% of 4000 seeded rows) must correct with
    token 3, the only token where p > q. Sampling from p instead is for residual masses that are rounding noise
    (RESIDUAL_MASS_EPS 1e-8); at 1e-2 most corrections land outside the support."""
    batch = 4000
    p = torch.tensor([0.5, 0.3, 0.196, 0.004])
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    generator = torch.Generator().manual_seed(0)
    draft = torch.multinomial(q.expand(batch, -1), 1, generator=generator)  # [B, 1] drawn from q
    accepted, next_token = accept_batch(draft, q.expand(batch, 1, -1), p.expand(batch, 2, -1), generator)
    rejected = accepted == 0
    assert int(rejected.sum()) >= 8  # the test sees enough corrections to tell (14 with this seed)
    assert set(next_token[rejected].tolist()) == {3}
