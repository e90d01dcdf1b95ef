"""Metrics (runtime/measure/metrics.py): every figure checked against a hand computation."""

import itertools
import json
import random

import pytest

from dspark_cli.runtime.measure.metrics import auroc, brier_score, calibration, expected_calibration_error, summarize
from dspark_cli.runtime.rounds import GenerationStats, RoundRecord

approx = pytest.approx

# Block size 3. Prompt A: three rounds; prompt B: a round cut by confidence to 1 proposed token,
# then a round whose second draft token is an accepted stop token (proposed 2, emitted = accepted).
R1 = RoundRecord(proposed=3, accepted=3, emitted=4, confidences=[0.9, 0.8, 0.5])
R2 = RoundRecord(proposed=3, accepted=1, emitted=2, confidences=[0.6, 0.5, 0.4])
R3 = RoundRecord(proposed=3, accepted=0, emitted=1, confidences=[0.9, 0.9, 0.9])
R5 = RoundRecord(proposed=1, accepted=1, emitted=2, drafted=3, confidences=[0.8, 0.1, 0.5])
R4 = RoundRecord(proposed=2, accepted=2, emitted=2, drafted=3, confidences=[0.9, 0.7, 0.2])
SPEC = [
    GenerationStats(prompt_tokens=10, new_tokens=8, ttft_s=0.1, total_s=0.8, rounds=[R1, R2, R3]),
    GenerationStats(prompt_tokens=6, new_tokens=5, ttft_s=0.2, total_s=0.5, rounds=[R5, R4]),
]
BASELINE = [
    GenerationStats(prompt_tokens=10, new_tokens=8, ttft_s=0.1, total_s=1.5),
    GenerationStats(prompt_tokens=6, new_tokens=5, ttft_s=0.2, total_s=1.1),
]


def brute_force_auroc(scores, outcomes):
    positives = [s for s, y in zip(scores, outcomes) if y]
    negatives = [s for s, y in zip(scores, outcomes) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(positives, negatives))
    return wins / (len(positives) * len(negatives))


# --- acceptance --------------------------------------------------------------------------------


def test_tau_and_token_counts():
    summary = summarize(SPEC, None, block_size=3)
    assert (summary.prompts, summary.rounds, summary.new_tokens, summary.block_size) == (2, 5, 13, 3)
    assert summary.tau == approx(11 / 5)  # emitted 4 + 2 + 1 + 2 + 2 (stop round: no +1)
    assert summary.target_forwards_per_token == approx(5 / 11)
    assert summary.mean_proposed == approx(12 / 5)  # 3 + 3 + 3 + 1 + 2
    assert summary.draft_acceptance_rate == approx(7 / 12)  # accepted 3 + 1 + 0 + 1 + 2


def test_tau_pools_rounds_not_prompt_means():
    one = GenerationStats(1, 5, 0.1, 0.2, [RoundRecord(3, 3, 4)])
    three = GenerationStats(1, 4, 0.1, 0.2, [RoundRecord(3, 0, 1)] * 3)
    assert summarize([one, three], None, 3).tau == approx(7 / 4)  # not (4 + 1) / 2


def test_accepted_length_histogram():
    assert summarize(SPEC, None, 3).accepted_histogram == [1, 2, 1, 1]  # accepted 3, 1, 0, 1, 2


def test_per_position_acceptance_all_three_forms():
    summary = summarize(SPEC, None, 3)
    # rounds with accepted > j: j=0: 4, j=1: 2 (R1, R4), j=2: 1 (R1)
    assert summary.acceptance_unconditional == approx([4 / 5, 2 / 5, 1 / 5])
    # DeepSpec: denominators are rounds with proposed > j: 5, 4 (not R5), 3 (not R5, R4)
    assert summary.accept_rate == approx([4 / 5, 2 / 4, 1 / 3])
    # conditional: denominators are rounds with accepted >= j and proposed > j: 5, 3 (R1, R2, R4), 1 (R1)
    assert summary.acceptance_conditional == approx([4 / 5, 2 / 3, 1 / 1])


