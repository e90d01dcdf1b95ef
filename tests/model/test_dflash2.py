"""DFlash2 drafts (docs/formats-other.md §7), pinned against references written here from the formulas of vLLM's
qwen3_dflash2.py / dflash2 speculator and llama.cpp b11434's build_dflash2_conv / build_dflash2_selector / is_dflash2
walk, independently of runtime/model/ and runtime/decode/:

1. the grouped dynamic convolution (one block, and blocks packed in one row as training runs them) equals an
   element-by-element loop over taps, groups and positions;
2. the selector's edge scores equal the formula summed by hand, and the walk's tokens and confidences equal a
   scalar walk of the lattice;
3. training's teacher-forced logits (DFlash layout blocks) are, on the candidates, the rows the walk reads;
4. greedy speculative decoding is token-identical to the target's greedy decoding (float32) with a DFlash2 draft
   for a Qwen3 and a Gemma-4 target, with and without a confidence threshold on the selector's score;
5. validate's DFlash2 rules (DSP060-DSP065, DSP211) and the tensor schema.
T > 0 exactness runs through tests/decode/test_speculative_lossless.py.
"""

import math

import pytest
import torch
from ckpt_factory import DraftSpec, drop, write_draft
from loop import generate
from pair_factory import bigram_target, dflash2_bigram_draft

from dspark_cli.runtime.checkpoint.read import open_checkpoint
from dspark_cli.runtime.checkpoint.rules import validate_checkpoint
from dspark_cli.runtime.decode.selector import selector_walk
from dspark_cli.runtime.decode.speculative import Drafter, draft_backbone, markov_stage
from dspark_cli.runtime.model.draft import DraftContext
from dspark_cli.runtime.model.draft_io import load_draft
from dspark_cli.runtime.model.target import TargetModel
from dspark_cli.runtime.settings import SamplingParams
from dspark_cli.runtime.train.loss import build_blocks, draft_forward
from dspark_cli.runtime.train.tau import chained_tau, held_out

F32 = torch.float32
SPEC = DraftSpec(family="dflash2", markov_rank=0, confidence=False, block_size=7, dtype=F32)


# --- 1. the convolution ---------------------------------------------------------------------------------------------

