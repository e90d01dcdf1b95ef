"""Greedy speculative decoding (runtime/decode/speculative.py) is token-identical to the target's own greedy decoding.

All in float32 (docs/deepspec.md §2: bf16 near-ties may flip). The target is a tiny random Qwen3 whose
next token depends mostly on the current one, and the drafts' Markov heads know that bigram (tests/fixtures/pair_factory.py),
so rounds accept 0..block_size tokens and both the accept and the reject paths run. Checkpoints are written in
bf16 (DeepSpec's format) unless named fp32, and loaded in float32.
"""

import time

import pytest
from dspark_cli.runtime.settings import trained_block_size
from loop import generate
import torch
from ckpt_factory import DraftSpec, write_draft
from pair_factory import bigram_draft, bigram_target

from dspark_cli.runtime.model.draft import DraftContext
from dspark_cli.runtime.model.draft_io import load_draft
from dspark_cli.runtime.settings import SamplingParams
from dspark_cli.runtime.decode.speculative import (
    Drafter,
    accept_block,
    autoregressive_generate,
    check_lengths,
    draft_block,
    prefill,
    score_block,
)
from dspark_cli.runtime.rounds import scored_length
from dspark_cli.runtime.model.target import TargetModel
from dspark_cli.runtime.decode.timing import SectionTimer

PROMPTS = ([5, 17, 33, 2, 99], [7, 8, 9, 10])
MAX_NEW = 40
EOS = 1  # tiny_target's eos_token_id
GREEDY = SamplingParams()
SPEC = DraftSpec(block_size=8, markov_rank=64)  # markov_rank = hidden size: the Markov head can hold the bigram
DRAFTS = {
    "bf16": (SPEC, True),
    "fp32": (SPEC.with_(dtype=torch.float32), True),
    "nvfp4": (SPEC, True),
    "reduced": (SPEC.with_(draft_vocab_size=128), True),  # d2t maps 128 draft ids to target ids
    "layout-1+N": (SPEC.with_(block_size=9, sample_from_anchor=False), True),  # 9 query slots -> 8 drafts
    "dflash": (SPEC.with_(markov_rank=0, block_size=9, confidence=False), False),  # no Markov head, 1+N layout
    "dflash-reduced": (SPEC.with_(markov_rank=0, block_size=9, confidence=False, draft_vocab_size=128), False),
    # windows narrower than the prompt and the block (docs/format.md §2.3): causal sliding layer 0, dense layer 1
    "sliding": (SPEC.with_(extra_config={"layer_types": ["sliding_attention", "full_attention"],
                                         "sliding_window": 3}), True),
    # every layer sliding and non-causal (is_causal false), 1+N layout, no Markov head
    "swa-dflash": (SPEC.with_(markov_rank=0, block_size=9, confidence=False,
                              extra_config={"layer_types": ["sliding_attention"] * 2, "sliding_window": 4,
                                            "is_causal": False}), False),
}


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    target_dir = bigram_target(root / "target", SPEC)
    drafts = {}
    for name, (spec, bigram) in DRAFTS.items():
        path = root / name
        if bigram:
            drafts[name] = bigram_draft(path, spec, target_dir, nvfp4=name == "nvfp4")
        else:
            drafts[name] = write_draft(path, spec)
    return target_dir, drafts


@pytest.fixture(scope="module")
def target(pair_dirs):
    return TargetModel.load(pair_dirs[0], [i + 1 for i in SPEC.target_layer_ids])


@pytest.fixture(scope="module")
def drafts(pair_dirs, target):
    return {
        name: load_draft(path, target_embed=target.embed_weight, target_lm_head=target.lm_head_weight)
        for name, path in pair_dirs[1].items()
    }


@pytest.fixture(scope="module")
def reference(target):
    """The target's own greedy continuation of each prompt (transformers generate, stops at eos)."""
    outputs = []
    for prompt in PROMPTS:
        ids = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW)
        outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


def run(target, draft, block_size, **options):
    options.setdefault("max_new_tokens", MAX_NEW)
    return [
        generate(target, draft, prompt, GREEDY, block_size=block_size, stop_ids=[EOS], **options)
        for prompt in PROMPTS
    ]


def assert_matches(results, reference):
    for result, expected in zip(results, reference):
        assert result.tokens == expected
        assert result.stats.new_tokens == len(expected)


MARKOV = {"dense": ("dense", None), "topk-5": ("topk", 5), "topk-all": ("topk", SPEC.vd), "fused-5": ("fused", 5)}


