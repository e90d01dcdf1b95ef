"""Known values of the pieces whose bugs leave every output plausible: sampling filters at their edges, both draft
query layouts, RMSNorm, the layout key vLLM reads, the training objective, the learning-rate floor, the training
windows, τ's bootstrap and the ECE bins.

Each expected value is computed here by hand (the formula written out in the test), not by the code under test.
Every test below was seen failing against a hand-made bug of the kind its docstring names.
"""

import math

import pytest
from dspark_cli.runtime.settings import trained_block_size
import torch
from ckpt_factory import DraftSpec, draft_config, tiny_target, write_draft

from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.measure.evaluation import PromptResult, bootstrap_ratio, set_statistics, stats_tau_interval
from dspark_cli.runtime.measure.metrics import expected_calibration_error
from dspark_cli.runtime.rounds import GenerationStats, RoundRecord
from dspark_cli.runtime.decode.sampling import accept_batch, processed_logits, sample, target_probs
from dspark_cli.runtime.settings import SamplingParams
from dspark_cli.runtime.decode.speculative import Drafter, draft_backbone, prefill
from dspark_cli.runtime.model.layers import RMSNorm
from dspark_cli.runtime.model.draft_io import load_draft
from dspark_cli.runtime.model.target import TargetModel
from dspark_cli.runtime.train.data import TokenStream
from dspark_cli.runtime.train.loss import build_blocks, loss_sums, normalise
from dspark_cli.runtime.train.options import TrainOptions
from dspark_cli.runtime.train.tiny_target import cosine_lr

# --- sampling filters ----------------------------------------------------------------------------------------------


def test_temperature_is_applied_before_top_p():
    """At T = 2 the probabilities of [0.7, 0.2, 0.1] flatten to ∝ sqrt: [0.524, 0.280, 0.198]; top-p 0.6 then keeps
    two tokens (0.524 < 0.6 before the second). Cutting at T = 1 first would keep token 0 alone."""
    logits = torch.tensor([[0.7, 0.2, 0.1]]).log()
    flat = torch.tensor([0.7, 0.2, 0.1]).sqrt()
    flat = flat / flat.sum()
    expected = torch.tensor([flat[0], flat[1], 0.0]) / (flat[0] + flat[1])
    torch.testing.assert_close(target_probs(logits, SamplingParams(temperature=2.0, top_p=0.6))[0], expected)


def test_top_p_drops_a_token_once_the_mass_before_it_reaches_p_exactly():
    """Four equal logits: each token has probability 0.25 exactly in fp32, so the mass before the third token is
    0.5 exactly; top-p 0.5 keeps two tokens, not three."""
    probs = target_probs(torch.zeros(1, 4), SamplingParams(temperature=1.0, top_p=0.5))[0]
    assert sorted(probs.tolist()) == [0.0, 0.0, 0.5, 0.5]
    probs = target_probs(torch.zeros(1, 4), SamplingParams(temperature=1.0, top_p=0.75))[0]
    assert sorted(probs.tolist()) == pytest.approx([0.0, 1 / 3, 1 / 3, 1 / 3])
    kept = processed_logits(torch.zeros(1, 4), SamplingParams(temperature=1.0, top_p=0.25))
    assert int(torch.isfinite(kept).sum()) == 1


@pytest.mark.parametrize("minority", [5e-3, 1e-3])
def test_sample_draws_from_a_nearly_one_hot_row(minority):
    """A row of [1 - m, m] is not greedy: over 200,000 draws the second token comes up m * N times (5 SE)."""
    draws = 200_000
    probs = torch.tensor([1.0 - minority, minority]).expand(draws, 2)
    count = int(sample(probs, torch.Generator().manual_seed(0)).sum())
    expected = minority * draws
    assert abs(count - expected) <= 5 * math.sqrt(expected), (count, expected)


@pytest.mark.parametrize("top", [0.995, 1.0 - 2**-20])
def test_rejection_sampling_accepts_a_draft_token_the_target_argmax_is_not(top):
    """q = p = [top, 1 - top, 0, 0]: every draft token is accepted (u * q < p for u < 1), including token 1, which a
    greedy shortcut on nearly one-hot target rows would reject."""
    p = torch.tensor([top, 1.0 - top, 0.0, 0.0])
    draft = torch.tensor([[1], [0]])  # [B, k=1]
    target = torch.stack([p, p]).expand(2, 2, 4)  # [B, k + 1, V]
    accepted, _ = accept_batch(draft, p.expand(2, 1, 4), target, torch.Generator().manual_seed(0))
    assert accepted.tolist() == [1, 1]