def test_empty_proposal_round_counts_in_tau_only():
    cut = RoundRecord(proposed=0, accepted=0, emitted=1, drafted=2, confidences=[0.1, 0.9])
    full = RoundRecord(proposed=2, accepted=1, emitted=2, confidences=[0.8, 0.4])
    summary = summarize([GenerationStats(3, 4, 0.1, 0.3, [cut, full])], None, 2)
    assert summary.tau == approx(3 / 2)
    assert summary.acceptance_unconditional == approx([1 / 2, 0.0])
    assert summary.accept_rate == approx([1.0, 0.0])
    assert summary.acceptance_conditional == approx([1.0, 0.0])
    assert summary.calibration.survival.count == 2  # only the verified positions of `full`


def test_round_beyond_block_size_is_rejected():
    with pytest.raises(ValueError, match="block_size"):
        summarize(SPEC, None, block_size=2)


# --- calibration primitives --------------------------------------------------------------------


def test_ece_hand_example():
    # bins of width 0.05: {0.1, 0.12} -> bin 2: |0.11 - 1/2| * 2 = 0.78; {0.6} -> |0.6 - 1| = 0.4;
    # {0.97, 1.0} -> bin 19 (1.0 joins the last bin): |0.985 - 1| * 2 = 0.03. ECE = 1.21 / 5.
    predicted = [0.1, 0.12, 0.6, 0.97, 1.0]
    outcomes = [False, True, True, True, True]
    assert expected_calibration_error(predicted, outcomes) == approx(1.21 / 5)


def test_perfectly_calibrated_bins_have_zero_ece():
    assert expected_calibration_error([0.5, 0.5, 0.0, 1.0], [True, False, False, True]) == approx(0.0)


def test_brier_hand_example():
    assert brier_score([0.2, 0.9], [False, True]) == approx((0.04 + 0.01) / 2)


def test_auroc_hand_examples():
    assert auroc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == approx(0.75)
    assert auroc([0.5, 0.5], [True, False]) == approx(0.5)  # a tie counts 1/2
    assert auroc([0.9, 0.1], [False, True]) == approx(0.0)


def test_auroc_matches_brute_force_pairwise_count_with_ties():
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(2, 40)
        scores = [round(rng.random(), 1) for _ in range(n)]  # one decimal: many ties
        outcomes = [rng.random() < 0.5 for _ in range(n)]
        if len(set(outcomes)) < 2:
            continue
        assert auroc(scores, outcomes) == approx(brute_force_auroc(scores, outcomes))


def test_calibration_of_empty_and_one_class_sets():
    empty = calibration([], [])
    assert (empty.count, empty.positives) == (0, 0)
    assert empty.ece is None and empty.auroc is None and empty.brier is None and empty.mean_predicted is None
    one_class = calibration([0.2, 0.7], [True, True])
    assert one_class.auroc is None
    assert one_class.brier == approx((0.64 + 0.09) / 2)


# --- calibration inside summarize --------------------------------------------------------------


def test_survival_calibration_per_position():
    """Survival Π_{i<=j} c_i against "0..j accepted", for j < proposed."""
    positions = summarize(SPEC, None, 3).calibration.survival_per_position
    # j=0: (0.9,T) R1 (0.6,T) R2 (0.9,F) R3 (0.8,T) R5 (0.9,T) R4
    j0 = positions[0]
    assert (j0.count, j0.positives) == (5, 4)
    assert j0.mean_predicted == approx(4.1 / 5) and j0.observed_rate == approx(0.8)
    assert j0.brier == approx((0.01 + 0.16 + 0.81 + 0.04 + 0.01) / 5)
    assert j0.auroc == approx(0.25)  # positives 0.9, 0.6, 0.8, 0.9 vs negative 0.9: two ties
    assert j0.ece == approx((abs(0.9 - 2 / 3) * 3 + 0.4 + 0.2) / 5)  # bins {0.9 x3}, {0.6}, {0.8}
    # j=1: (0.72,T) R1 (0.3,F) R2 (0.81,F) R3 (0.63,T) R4; R5 proposed only 1
    j1 = positions[1]
    assert (j1.count, j1.positives) == (4, 2)
    assert j1.brier == approx((0.28**2 + 0.3**2 + 0.81**2 + 0.37**2) / 4)
    assert j1.auroc == approx(0.5)
    assert j1.ece == approx((0.28 + 0.3 + 0.81 + 0.37) / 4)  # four separate bins
    # j=2: (0.36,T) R1 (0.12,F) R2 (0.729,F) R3
    j2 = positions[2]
    assert (j2.count, j2.positives) == (3, 1)
    assert j2.brier == approx((0.64**2 + 0.12**2 + 0.729**2) / 3)
    assert j2.auroc == approx(0.5)