@pytest.mark.parametrize("block_size", range(1, 9))
@pytest.mark.parametrize("markov", MARKOV)
def test_greedy_equals_target_for_every_block_size_and_strategy(target, drafts, reference, block_size, markov):
    strategy, k = MARKOV[markov]
    assert_matches(run(target, drafts["bf16"], block_size, strategy=strategy, draft_topk=k), reference)


@pytest.mark.parametrize("block_size", range(1, 9))
@pytest.mark.parametrize("strategy, k", [("nvfp4", 5), ("nvfp4", SPEC.vd), ("fused", 5), ("dense", None)])
def test_greedy_equals_target_with_an_nvfp4_head(target, drafts, reference, block_size, strategy, k):
    assert drafts["nvfp4"].w2_nvfp4 is not None
    assert_matches(run(target, drafts["nvfp4"], block_size, strategy=strategy, draft_topk=k), reference)


@pytest.mark.parametrize("block_size", [2, 8])
@pytest.mark.parametrize("threshold", [0.2, 0.5, 0.99])
def test_confidence_threshold_cuts_rounds_but_not_the_output(target, drafts, reference, block_size, threshold):
    results = run(target, drafts["bf16"], block_size, confidence_threshold=threshold)
    assert_matches(results, reference)
    rounds = [r for result in results for r in result.stats.rounds]
    assert any(r.proposed < r.drafted for r in rounds)  # the threshold did cut some rounds
    for r in rounds:
        survival = torch.cumprod(torch.tensor(r.confidences, dtype=torch.float64), 0)
        assert r.proposed == int((survival >= threshold).sum()) or r.accepted == r.proposed == r.emitted


@pytest.mark.parametrize("block_size", range(1, 9))
@pytest.mark.parametrize("name", ["layout-1+N", "dflash"])
def test_greedy_equals_target_in_the_dflash_query_layout(target, drafts, reference, block_size, name):
    assert drafts[name].config.sample_from_anchor is False
    assert_matches(run(target, drafts[name], block_size), reference)


@pytest.mark.parametrize("block_size", [1, 4, 8])
@pytest.mark.parametrize("name, strategy, k", [("reduced", "dense", None), ("reduced", "topk", 5),
                                               ("reduced", "fused", 5), ("fp32", "dense", None)])
def test_greedy_equals_target_with_reduced_vocab_and_fp32_drafts(target, drafts, reference, block_size, name,
                                                                  strategy, k):
    assert_matches(run(target, drafts[name], block_size, strategy=strategy, draft_topk=k), reference)


@pytest.mark.parametrize("block_size", range(1, 9))
@pytest.mark.parametrize("name", ["sliding", "swa-dflash"])
def test_greedy_equals_target_with_sliding_window_drafts(target, drafts, reference, block_size, name):
    assert not drafts[name].config.layer_attention[0].dense
    assert_matches(run(target, drafts[name], block_size), reference)


@pytest.mark.parametrize("name", ["bf16", "nvfp4", "reduced", "layout-1+N", "sliding"])
def test_fixture_drafts_are_accepted_often(target, drafts, name):
    """Guards the tests above: their drafts must accept tokens, or only the reject path would be checked."""
    rounds = [r for result in run(target, drafts[name], 8) for r in result.stats.rounds]
    tau = sum(r.emitted for r in rounds) / len(rounds)
    assert tau > (1.5 if name == "reduced" else 2.0)
    assert {r.accepted for r in rounds} >= {0, 8} or name == "reduced"


def test_round_records_are_consistent(target, drafts, reference):
    for result, expected in zip(run(target, drafts["bf16"], 4), reference):
        rounds = result.stats.rounds
        assert all(r.drafted == 4 and r.proposed == 4 and r.confidences is not None for r in rounds)
        assert 1 + sum(r.emitted for r in rounds) >= len(result.tokens)  # the first token is in no round
        assert result.stats.prompt_tokens in (len(p) for p in PROMPTS)
        assert 0 < result.stats.ttft_s <= result.stats.total_s


def test_length_limit_trims_the_last_round(target, drafts, reference):
    results = run(target, drafts["bf16"], 8, max_new_tokens=7)
    for result, expected in zip(results, reference):
        assert result.tokens == expected[:7]
        assert sum(r.emitted for r in result.stats.rounds) + 1 >= 7  # counted before trimming (DeepSpec)