# --- draft query layouts, RMSNorm, the layout key ---------------------------------------------------------------


def test_rms_norm_adds_eps_inside_the_square_root():
    """x = [1, 1, 1, 1], eps = 0.5: mean(x^2) = 1, so every element becomes 1 / sqrt(1.5)."""
    out = RMSNorm(4, eps=0.5)(torch.ones(1, 4))
    torch.testing.assert_close(out, torch.full((1, 4), 1.0 / math.sqrt(1.5)))
    x = torch.tensor([[3.0, 4.0]])  # mean(x^2) = 12.5
    torch.testing.assert_close(RMSNorm(2, eps=0.25)(x), x / math.sqrt(12.75))


@pytest.fixture(scope="module")
def layout_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    spec = DraftSpec(block_size=5, markov_rank=64, dtype=torch.float32)
    target = TargetModel.load(tiny_target(root / "target", spec), [i + 1 for i in spec.target_layer_ids])
    drafts = {anchor: load_draft(write_draft(root / f"anchor-{anchor}", spec.with_(sample_from_anchor=anchor)))
              for anchor in (True, False)}
    return target, drafts


@pytest.mark.parametrize("sample_from_anchor", [True, False], ids=["N-queries", "1+N-queries"])
def test_draft_backbone_keeps_the_rows_that_predict_the_next_positions(layout_pair, sample_from_anchor):
    """N queries [a, mask * (N-1)]: row j predicts p+j+1, all N rows are used. 1+N queries [a, mask * N] (DFlash):
    the anchor's own row predicts nothing, rows 1..N are the proposals (the last N, never the first N)."""
    target, drafts = layout_pair
    draft = drafts[sample_from_anchor]
    anchor, context = prefill(target, draft, torch.tensor([5, 17, 33, 2]), SamplingParams(), None, capacity=32)
    drafter = Drafter(draft, "dense", SamplingParams(), target.vocab_size)
    n = 3
    hidden, base = draft_backbone(drafter, context, anchor, n)  # [N, H], [N, Vd]
    queries = n if sample_from_anchor else n + 1
    ids = torch.full((1, queries), draft.config.mask_token_id)
    ids[0, 0] = anchor
    with torch.no_grad():
        full = draft.block_hidden(ids, context.position_ids(context.length, queries), context.kv())[0]  # [Q, H]
    expected = full if sample_from_anchor else full[1:]
    assert hidden.shape == (n, full.shape[-1])
    torch.testing.assert_close(hidden, expected)
    torch.testing.assert_close(base, draft.base_logits(expected))
    if not sample_from_anchor:
        assert not torch.allclose(full[:n], expected)  # the first rows differ: the test can see a wrong slice


@pytest.mark.parametrize("bonus_anchor, layout, per_round", [(True, False, 7), (False, True, 8)])
def test_dspark_bonus_anchor_resolves_the_query_layout(bonus_anchor, layout, per_round):
    """dspark_bonus_anchor true (vLLM's key) means the 1+N layout: sample_from_anchor false, block_size - 1 draft
    tokens per round; false means N queries."""
    config = draft_config(DraftSpec(block_size=8))
    config.pop("sample_from_anchor", None)
    config["dspark_bonus_anchor"] = bonus_anchor
    resolved = DraftConfig.from_dict(config)
    assert resolved.sample_from_anchor is layout
    assert trained_block_size(resolved) == per_round


# --- the training objective, the learning rate, the windows ------------------------------------------------------


def test_loss_terms_match_a_hand_computation():
    """One block of K = 3 slots at anchor 2 of a 5-token window (slot 2's label is outside: invalid), vocabulary 3.
    loss = (0.1 CE + 0.9 L1 + 1.0 BCE(c, 1 - TV)) weighted by exp(-j / 4) over valid slots, divided by the weights'
    sum (DeepSpec's defaults), with TV = L1 / 2 the acceptance probability at T = 1."""
    tokens = torch.tensor([[0, 1, 2, 1, 0]])
    blocks = build_blocks(tokens, torch.tensor([[2]]), block_size=3, mask_token_id=2)
    assert blocks.valid.tolist() == [[[True, True, False]]] and blocks.labels[0, 0, :2].tolist() == [1, 0]
    generator = torch.Generator().manual_seed(0)
    draft_logits = torch.randn(1, 1, 3, 3, generator=generator)
    target_logits = torch.randn(1, 1, 3, 3, generator=generator)
    confidence_logits = torch.randn(1, 1, 3, generator=generator)
    terms = normalise(loss_sums(draft_logits, target_logits, confidence_logits, blocks, TrainOptions()), TrainOptions())

    ce = l1 = bce = weight = 0.0
    for j, label in enumerate([1, 0]):  # the valid slots
        w = math.exp(-j / 4.0)
        q = draft_logits[0, 0, j].double().softmax(-1)
        p = target_logits[0, 0, j].double().softmax(-1)
        distance = float((q - p).abs().sum())
        accept = 1.0 - distance / 2
        c = 1.0 / (1.0 + math.exp(-float(confidence_logits[0, 0, j])))
        ce += w * -math.log(float(q[label]))
        l1 += w * distance
        bce += w * -(accept * math.log(c) + (1 - accept) * math.log(1 - c))
        weight += w
    assert terms.ce == pytest.approx(ce / weight, rel=1e-5)
    assert terms.l1 == pytest.approx(l1 / weight, rel=1e-5)
    assert terms.confidence == pytest.approx(bce / weight, rel=1e-5)
    assert float(terms.loss) == pytest.approx((0.1 * ce + 0.9 * l1 + 1.0 * bce) / weight, rel=1e-5)