def test_survival_calibration_pooled_over_positions():
    pooled = summarize(SPEC, None, 3).calibration.survival
    scores = [0.9, 0.6, 0.9, 0.8, 0.9, 0.72, 0.3, 0.81, 0.63, 0.36, 0.12, 0.729]
    outcomes = [True, True, False, True, True, True, False, False, True, True, False, False]
    assert (pooled.count, pooled.positives) == (12, 7)
    assert pooled.auroc == approx(brute_force_auroc(scores, outcomes))
    assert pooled.brier == approx(sum((s - y) ** 2 for s, y in zip(scores, outcomes)) / 12)


def test_per_slot_calibration_is_conditional_on_the_prefix():
    """Per-slot c_j against "j accepted", only in rounds where 0..j-1 were accepted."""
    report = summarize(SPEC, None, 3).calibration
    j0, j1, j2 = report.per_slot_per_position
    assert (j0.count, j0.positives, j0.auroc) == (5, 4, approx(0.25))  # same pairs as survival j=0
    # j=1: (0.8,T) R1 (0.5,F) R2 (0.7,T) R4; R3 rejected position 0, R5 proposed 1
    assert (j1.count, j1.positives, j1.auroc) == (3, 2, approx(1.0))
    assert j1.brier == approx((0.04 + 0.25 + 0.09) / 3)
    # j=2: (0.5,T) R1 only: a single class has no AUROC
    assert (j2.count, j2.positives, j2.auroc) == (1, 1, None)
    assert j2.ece == approx(0.5) and j2.brier == approx(0.25)
    assert (report.per_slot.count, report.per_slot.positives) == (9, 7)


def test_no_confidences_gives_no_calibration():
    stats = [GenerationStats(4, 3, 0.1, 0.2, [RoundRecord(3, 1, 2)])]
    assert summarize(stats, None, 3).calibration is None


def test_rounds_without_confidences_are_left_out_of_calibration():
    stats = [GenerationStats(4, 5, 0.1, 0.2, [RoundRecord(2, 1, 2), RoundRecord(2, 2, 3, confidences=[0.9, 0.8])])]
    report = summarize(stats, None, 2).calibration
    assert report.survival.count == 2
    assert report.survival.auroc is None  # both verified positions accepted: one class


# --- wall clock and baseline -------------------------------------------------------------------


def test_wall_clock_and_speedup():
    summary = summarize(SPEC, BASELINE, 3)
    assert summary.ttft_ms == approx(150.0)  # mean of 100 ms and 200 ms
    assert summary.tpot_ms == approx(1000.0 * (0.7 + 0.3) / (7 + 4))  # after the first token, pooled
    assert summary.tokens_per_s == approx(13 / 1.3)
    assert summary.baseline.tokens_per_s == approx(13 / 2.6)
    assert summary.baseline.tpot_ms == approx(1000.0 * (1.4 + 0.9) / 11)
    assert summary.baseline.ttft_ms == approx(150.0)
    assert summary.baseline.speedup == approx(2.0)


def test_baseline_must_run_the_same_prompts():
    with pytest.raises(ValueError, match="same prompts"):
        summarize(SPEC, BASELINE[:1], 3)
    with pytest.raises(ValueError, match="same prompts"):
        summarize(SPEC, BASELINE[::-1], 3)


def test_baseline_without_time_gives_no_speedup():
    zero = [GenerationStats(s.prompt_tokens, s.new_tokens, 0.0, 0.0) for s in BASELINE]
    assert summarize(SPEC, zero, 3).baseline.speedup is None


