"""Does speculation pay here (runtime/measure/verdict.py): hand-built rounds and engine profiles whose predicted
speedups are computed by hand. Each of the model's commitments has a test that fails when it is broken: the draft
is paid per sequence (so it grows with concurrency), dspark's own draft time never enters an engine's figures,
acceptance is taken near each context, the draft length is chosen by tokens/s (not by acceptance), and the verdict
follows the interval."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from pytest import approx
from verdict_inputs import accepting, eval_run, profile_doc

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.measure.engine_profile import read_engine_profile
from dspark_cli.runtime.measure.replay import VERDICT_PLAN_FORMAT, rounds_of_result
from dspark_cli.runtime.measure.verdict import (
    LOSES,
    NO_DATA,
    PAYS,
    UNDECIDED,
    Candidate,
    context_buckets,
    decide,
    positioned_rounds,
    rounds_in_bucket,
)


def profile(theta, plain, delta, **shape):
    return read_engine_profile(Path("costs.json"), profile_doc(theta, plain, delta, **shape))


# θ(M) = 10 + M, D(R) = 20 + 2R, Δ = 5 ms per sequence (so 5R per step). By hand, at block 4:
#   V(R, t) = θ(R·t) + D(R) - θ(R) = 20 + R + R·t;  step(R, n) = V(R, n + 1) + 5R
#   R = 1: step = 27 + n, D = 22;   R = 4: step = 48 + 4n, D = 28
PER_SEQUENCE = dict(theta=lambda m, i: 10.0 + m, plain=lambda r, c, i: 20.0 + 2 * r, delta=lambda n, r, c, i: 5.0 * r)


def everything_accepted(block=4, rounds=25, prompts=2, **round_options):
    """Identical prompts of rounds accepting every drafted token: τ(n) = n + 1 exactly, its interval a point."""
    return eval_run([[accepting(block, block, **round_options)] * rounds] * prompts, block=block)


def by_n(verdict) -> dict:
    return {p.candidate.n: p for p in verdict.predictions if p.candidate.threshold is None}


# --- (a) the draft is charged once per sequence --------------------------------------------------------------------


def test_the_draft_is_paid_per_sequence_so_its_share_grows_with_concurrency():
    costs = profile(**PER_SEQUENCE, block=4, concurrencies=[1, 4], contexts=[16], draft_ns=[1, 4])
    plan = decide([everything_accepted()], costs, [1, 4], [16])
    one, four = plan.verdicts
    assert (one.concurrency, four.concurrency) == (1, 4)
    assert one.draft_ms_per_step == approx({1: 5.0, 4: 5.0}) and four.draft_ms_per_step == approx({1: 20.0, 4: 20.0})
    assert one.plain_step_ms == 22.0 and four.plain_step_ms == 28.0
    assert one.plain_tokens_per_s == approx(1000 / 22) and four.plain_tokens_per_s == approx(4000 / 28)

    assert [by_n(one)[n].tau for n in (1, 2, 3, 4)] == approx([2, 3, 4, 5])
    assert [by_n(one)[n].verified_per_round for n in (1, 2, 3, 4)] == approx([2, 3, 4, 5])
    assert [by_n(one)[n].step_ms for n in (1, 2, 3, 4)] == approx([28, 29, 30, 31])
    assert [by_n(one)[n].speedup for n in (1, 2, 3, 4)] == approx([44 / 28, 66 / 29, 88 / 30, 110 / 31])
    assert [by_n(four)[n].step_ms for n in (1, 2, 3, 4)] == approx([52, 56, 60, 64])
    assert [by_n(four)[n].speedup for n in (1, 2, 3, 4)] == approx([56 / 52, 84 / 56, 112 / 60, 140 / 64])

    assert (one.verdict, one.n, one.threshold) == (PAYS, 4, None)
    assert one.best.speedup == approx(110 / 31) and one.best.tokens_per_s == approx(5000 / 31)
    assert (four.verdict, four.n) == (PAYS, 4)
    assert four.best.speedup == approx(2.1875) and four.best.tokens_per_s == approx(312.5)
    assert four.best.speedup < one.best.speedup  # the same draft pays less where four sequences each draft


# --- (b) nothing of dspark's own timing enters ---------------------------------------------------------------------


def test_the_runs_own_draft_times_change_no_prediction():
    costs = profile(**PER_SEQUENCE, block=4, concurrencies=[1, 4], contexts=[16], draft_ns=[1, 4])
    quick, slow = everything_accepted(overhead_s=0.0), everything_accepted(overhead_s=0.5)
    assert rounds_of_result(slow.results[0])[0].overhead_s == approx(0.5)  # the slow run does record 0.5 s a round
    fast_plan, slow_plan = decide([quick], costs, [1, 4], [16]), decide([slow], costs, [1, 4], [16])
    assert [v.to_dict() for v in fast_plan.verdicts] == [v.to_dict() for v in slow_plan.verdicts]
    assert [by_n(slow_plan.verdicts[1])[n].step_ms for n in (1, 4)] == approx([52, 64])  # the engine's figures


# --- (c) acceptance near each context ------------------------------------------------------------------------------

# A prompt of 10 tokens whose first 17 rounds accept all 4 drafted tokens (contexts 10, 15, ..., 90) and whose next
# 30 accept none (contexts 95 .. 124). The edge between contexts 16 and 512 is sqrt(16 · 512) = 90.5.
EARLY_THEN_LATE = [accepting(4, 4)] * 17 + [accepting(0, 4)] * 30


def test_context_buckets_meet_at_the_geometric_midpoints():
    assert context_buckets([16, 512]) == [(0.0, math.sqrt(16 * 512)), (math.sqrt(16 * 512), math.inf)]
    assert context_buckets([512, 16, 64]) == [(math.sqrt(64 * 512), math.inf), (0.0, 32.0),
                                              (32.0, math.sqrt(64 * 512))]  # in the order asked
    assert context_buckets([100]) == [(0.0, math.inf)]


def test_rounds_are_bucketed_by_their_context():
    results = positioned_rounds(eval_run([EARLY_THEN_LATE] * 2, block=4).results)
    small, large = context_buckets([16, 512])
    assert [[r.accepted for r in p] for p in rounds_in_bucket(results, small)] == [[4] * 17] * 2
    assert [[r.accepted for r in p] for p in rounds_in_bucket(results, large)] == [[0] * 30] * 2
    assert rounds_in_bucket(results, (125.0, math.inf)) == []  # no round starts there


def test_each_context_is_judged_on_its_own_rounds():
    costs = profile(**PER_SEQUENCE, block=4, concurrencies=[1], contexts=[16, 512], draft_ns=[1, 4])
    small, large = decide([eval_run([EARLY_THEN_LATE] * 2, block=4)], costs, [1], [16, 512]).verdicts
    assert (small.context, small.rounds, small.prompts) == (16, 34, 2)
    assert (large.context, large.rounds, large.prompts) == (512, 60, 2)
    assert [by_n(small)[n].tau for n in (1, 2, 3, 4)] == approx([2, 3, 4, 5])
    assert [by_n(large)[n].tau for n in (1, 2, 3, 4)] == approx([1, 1, 1, 1])
    assert (small.verdict, small.n) == (PAYS, 4) and small.best.speedup == approx(110 / 31)
    assert (large.verdict, large.n) == (LOSES, 0)
    assert large.best.candidate.n == 1 and large.best.speedup == approx(22 / 28)


# --- (d) the draft length that gives the most tokens/s, not the most acceptance ------------------------------------


def test_the_draft_length_is_chosen_by_tokens_per_second():
    """Δ grows steeply with n (1 ms at n = 1, 100 ms at n = 4): τ is highest at n = 4, tokens/s at n = 1."""
    costs = profile(theta=lambda m, i: 10.0 + m, plain=lambda r, c, i: 22.0,
                    delta=lambda n, r, c, i: 1.0 + 33.0 * (n - 1), block=4, concurrencies=[1], contexts=[16],
                    draft_ns=[1, 4])
    (verdict,) = decide([everything_accepted()], costs, [1], [16]).verdicts
    predictions = by_n(verdict)
    # step(n) = 21 + (n + 1) + Δ(n), Δ(2), Δ(3) interpolated between the measured n = 1 and n = 4
    assert [predictions[n].step_ms for n in (1, 2, 3, 4)] == approx([24, 58, 92, 126])
    assert max(predictions.values(), key=lambda p: p.tau).candidate.n == 4
    assert (verdict.verdict, verdict.n) == (PAYS, 1)
    assert verdict.best.speedup == approx(2 * 22 / 24) and verdict.best.tau == approx(2)
    assert predictions[4].speedup == approx(5 * 22 / 126)


# --- the verdict follows the interval ------------------------------------------------------------------------------


def test_pays_when_the_interval_lies_above_one():
    costs = profile(**PER_SEQUENCE, block=4, concurrencies=[1], contexts=[16], draft_ns=[1, 4])
    plan = decide([everything_accepted()], costs, [1], [16])
    (verdict,) = plan.verdicts
    assert verdict.verdict == PAYS and verdict.best.speedup_low > 1
    assert verdict.reason == "n = 4 is predicted 3.55x plain decoding, interval 3.55-3.55, above 1"
    assert plan.speculative_config() == {"num_speculative_tokens": 4}
    document = plan.to_dict()
    assert document["format"] == VERDICT_PLAN_FORMAT and document["engine"] == "llamacpp"
    assert document["verdicts"][0]["n"] == 4


def test_does_not_pay_when_the_fastest_candidates_interval_lies_below_one():
    costs = profile(**PER_SEQUENCE, block=4, concurrencies=[1], contexts=[16], draft_ns=[1, 4])
    nothing = eval_run([[accepting(0, 4)] * 25, [accepting(1, 4)] + [accepting(0, 4)] * 24], block=4)
    plan = decide([nothing], costs, [1], [16])
    (verdict,) = plan.verdicts
    assert all(p.speedup_high < 1 for p in verdict.predictions)
    assert (verdict.verdict, verdict.n, verdict.threshold) == (LOSES, 0, None)
    assert verdict.best.candidate.n == 1 and verdict.best.tau == approx(51 / 50)
    assert verdict.reason.startswith("the fastest draft length, n = 1, is predicted 0.80x plain decoding")
    assert verdict.reason.endswith("below 1")
    assert plan.speculative_config() == {"num_speculative_tokens": 0}


def test_a_slower_candidates_wide_interval_does_not_make_it_undecided():
    """Position 1 is always accepted, 2..4 only in the first prompt: τ(1) = 2 exactly, τ(4) = 3.5 in [2, 5]. The
    draft costs 27 ms at n = 1 and 64 at n = 4 (step 50 and 90 ms against a plain step of 22): n = 1 is the fastest,
    0.88x, its interval a point below 1; n = 4 is slower (0.86x) though its interval reaches 1.22."""
    costs = profile(theta=lambda m, i: 10.0 + m, plain=lambda r, c, i: 22.0,
                    delta=lambda n, r, c, i: 27.0 if n == 1 else 64.0, block=4, concurrencies=[1], contexts=[16],
                    draft_ns=[1, 4])
    runs = eval_run([[accepting(4, 4)] * 25, [accepting(1, 4)] * 25], block=4)
    (verdict,) = decide([runs], costs, [1], [16]).verdicts
    fixed = by_n(verdict)
    assert [fixed[n].step_ms for n in (1, 4)] == approx([50.0, 90.0])
    assert (fixed[1].speedup, fixed[1].speedup_low, fixed[1].speedup_high) == approx((0.88, 0.88, 0.88))
    assert (fixed[4].speedup, fixed[4].speedup_low, fixed[4].speedup_high) == approx((3.5 * 22 / 90, 2 * 22 / 90,
                                                                                      5 * 22 / 90))
    assert verdict.best.candidate.n == 1
    assert (verdict.verdict, verdict.n) == (LOSES, 0)


# Two prompts, one accepting everything and one nothing: τ(n) = (n + 2) / 2 with a bootstrap interval from 1 (both
# resampled prompts the rejecting one) to n + 1.
SPLIT = [[accepting(4, 4)] * 25, [accepting(0, 4)] * 25]


def test_undecided_when_the_interval_contains_one_with_the_point_estimate_above():
    costs = profile(**PER_SEQUENCE, block=4, concurrencies=[1], contexts=[16], draft_ns=[1, 4])
    (verdict,) = decide([eval_run(SPLIT, block=4)], costs, [1], [16]).verdicts
    best = verdict.best
    assert best.candidate.n == 4 and best.tau == approx(3.0) and (best.tau_low, best.tau_high) == approx((1.0, 5.0))
    assert (best.speedup, best.speedup_low, best.speedup_high) == approx((66 / 31, 22 / 31, 110 / 31))
    assert (verdict.verdict, verdict.n) == (UNDECIDED, 4)  # the point estimate's choice
    assert "contains 1: measure more repeats or more prompts" in verdict.reason


def test_undecided_below_one_serves_without_the_draft():
    slow_draft = dict(PER_SEQUENCE, delta=lambda n, r, c, i: 60.0)  # step = 82 + n at R = 1
    costs = profile(**slow_draft, block=4, concurrencies=[1], contexts=[16], draft_ns=[1, 4])
    plan = decide([eval_run(SPLIT, block=4)], costs, [1], [16])
    (verdict,) = plan.verdicts
    best = verdict.best
    assert best.candidate.n == 4 and (best.speedup, best.speedup_low, best.speedup_high) == approx(
        (66 / 86, 22 / 86, 110 / 86))
    assert (verdict.verdict, verdict.n) == (UNDECIDED, 0)
    assert plan.speculative_config() == {"num_speculative_tokens": 0}


def test_the_profile_spread_widens_the_interval_around_the_point():
    """Three repeats whose plain step is 22, 24.2 and 26.4 ms (the step itself unchanged): D / step spreads, the
    point is the median repeat, the interval its 25th to 75th percentile."""
    def plain(r, c, i):
        return 22.0 * (1 + 0.1 * i)

    def delta(n, r, c, i):  # keeps step = 27 + n in every repeat: S - V(n + 1) with V = θ(n + 1) + D - θ(1)
        return 5.0 - (plain(r, c, i) - 22.0)

    costs = profile(theta=lambda m, i: 10.0 + m, plain=plain, delta=delta, block=4, concurrencies=[1],
                    contexts=[16], draft_ns=[1, 4], repeats=3)
    (verdict,) = decide([everything_accepted()], costs, [1], [16]).verdicts
    best = verdict.best
    assert best.candidate.n == 4 and best.step_ms == approx(31.0)
    assert (best.speedup, best.speedup_low, best.speedup_high) == approx((5 * 24.2 / 31, 5 * 23.1 / 31,
                                                                         5 * 25.3 / 31))


def test_every_interval_contains_its_point():
    costs = profile(theta=lambda m, i: 10.0 + m * (1 + 0.05 * i), plain=lambda r, c, i: (20.0 + 2 * r) * (1 + 0.1 * i),
                    delta=lambda n, r, c, i: (2.0 + n) * r * (1.2 - 0.1 * i), block=4, concurrencies=[1, 2],
                    contexts=[16], draft_ns=[1, 2, 4], repeats=4)
    prompts = [[accepting(i % 5, 4, confidences=[0.9, 0.7, 0.4 + 0.1 * (i % 3), 0.2])] * 8
               + [accepting((i + 2) % 5, 4, confidences=[0.6, 0.5, 0.5, 0.5])] * 8 for i in range(4)]
    plan = decide([eval_run(prompts, block=4, prompt_tokens=8)], costs, [1, 2], [16], thresholds=True)
    checked = 0
    for verdict in plan.verdicts:
        for p in verdict.predictions:
            assert p.tau_low <= p.tau <= p.tau_high
            assert p.speedup_low <= p.speedup <= p.speedup_high
            checked += 1
    assert checked == 2 * (4 + 4 * 9)  # 2 verdicts, each n alone and with the 9 thresholds


def test_a_context_without_enough_rounds_says_no_data():
    costs = profile(**PER_SEQUENCE, block=4, concurrencies=[1], contexts=[16, 4096], draft_ns=[1, 4])
    plan = decide([everything_accepted()], costs, [1], [16, 4096])
    near, far = plan.verdicts
    assert near.verdict == PAYS
    assert (far.verdict, far.n, far.best, far.predictions, far.rounds) == (NO_DATA, 0, None, [], 0)
    assert "the runs hold 0 rounds from 0 prompts at contexts 256 and above; at least 20 rounds" in far.reason
    one_prompt = decide([everything_accepted(rounds=40, prompts=1)], costs, [1], [16])
    assert (one_prompt.verdicts[0].verdict, one_prompt.verdicts[0].rounds) == (NO_DATA, 40)  # rounds from 1 prompt
    few = decide([everything_accepted(rounds=9)], costs, [1], [16])  # 18 rounds from 2 prompts
    assert few.verdicts[0].verdict == NO_DATA and few.speculative_config() is None
    two = decide([everything_accepted(rounds=10)], costs, [1], [16])  # 20 rounds: enough
    assert two.verdicts[0].verdict == PAYS
    assert decide([everything_accepted()], costs, [1], [16, 4096]).speculative_config() is None  # two loads


# --- the confidence threshold ----------------------------------------------------------------------------------------


def test_a_threshold_cuts_at_the_first_confidence_below_it():
    r = rounds_of_result(eval_run([[accepting(4, 4, confidences=[0.95, 0.45, 0.95, 0.95])]], 4).results[0])[0]
    assert [Candidate(4, x).verify_length(r) for x in (0.1, 0.4, 0.5, 0.9, 0.96)] == [4, 4, 1, 1, 0]
    assert Candidate(3, 0.1).verify_length(r) == 3 and Candidate(4).verify_length(r) == 4
    high = rounds_of_result(eval_run([[accepting(4, 4, confidences=[0.95] * 4)]], 4).results[0])[0]
    assert Candidate(4, 0.9).verify_length(high) == 4  # per slot (llama.cpp's p-min), not the survival product
    bare = rounds_of_result(eval_run([[accepting(4, 4)]], 4).results[0])[0]
    assert Candidate(2, 0.5).verify_length(bare) == 2  # no logits: the fixed length


def test_a_threshold_that_saves_verification_is_chosen():
    """Rounds A (all confident, all accepted) and B (confident first, then 0.45; one accepted). Verifying costs 10 ms a
    token (θ = 10 + 10M). Cutting B at 0.45 keeps τ and verifies fewer tokens: n = 4, p-min 0.5 wins."""
    costs = profile(theta=lambda m, i: 10.0 + 10.0 * m, plain=lambda r, c, i: 22.0, delta=lambda n, r, c, i: 5.0,
                    block=4, concurrencies=[1], contexts=[16], draft_ns=[1, 4])
    a, b = accepting(4, 4, confidences=[0.95] * 4), accepting(1, 4, confidences=[0.95, 0.45, 0.95, 0.95])
    plan = decide([eval_run([[a, b] * 13] * 2, block=4)], costs, [1], [16], thresholds=True)
    (verdict,) = plan.verdicts
    found = {(p.candidate.n, p.candidate.threshold): p for p in verdict.predictions}
    # V(1, t) = θ(t) + 22 - θ(1) = 12 + 10t; step = V + 5
    assert found[4, None].tau == approx(3.5) and found[4, None].step_ms == approx(67.0)
    assert found[4, 0.4].verified_per_round == approx(5.0) and found[4, 0.4].step_ms == approx(67.0)
    assert found[4, 0.5].verified_per_round == approx(3.5) and found[4, 0.5].tau == approx(3.5)
    assert found[4, 0.5].step_ms == approx(52.0)  # θ(3.5) interpolated: 45
    assert found[4, 0.9].step_ms == approx(52.0)
    assert found[4, 0.5].speedup == approx(3.5 * 22 / 52)
    assert (verdict.verdict, verdict.n, verdict.threshold) == (PAYS, 4, 0.5)
    assert plan.speculative_config() == {"num_speculative_tokens": 4, "dspark_confidence_threshold": 0.5}
    assert "p-min 0.5" in verdict.reason


def test_thresholds_are_planned_only_when_asked_and_with_logits():
    costs = profile(**PER_SEQUENCE, block=4, concurrencies=[1], contexts=[16], draft_ns=[1, 4])
    bare = decide([everything_accepted()], costs, [1], [16], thresholds=True)
    assert all(p.candidate.threshold is None for p in bare.verdicts[0].predictions)
    assert any("no raw confidence logits" in note for note in bare.notes)
    confident = everything_accepted(confidences=[0.9] * 4)
    assert len(decide([confident], costs, [1], [16]).verdicts[0].predictions) == 4  # fixed lengths by default
    assert len(decide([confident], costs, [1], [16], thresholds=True).verdicts[0].predictions) == 4 + 4 * 9


# --- what decide refuses and notes ---------------------------------------------------------------------------------


def test_decide_refuses_another_block_size_or_an_unmeasured_load():
    costs = profile(**PER_SEQUENCE, block=4, concurrencies=[1], contexts=[16], draft_ns=[1, 4])
    with pytest.raises(DsparkError, match="blocks of 5 tokens but the engine profile costs.json was measured with a "
                                          "draft of block size 4"):
        decide([everything_accepted(block=5)], costs, [1], [16])
    with pytest.raises(DsparkError, match="measured at concurrency 1, not 2"):
        decide([everything_accepted()], costs, [2], [16])
    with pytest.raises(DsparkError, match="measured at context 16 tokens, not 64"):
        decide([everything_accepted()], costs, [1], [64])


def test_notes_on_censored_runs_and_a_single_draft_length():
    one_length = profile(**PER_SEQUENCE, block=4, concurrencies=[1], contexts=[16], draft_ns=[4])
    cut = eval_run([[accepting(4, 4)] * 25] * 2, block=4, confidence_threshold=0.5)
    notes = decide([cut], one_length, [1], [16]).notes
    assert any("cut by a confidence threshold" in note for note in notes)
    assert any("measured one draft length (4)" in note for note in notes)
    (verdict,) = decide([cut], one_length, [1], [16]).verdicts
    assert by_n(verdict)[1].step_ms == approx(28.0)  # Δ(1) taken as the measured Δ(4) = 5