def test_stop_token_ends_generation_after_it(target, drafts, reference):
    expected = reference[0]
    for stop in dict.fromkeys(expected[1:12]):  # stops met as accepted drafts and as correction/bonus tokens
        result = generate(target, drafts["bf16"], PROMPTS[0], GREEDY, block_size=8,
                                      max_new_tokens=MAX_NEW, stop_ids=[stop])
        assert result.tokens == expected[: expected.index(stop) + 1]
        assert result.finished_by_stop
        last = result.stats.rounds[-1]
        assert last.emitted in (last.accepted, last.accepted + 1)


def test_stop_token_as_first_token_means_no_rounds(target, drafts, reference):
    result = generate(target, drafts["bf16"], PROMPTS[0], GREEDY, block_size=4, max_new_tokens=MAX_NEW,
                                  stop_ids=[reference[0][0]])
    assert result.tokens == reference[0][:1] and result.stats.rounds == []


def test_baseline_equals_target(target, reference):
    for prompt, expected in zip(PROMPTS, reference):
        result = autoregressive_generate(target, prompt, GREEDY, max_new_tokens=MAX_NEW, stop_ids=[EOS])
        assert result.tokens == expected
        assert result.stats.rounds == [] and result.stats.new_tokens == len(expected)


def test_sampling_is_reproducible_from_the_seed(target, drafts):
    params = SamplingParams(temperature=0.8, top_p=0.95)

    def sample(seed):
        generator = torch.Generator().manual_seed(seed)
        return generate(target, drafts["bf16"], PROMPTS[0], params, block_size=4, max_new_tokens=30,
                                    generator=generator).tokens

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)


def test_incremental_context_equals_a_full_recompute(target, drafts):
    """Context K/V appended round by round (prompt at prefill, then anchor + accepted tokens) equal the K/V
    computed at once from a fresh prefill of the committed sequence; the draft's next block agrees too."""
    draft = drafts["bf16"]
    drafter = Drafter(draft, "dense", GREEDY, target.vocab_size)
    anchor, context = prefill(target, draft, torch.tensor(PROMPTS[0]), GREEDY, None, capacity=1)  # grows
    sequence = list(PROMPTS[0]) + [anchor]
    accepted_counts = []
    for _ in range(6):
        proposal = draft_block(drafter, context, anchor, 4, None)
        logits, features = score_block(target, sequence[-1], proposal, 4)
        accepted, anchor = accept_block(proposal, proposal.tokens.tolist(), logits, GREEDY, None)
        target.crop(context.length + accepted + 1)
        context.append(draft, features[: accepted + 1])
        sequence += proposal.tokens[:accepted].tolist() + [anchor]
        accepted_counts.append(accepted)
    assert max(accepted_counts) > 0 and context.length == len(sequence) - 1

    _, features = target.prefill(torch.tensor(sequence[:-1]))
    positions = torch.arange(len(sequence) - 1)[None]
    with torch.no_grad():
        recomputed = draft.context_kv(draft.project_context(features[None]), positions)
    for (k, v), (k_full, v_full) in zip(context.kv(), recomputed):
        torch.testing.assert_close(k, k_full, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_full, rtol=1e-5, atol=1e-5)
    incremental = draft_block(drafter, context, anchor, 4, None)
    full = DraftContext(draft, len(sequence))
    full.append(draft, features)
    assert draft_block(drafter, full, anchor, 4, None).tokens.tolist() == incremental.tokens.tolist()


def test_bf16_pair_runs_and_starts_like_plain_decoding(pair_dirs):
    """bf16 may diverge from plain decoding at logit near-ties (reported by the CLI, not asserted); the first
    token comes from the same prefill and must agree."""
    target_dir, draft_dirs = pair_dirs
    target = TargetModel.load(target_dir, [1, 3], dtype=torch.bfloat16)
    draft = load_draft(draft_dirs["nvfp4"], dtype=torch.bfloat16)
    result = generate(target, draft, PROMPTS[0], GREEDY, block_size=8, max_new_tokens=20,
                                  strategy="nvfp4", draft_topk=16)
    plain = autoregressive_generate(target, PROMPTS[0], GREEDY, max_new_tokens=20)
    assert len(result.tokens) == 20 and result.tokens[0] == plain.tokens[0]


def test_trained_block_size_follows_the_query_layout(drafts):
    assert trained_block_size(drafts["bf16"].config) == 8  # N queries propose N tokens
    assert trained_block_size(drafts["layout-1+N"].config) == 8  # 1 + N queries: the anchor slot proposes nothing