def test_round_breakdown():
    rounds = [RoundRecord(2, 1, 2), RoundRecord(2, 2, 3)]
    sections = [  # ms per loop step; verify = score + accept, rollback = snapshot + rollback, other = commit + advance
        {"draft": 2.0, "markov": 1.0, "snapshot": 0.5, "score": 5.0, "accept": 1.0, "commit": 1.0},
        {"draft": 4.0, "markov": 3.0, "snapshot": 0.5, "score": 9.0, "accept": 1.0, "commit": 1.0, "rollback": 3.0,
         "advance": 2.0},
    ]
    breakdown = summarize([GenerationStats(5, 6, 0.1, 0.2, rounds, sections)], None, 2).round_breakdown
    assert breakdown.draft_backbone_ms == approx(3.0)
    assert breakdown.markov_ms == approx(2.0)
    assert breakdown.verify_ms == approx(8.0)
    assert breakdown.rollback_ms == approx(2.0)
    assert breakdown.other_ms == approx(2.0)
    assert breakdown.total_ms == approx(17.0)
    assert breakdown.draft_backbone_share == approx(3 / 17)
    assert breakdown.verify_share == approx(8 / 17)
    assert breakdown.rollback_share == approx(2 / 17)


# --- edge cases --------------------------------------------------------------------------------


def test_empty_run_has_no_figures_and_serialises():
    summary = summarize([], [], block_size=4)
    assert summary.tau is None and summary.tokens_per_s is None and summary.ttft_ms is None
    assert summary.accepted_histogram == [0] * 5
    assert summary.acceptance_unconditional == [None] * 4 and summary.acceptance_conditional == [None] * 4
    assert summary.calibration is None and summary.round_breakdown is None
    assert summary.baseline.speedup is None
    json.dumps(summary.to_dict(), allow_nan=False)


def test_prompt_ending_at_its_first_token():
    stats = [GenerationStats(prompt_tokens=5, new_tokens=1, ttft_s=0.05, total_s=0.05)]
    summary = summarize(stats, None, 3)
    assert summary.rounds == 0 and summary.tau is None and summary.tpot_ms is None
    assert summary.tokens_per_s == approx(20.0)


def test_summary_is_json_serialisable():
    text = json.dumps(summarize(SPEC, BASELINE, 3).to_dict(), allow_nan=False)
    decoded = json.loads(text)
    assert decoded["tau"] == approx(2.2)
    assert decoded["calibration"]["per_slot_per_position"][2]["auroc"] is None
    assert decoded["baseline"]["speedup"] == approx(2.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"proposed": 2, "accepted": 3, "emitted": 4},  # accepted > proposed
        {"proposed": 3, "accepted": 1, "emitted": 3},  # emitted > accepted + 1
        {"proposed": 3, "accepted": 0, "emitted": 0},  # a round always commits a token
        {"proposed": 3, "accepted": 1, "emitted": 2, "drafted": 2},  # drafted < proposed
        {"proposed": 2, "accepted": 1, "emitted": 2, "confidences": [0.5]},  # one per drafted position
        {"proposed": 2, "accepted": 1, "emitted": 2, "confidences": [0.5, 1.2]},  # not a probability
    ],
)
def test_round_record_rejects_inconsistent_values(kwargs):
    with pytest.raises(ValueError):
        RoundRecord(**kwargs)


def test_round_record_drafted_defaults_to_proposed():
    assert RoundRecord(proposed=3, accepted=1, emitted=2).drafted == 3


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_confidences_that_are_not_probabilities_make_calibration_unavailable_not_a_crash(bad):
    """A draft with NaN weights gives NaN confidences (assigned after the round is built, so RoundRecord's own
    check never sees them): every other figure is still reported, calibration says why it is missing."""
    broken = RoundRecord(proposed=3, accepted=1, emitted=2)
    broken.confidences = [0.5, bad, 0.5]
    stats = [GenerationStats(prompt_tokens=4, new_tokens=6, ttft_s=0.1, total_s=0.5, rounds=[R1, broken])]
    summary = summarize(stats, None, 3)
    assert summary.calibration is None and summary.tau == approx(3.0)
    assert "not probabilities" in summary.calibration_unavailable and "1 of 2 rounds" in summary.calibration_unavailable
    json.dumps(summary.to_dict(), allow_nan=False)  # the --json document stays valid JSON


def test_calibration_is_available_for_valid_confidences():
    summary = summarize(SPEC, None, 3)
    assert summary.calibration is not None and summary.calibration_unavailable is None