def conv_reference(y, x, base, projection, side, taps, group, block):
    """y, x [L, H] (x: the path's input the coefficients come from), base [2, K, H], projection [2*K*G, H]."""
    L, H = y.shape
    groups = H // group
    coeff = (x @ projection.T).view(L, 2, taps, groups)
    out = torch.zeros_like(y)
    for q in range(L):
        for t in range(taps):
            if q % block - t < 0:
                continue
            for h in range(H):
                out[q, h] += (base[side, t, h] + coeff[q, side, t, h // group]) * y[q - t, h]
    return out


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return load_draft(write_draft(tmp_path_factory.mktemp("d2") / "draft", SPEC))


@pytest.mark.parametrize("block", [8, 3])  # one block of 8; three packed blocks of 3 (and a partial one)
def test_grouped_conv_equals_the_reference(draft, block):
    conv = draft.layers[0].attention_conv
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 8, SPEC.hidden_size, generator=generator)
    coefficients = conv.coefficients(x[None])
    for side in (0, 1):
        got = conv(y[None], coefficients, side, None if block == 8 else block)[0]
        expected = conv_reference(y, x, conv.base_kernel.detach(), conv.kernel_projection.weight.detach(), side,
                                  SPEC.conv_kernel_size, SPEC.conv_group_size, block)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_block_drafts_the_same_alone_and_packed_with_others(draft):
    """Training's packed blocks (block_length) see exactly what one block in generation sees."""
    ids = torch.randint(0, 250, (1, 8))
    ids[0, 1:] = SPEC.mask_token_id
    positions = torch.arange(8)[None] + 20
    context = [(torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)) for _ in draft.layers]
    alone = draft.block_hidden(ids, positions, context)
    twice = draft.block_hidden(ids.repeat(1, 2), positions.repeat(1, 2),
                               [(k, v) for k, v in context], attn_mask=_two_blocks_mask(20, 8), block_length=8)
    torch.testing.assert_close(twice[:, :8], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(twice[:, 8:], alone, rtol=1e-5, atol=1e-5)


def _two_blocks_mask(context: int, block: int) -> torch.Tensor:
    """[1, 2B, C + 2B]: both blocks see the whole context and only themselves."""
    same = torch.block_diag(torch.ones(block, block), torch.ones(block, block)).bool()
    return torch.cat([torch.ones(2 * block, context, dtype=torch.bool), same], dim=-1)[None]


# --- 2. the selector and the walk -----------------------------------------------------------------------------------

def test_selector_scores_equal_the_formula(draft):
    selector = draft.candidate_selector
    generator = torch.Generator().manual_seed(2)
    N, k = 4, SPEC.selector_top_k
    hidden = torch.randn(N, SPEC.hidden_size, generator=generator)
    logits = torch.randn(N, SPEC.vocab_size, generator=generator)
    ids, unary = selector.candidates(logits)
    scores = selector(hidden, ids, unary, torch.tensor(7)).detach()
    P, Q = selector.predecessor_codebook.detach(), selector.successor_codebook.detach()
    W = selector.hidden_projection.weight.detach()
    for j in range(N):
        gate = W @ hidden[j]
        for a in range(k):
            prev = 7 if j == 0 else int(ids[j - 1, a])
            for b in range(k):
                edge = sum(float(P[prev, r] * gate[r] * Q[ids[j, b], r]) for r in range(SPEC.selector_rank))
                assert math.isclose(float(scores[j, a, b]), float(logits[j, ids[j, b]]) + edge, abs_tol=1e-4)
    assert float((scores - unary[:, None, :]).abs().max()) > 0.1  # the pairwise term is not negligible here


def walk_reference(scores, ids):
    """llama.cpp's CPU walk of the packed lattice (common/speculative.cpp, is_dflash2): -> tokens, top-1 shares."""
    tokens, shares, previous = [], [], 0
    for j in range(scores.shape[0]):
        row = [float(s) for s in scores[j, previous]]
        best = max(range(len(row)), key=lambda c: (row[c], -c))  # the first maximum
        shares.append(1.0 / sum(math.exp(s - row[best]) for s in row))
        tokens.append(int(ids[j, best]))
        previous = best
    return tokens, shares


def test_greedy_walk_equals_the_lattice_walk(draft):
    selector = draft.candidate_selector
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, SPEC.hidden_size, generator=generator)
    ids, unary = selector.candidates(torch.randn(6, SPEC.vocab_size, generator=generator))
    scores = selector(hidden, ids, unary, torch.tensor(3)).detach()
    walk = selector_walk(scores[None], ids[None], SPEC.vocab_size, SamplingParams(), None)
    tokens, shares = walk_reference(scores, ids)
    assert walk.tokens[0].tolist() == tokens
    torch.testing.assert_close(torch.sigmoid(walk.confidence_logits[0]), torch.tensor(shares), rtol=1e-5, atol=1e-6)
    assert len(set(tokens)) > 1


def test_sampled_walk_draws_from_the_realized_row(draft):
    """At T > 0 each slot's token is a Gumbel-max sample of q = softmax(row / T) on the candidates, and q is the
    distribution handed to rejection sampling: the empirical frequencies of slot 2 given slot 1 match q."""
    selector = draft.candidate_selector
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, SPEC.hidden_size, generator=generator)
    ids, unary = selector.candidates(torch.randn(2, SPEC.vocab_size, generator=generator) * 0.3)
    scores = selector(hidden, ids, unary, torch.tensor(3)).detach() * 0.2
    params, draws = SamplingParams(temperature=0.8), 4000
    noise = -torch.log(-torch.log(torch.rand(draws, 2, SPEC.vocab_size, generator=generator).clamp_min(1e-12)))
    walk = selector_walk(scores.expand(draws, -1, -1, -1), ids.expand(draws, -1, -1), SPEC.vocab_size, params, noise)
    first = (ids[0][None] == walk.tokens[:, :1]).long().argmax(-1)  # [draws] index chosen at slot 1
    for index in range(SPEC.selector_top_k):
        rows = first == index
        if rows.sum() < 300:
            continue
        q = torch.softmax(scores[1, index] / 0.8, -1)
        counts = torch.stack([(walk.tokens[rows, 1] == c).float().mean() for c in ids[1]])
        assert float((counts - q).abs().max()) < 0.06
        torch.testing.assert_close(walk.rows[rows][0, 1, ids[1]], scores[1, index])