def test_learning_rate_decays_to_a_tenth_of_the_peak():
    """Warm-up 10 of 110 steps, then cosine from the peak to 10% of it: 0.55 of the peak halfway, 0.1 at the end."""
    assert cosine_lr(0, 110, 2.0, warmup=10) == pytest.approx(0.2)
    assert cosine_lr(10, 110, 2.0, warmup=10) == pytest.approx(2.0)
    assert cosine_lr(60, 110, 2.0, warmup=10) == pytest.approx(2.0 * 0.55)
    assert cosine_lr(110, 110, 2.0, warmup=10) == pytest.approx(0.2)


def test_training_windows_start_at_every_offset_including_the_last():
    """A 10-token stream and 8-token windows: the windows start at 0, 1 or 2, each about a third of the time."""
    windows = TokenStream(torch.arange(10)).sample(3000, 8, torch.Generator().manual_seed(0))
    starts = torch.bincount(windows[:, 0], minlength=3)
    assert windows.shape == (3000, 8) and starts.numel() == 3
    assert (starts > 800).all(), starts.tolist()
    assert torch.equal(windows[:, -1] - windows[:, 0], torch.full((3000,), 7))


# --- metrics -------------------------------------------------------------------------------------------------------


def _two_prompts(rounds: int = 100) -> list[list[int]]:
    """Prompt A: every round emits 1 token; prompt B: every round emits 5."""
    return [[1] * rounds, [5] * rounds]


def test_tau_interval_resamples_prompts_not_rounds():
    """Two prompts of 100 rounds, τ 1 and 5: resampling prompts gives replicates 1, 3 and 5 (each pair of prompts),
    so the 95% interval spans [1, 5]; resampling the 200 rounds would give about 3 +- 0.3."""
    emitted = _two_prompts()
    stats = [GenerationStats(4, sum(e), 0.0, 1.0, [RoundRecord(e_i - 1, e_i - 1, e_i, 7) for e_i in e])
             for e in emitted]
    interval = stats_tau_interval(stats)  # generate --json
    assert interval.estimate == pytest.approx(3.0)
    assert (interval.low, interval.high) == (pytest.approx(1.0), pytest.approx(5.0))
    results = [PromptResult("set", i, "p", 4, sum(e), 0.0, 1.0,
                            [{"proposed": x - 1, "accepted": x - 1, "emitted": x, "drafted": 7} for x in e], [], False)
               for i, e in enumerate(emitted)]
    tau_ci = set_statistics(results, block_size=7, max_new_tokens=1000)["tau_ci"]  # eval
    assert tau_ci == [pytest.approx(1.0), pytest.approx(5.0)]
    assert bootstrap_ratio([100.0, 500.0], [100.0, 100.0]).low == pytest.approx(1.0)


def test_ece_bins_by_floor():
    """Bins of width 0.1: 0.14 (accepted) and 0.16 (rejected) share bin [0.1, 0.2): ECE = |0.30 - 1| / 2 = 0.35.
    (Binning by round() would split them: (0.86 + 0.16) / 2 = 0.51.)"""
    assert expected_calibration_error([0.14, 0.16], [True, False], bins=10) == pytest.approx(0.35)
    # the default 20 bins of width 0.05: 0.11 and 0.13 share [0.10, 0.15); 1.0 falls in the last bin
    assert expected_calibration_error([0.11, 0.13], [True, False]) == pytest.approx(abs(0.24 - 1) / 2)
    assert expected_calibration_error([0.05, 0.95, 1.0], [False, True, True]) == pytest.approx((0.05 + 0.05 + 0.0) / 3)