def test_threshold_without_confidence_head_is_refused(target, drafts):
    with pytest.raises(ValueError, match="confidence head"):
        generate(target, drafts["dflash"], PROMPTS[0], GREEDY, block_size=4, max_new_tokens=4,
                             confidence_threshold=0.5)


def test_a_huge_length_limit_reserves_nothing_up_front(target, drafts, reference):
    """Generation may end at a stop token long before max_new_tokens: the draft context grows as it goes."""
    expected = reference[0]
    stop = expected[5]
    result = generate(target, drafts["bf16"], PROMPTS[0], GREEDY, block_size=8, max_new_tokens=2**62,
                                  stop_ids=[stop])
    assert result.tokens == expected[: expected.index(stop) + 1] and result.finished_by_stop


def test_each_round_is_timed_by_step_and_the_cache_lengths_are_checked(target, drafts):
    """One SectionTimer record per round with every step of the loop; check_lengths refuses a target cache
    that holds more positions than the draft context (a wrong crop would break the next round)."""
    result = generate(target, drafts["fp32"], PROMPTS[0], GREEDY, block_size=4, max_new_tokens=20)
    sections = result.stats.sections
    assert len(sections) == len(result.stats.rounds) > 1
    steps = {"draft", "markov", "snapshot", "score", "accept", "commit"}
    later = {"rollback", "advance"}  # absent in the last round
    assert all(steps <= set(r) <= steps | later for r in sections) and later <= set(sections[0])
    assert all(ms >= 0.0 for r in sections for ms in r.values())

    anchor, context = prefill(target, drafts["fp32"], torch.tensor(PROMPTS[0]), GREEDY, None, capacity=8)
    check_lengths(target, context)  # equal after prefill
    target.score(torch.tensor([anchor]))  # the target cache grows by one, the context does not
    with pytest.raises(AssertionError, match="target cache holds 6 positions, draft context 5"):
        check_lengths(target, context)


def test_section_timer_adds_up_per_round():
    timer = SectionTimer(torch.device("cpu"))
    for _ in range(2):
        timer.start_round()
        for name in ("a", "b", "a"):
            with timer.section(name):
                time.sleep(0.002)
    assert [set(r) for r in timer.rounds] == [{"a", "b"}, {"a", "b"}]
    assert all(r["a"] >= 4.0 and 2.0 <= r["b"] < r["a"] + 2.0 for r in timer.rounds)  # ms; "a" ran twice


def test_scored_length_matches_float64_survival_and_keeps_ties():
    """The host-side rule (on the confidences the round copies anyway) equals the float64 cumulative product on
    the tensor; a survival or a slot exactly at the threshold is scored (>=)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        confidences = torch.rand(8, generator=generator) ** 0.3  # [N] fp32, mostly high
        threshold = float(torch.rand(1, generator=generator))
        survival = torch.cumprod(confidences.double(), dim=0)
        assert scored_length(confidences.tolist(), threshold) == int((survival >= threshold).sum())
        below = (confidences < threshold).nonzero()
        per_slot = int(below[0, 0]) if below.numel() else 8
        assert scored_length(confidences, threshold, "per-slot") == per_slot
    assert scored_length([1.0, 0.5, 0.25], 0.5) == 2
    assert scored_length([0.5, 0.4], 0.5, "per-slot") == 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_without_markov_head_proposes_target_ids_through_d2t(drafts, temperature):
    """No Markov head: the walk picks draft ids, which the proposal must map through d2t like the head does."""
    from dspark_cli.runtime.decode.speculative import markov_stage

    draft = drafts["dflash-reduced"]
    assert draft.markov_head is None and draft.d2t is not None and bool(draft.d2t.any())
    params = SamplingParams(temperature=temperature)
    drafter = Drafter(draft, "dense", params, target_vocab=SPEC.vocab_size)
    hidden = torch.randn(4, draft.config.hidden_size, generator=torch.Generator().manual_seed(0))  # [N, H]
    base = draft.base_logits(hidden)  # [N, Vd]
    proposal = markov_stage(drafter, hidden, base, anchor=5, generator=torch.Generator().manual_seed(1))
    target_ids = torch.arange(base.shape[-1]) + draft.d2t  # [Vd]
    assert set(proposal.tokens.tolist()) <= set(target_ids.tolist())
    if temperature == 0:
        assert proposal.tokens.tolist() == target_ids[base.argmax(-1)].tolist()
    else:  # q puts all its mass on the target ids the draft can propose, and the proposals carry mass
        assert bool((proposal.draft_probs[torch.arange(4), proposal.tokens] > 0).all())