# --- 3. training sees what the walk reads -------------------------------------------------------------------------

def test_teacher_forced_logits_are_the_walk_rows_on_the_candidates(draft):
    """DFlash layout blocks: slot j predicts the token at a+j, its predecessor the token at a+j-1; on the top-k
    candidates the training logits equal the selector's row for that predecessor (what the walk reads when its
    previous pick was the true token)."""
    tokens = torch.randint(2, 250, (1, 40), generator=torch.Generator().manual_seed(5))
    anchors = torch.tensor([[10, 25]])
    K = SPEC.block_size
    blocks = build_blocks(tokens, anchors, K, SPEC.mask_token_id, sample_from_anchor=False)
    assert blocks.labels[0, 0, 1:].tolist() == tokens[0, 11:10 + K].tolist() and not blocks.valid[0, 0, 0]
    assert blocks.prev_ids[0, 0, 1:].tolist() == tokens[0, 10:9 + K].tolist()
    features = torch.randn(1, 40, 2 * SPEC.hidden_size)
    with torch.no_grad():
        logits, confidence = draft_forward(draft, features, blocks)
        hidden = _block_hidden(draft, features, blocks)
    assert confidence is None
    base = draft.base_logits(hidden)  # [1, A, K, V]
    selector = draft.candidate_selector
    for a in range(2):
        for j in range(1, K):
            ids, unary = selector.candidates(base[0, a, j][None])
            row = unary[0] + selector.pairwise(hidden[0, a, j][None], blocks.prev_ids[0, a, j][None, None], ids)[0, 0]
            torch.testing.assert_close(logits[0, a, j, ids[0]], row, rtol=1e-5, atol=1e-5)


def test_the_training_length_estimate_skips_the_anchor_slot_of_the_dflash_layout(draft):
    """LossTerms.expected_length chains the drafted slots only: in the DFlash layout the anchor's slot predicts
    nothing, and a draft equal to the target there has expected length 1 + N."""
    from dspark_cli.runtime.train.loss import loss_sums, normalise
    from dspark_cli.runtime.train.options import TrainOptions

    tokens = torch.randint(2, 250, (1, 40), generator=torch.Generator().manual_seed(6))
    blocks = build_blocks(tokens, torch.tensor([[10, 20]]), 4, SPEC.mask_token_id, sample_from_anchor=False)
    logits = torch.randn(1, 2, 4, SPEC.vocab_size)
    terms = normalise(loss_sums(logits, logits, None, blocks, TrainOptions()), TrainOptions())
    assert terms.expected_length == pytest.approx(4.0)


def test_a_new_draft_trains_its_selector_and_starts_its_convolution_as_the_identity():
    """A freshly built DFlash2 draft (train's start): the convolution is the identity (tap 0 = 1), and one loss
    step reaches both codebooks (at zero their product would keep the edge term and its gradients at zero)."""
    from ckpt_factory import draft_config

    from dspark_cli.runtime.checkpoint.config import DraftConfig
    from dspark_cli.runtime.model.draft import DSparkDraft

    torch.manual_seed(0)
    fresh = DSparkDraft(DraftConfig.from_dict(draft_config(SPEC)))
    base = fresh.layers[0].attention_conv.base_kernel.detach()
    assert torch.equal(base[:, 0], torch.ones_like(base[:, 0])) and not base[:, 1:].any()
    tokens = torch.randint(2, 250, (1, 40), generator=torch.Generator().manual_seed(7))
    blocks = build_blocks(tokens, torch.tensor([[10, 25]]), SPEC.block_size, SPEC.mask_token_id,
                          sample_from_anchor=False)
    logits, _ = draft_forward(fresh, torch.randn(1, 40, 2 * SPEC.hidden_size), blocks)
    torch.nn.functional.cross_entropy(logits[blocks.valid], blocks.labels[blocks.valid]).backward()
    selector = fresh.candidate_selector
    assert selector.predecessor_codebook.grad.abs().sum() > 0 and selector.successor_codebook.grad.abs().sum() > 0


def _block_hidden(draft, features, blocks):
    from dspark_cli.runtime.train.loss import block_hidden

    return block_hidden(draft, features, blocks)


# --- 4. lossless greedy decoding ----------------------------------------------------------------------------------

TARGETS = {"qwen3": DraftSpec(markov_rank=0, confidence=False), "gemma4": DraftSpec(family="gemma4", markov_rank=0,
                                                                                   confidence=False)}
BIGRAM = SPEC.with_(selector_rank=64, selector_top_k=256, block_size=7)  # top_k = vocab: the walk follows the bigram


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2-pairs")
    out = {}
    for family, spec in TARGETS.items():
        target_dir = bigram_target(root / f"{family}-target", spec.with_(block_size=6))
        target = TargetModel.load(target_dir, [i + 1 for i in spec.target_layer_ids])
        drafts = {"bigram": dflash2_bigram_draft(root / f"{family}-bigram", BIGRAM, target_dir),
                  "random": write_draft(root / f"{family}-random", SPEC)}
        out[family] = (target, {name: load_draft(path, target_embed=target.embed_weight,
                                                 target_lm_head=target.lm_head_weight)
                                for name, path in drafts.items()})
    return out


PROMPT, MAX_NEW = [5, 17, 33, 2, 99], 24


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_greedy_equals_target(pairs, family):
    target, drafts = pairs[family]
    expected = target.model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=MAX_NEW)[0, 5:].tolist()
    accepted = {}
    for name, draft in drafts.items():
        accepted[name] = 0
        for block_size, threshold in ((1, None), (6, None), (6, 0.3)):
            result = generate(target, draft, PROMPT, SamplingParams(), block_size=block_size, stop_ids=[1],
                              max_new_tokens=MAX_NEW, confidence_threshold=threshold)
            assert result.tokens == expected, (name, block_size, threshold)
            accepted[name] += sum(r.accepted for r in result.stats.rounds)
            if threshold is not None and name == "random":
                assert any(r.proposed < r.drafted for r in result.stats.rounds)  # the selector's score cut rounds
    assert accepted["bigram"] > (3 * MAX_NEW // 2 if family == "qwen3" else 0)  # the selector path gets accepted


def test_bigram_selector_proposes_the_bigram_and_a_dropped_pairwise_term_does_not(pairs):
    """The walk's proposals come from the pairwise term (the unary term is weak noise): zeroing the successor
    codebook collapses acceptance."""
    target, drafts = pairs["qwen3"]
    draft = drafts["bigram"]
    rounds = generate(target, draft, PROMPT, SamplingParams(), block_size=6, stop_ids=[1],
                      max_new_tokens=MAX_NEW).stats.rounds
    saved = draft.candidate_selector.successor_codebook.detach().clone()
    with torch.no_grad():
        draft.candidate_selector.successor_codebook.zero_()
    try:
        blind = generate(target, draft, PROMPT, SamplingParams(), block_size=6, stop_ids=[1],
                         max_new_tokens=MAX_NEW).stats.rounds
    finally:
        with torch.no_grad():
            draft.candidate_selector.successor_codebook.copy_(saved)
    tau = sum(r.emitted for r in rounds) / len(rounds)
    blind_tau = sum(r.emitted for r in blind) / len(blind)
    assert tau > 2.5 and blind_tau < 1.5, (tau, blind_tau)


def test_markov_stage_records_the_selector_score_as_confidence(pairs):
    target, drafts = pairs["qwen3"]
    draft = drafts["random"]
    from loop import loop_settings

    drafter = Drafter.of(draft, loop_settings(draft, block_size=4), target.vocab_size)
    _, features = target.prefill(torch.tensor(PROMPT))
    context = DraftContext(draft, 64)
    context.append(draft, features)
    hidden, base = draft_backbone(drafter, context, 9, 4)
    proposal = markov_stage(drafter, hidden, base, 9, None)
    with torch.inference_mode():
        ids, unary = draft.candidate_selector.candidates(base)
        scores = draft.candidate_selector(hidden, ids, unary, torch.tensor(9))
    tokens, shares = walk_reference(scores, ids)
    assert proposal.tokens.tolist() == tokens
    torch.testing.assert_close(proposal.confidences, torch.tensor(shares), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.sigmoid(proposal.confidence_logits), proposal.confidences)


def test_train_tau_is_the_loops_tau_for_a_dflash2_draft(pairs):
    """train's τ probe (train/tau.py) reads DFlash2 blocks in the DFlash layout and walks the selector: the same
    rounds as the loop."""
    target, drafts = pairs["qwen3"]
    draft = drafts["bigram"]
    prompts = [torch.tensor(p) for p in (PROMPT, [7, 8, 9, 10, 11], [40, 41, 42, 43, 44])]
    held = held_out(target, prompts, MAX_NEW, draft.config.block_size.value, draft.config.layer_ids)
    estimate = chained_tau(draft, held, target.vocab_size)
    rounds = [r for p in prompts for r in generate(target, draft, p.tolist(), SamplingParams(),
                                                     max_new_tokens=MAX_NEW).stats.rounds]
    assert estimate.rounds == len(rounds)
    assert estimate.tau == pytest.approx(sum(r.emitted for r in rounds) / len(rounds), abs=1e-12)
    assert estimate.tau > 2.0


# --- 5. validate --------------------------------------------------------------------------------------------------

def codes(path, target=None) -> set[str]:
    return set(validate_checkpoint(open_checkpoint(path), target).codes)


def test_a_dflash2_draft_validates_clean(tmp_path):
    found = codes(write_draft(tmp_path / "d", SPEC.with_(dtype=torch.bfloat16)))
    assert found == {"DSP002", "DSP100"}


@pytest.mark.parametrize("spec, edit, mutate, code", [
    (SPEC, {"dflash_config": {"mask_token_id": 250, "target_layer_ids": [0, 2], "conv_group_size": 16,
                              "selector_rank": 16, "selector_top_k": 4}}, None, "DSP060"),
    (SPEC, {"dflash_config": {"mask_token_id": 250, "target_layer_ids": [0, 2], "conv_kernel_size": 3,
                              "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 0}}, None, "DSP060"),
    (SPEC.with_(conv_group_size=24), {}, None, "DSP061"),
    (SPEC.with_(selector_top_k=8), {}, None, "DSP062"),  # 64 < 8 * 9
    (SPEC.with_(hidden_size=64, vocab_size=6, mask_token_id=5, selector_top_k=7), {}, None, "DSP063"),
    (SPEC, {"markov_rank": 32}, None, "DSP065"),
    (SPEC, {}, drop("layers.1.mlp_conv.base_kernel"), "DSP201"),
    (SPEC.with_(selector_rank=8), {"dflash_config": {"mask_token_id": 250, "target_layer_ids": [0, 2],
                                                     "conv_kernel_size": 3, "conv_group_size": 16,
                                                     "selector_rank": 16, "selector_top_k": 4}}, None, "DSP202"),
])
def test_dflash2_rules(tmp_path, spec, edit, mutate, code):
    assert code in codes(write_draft(tmp_path / "d", spec, edit=edit, mutate=mutate))


def test_top_level_keys_are_named_as_misplaced(tmp_path):
    edit = {"dflash_config": {"mask_token_id": 250, "target_layer_ids": [0, 2], "conv_kernel_size": 3,
                              "conv_group_size": 16, "selector_rank": 16}, "selector_top_k": 4}
    assert {"DSP060", "DSP064"} <= codes(write_draft(tmp_path / "d", SPEC, edit=edit))


def test_selector_tensors_in_a_dflash_draft_are_flagged(tmp_path):
    spec = SPEC.with_(family="qwen3", block_size=8)
    extra = {"candidate_selector.hidden_projection.weight": torch.zeros(16, 64)}
    found = codes(write_draft(tmp_path / "d", spec, mutate=lambda t: {**t, **extra}))
    assert {"DSP211", "DSP205"} <= found
