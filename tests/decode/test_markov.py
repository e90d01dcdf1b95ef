"""Markov stage strategies (runtime/decode/markov.py): the same tokens from dense, top-k, NVFP4 and fused walks, and
every walk consistent with the distribution it reports (so verification receives the draft's true q)."""

import pytest
import torch
from ckpt_factory import reduced_vocab_d2t

from dspark_cli.kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from dspark_cli.runtime.decode import markov
from dspark_cli.errors import SettingError
from dspark_cli.runtime.decode.markov import MarkovResult, MarkovWeights, draft_to_target
from dspark_cli.runtime.decode.sampling import gumbel_noise, processed_logits
from dspark_cli.runtime.settings import MarkovHead, SamplingParams, resolve_markov

V, VD, R, N = 40, 24, 32, 6  # target vocab, draft vocab (reduced, with d2t), Markov rank, block
ANCHOR = 11
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8)
FILTERED = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)


@pytest.fixture(scope="module")
def weights() -> MarkovWeights:
    """NVFP4 W2 and its exact dequantization, so every strategy multiplies the same numbers."""
    gen = torch.Generator().manual_seed(0)
    w2_nvfp4 = quantize_nvfp4(torch.randn(VD, R, generator=gen))
    return MarkovWeights(
        w1=torch.randn(V, R, generator=gen),
        w2=dequantize_nvfp4(w2_nvfp4, torch.float32),
        w2_nvfp4=w2_nvfp4,
        scale=0.75,
        d2t=reduced_vocab_d2t(VD, V),
    )


@pytest.fixture(scope="module")
def base() -> torch.Tensor:
    return torch.randn(N, VD, generator=torch.Generator().manual_seed(1)) * 2  # [N, Vd]


def noise_for(params: SamplingParams, seed: int = 2):
    return None if params.greedy else gumbel_noise((N, VD), torch.Generator().manual_seed(seed))


def target_ids(weights: MarkovWeights, draft_ids: torch.Tensor) -> torch.Tensor:
    return draft_ids + weights.d2t[draft_ids]


def markov_walk(strategy, weights, base, anchor, params, noise=None, draft_topk=None) -> MarkovResult:
    """One block through the batch-first walk: base [N, Vd], noise [N, Vd] -> the request's result ([N], ...)."""
    batched = markov.markov_walk(strategy, weights, base[None], torch.tensor([anchor]), params,
                                 None if noise is None else noise[None], draft_topk)
    embeds = None if batched.embeds is None else batched.embeds[0]
    return MarkovResult(tokens=batched.tokens[0], logits=batched.logits[0], embeds=embeds)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "gumbel"])
def test_every_strategy_with_all_candidates_equals_dense(weights, base, params):
    noise = noise_for(params)
    dense = markov_walk("dense", weights, base, ANCHOR, params, noise)
    for strategy in ("topk", "nvfp4", "fused"):
        walk = markov_walk(strategy, weights, base, ANCHOR, params, noise, draft_topk=VD)
        assert walk.tokens.tolist() == dense.tokens.tolist(), strategy
        torch.testing.assert_close(walk.logits, dense.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(walk.embeds, dense.embeds)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "gumbel"])
def test_gathered_strategies_agree_and_keep_only_the_candidates(weights, base, params):
    k = 5
    noise = noise_for(params)
    walks = {s: markov_walk(s, weights, base, ANCHOR, params, noise, draft_topk=k) for s in ("topk", "nvfp4", "fused")}
    reference = walks["topk"]
    candidates = base.topk(k, dim=-1).indices  # [N, k]: fixed by the base logits, before the walk
    for strategy, walk in walks.items():
        assert walk.tokens.tolist() == reference.tokens.tolist(), strategy
        finite = torch.isfinite(walk.logits)
        assert finite.sum(-1).tolist() == [k] * N
        assert finite.gather(-1, candidates).all()
        torch.testing.assert_close(walk.logits, reference.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "strategy, params",
    [(s, p) for s in ("dense", "topk", "nvfp4") for p in (GREEDY, SAMPLED, FILTERED)]
    + [("fused", GREEDY), ("fused", SAMPLED)],  # the fused walk refuses top-k / top-p (resolve_markov)
)
def test_walk_samples_from_the_distribution_it_reports(weights, base, strategy, params):
    """token_i = argmax(processed(logits_i) + g_i) is an exact sample of q_i = target_probs(logits_i)
    (Gumbel-max), and logits_i = base_i + scale * W2 @ W1[prev_i] (restricted to the candidates) with
    prev_i the previous token: so the q handed to verification is the draft's true distribution."""
    k = 7
    noise = noise_for(params)
    walk = markov_walk(strategy, weights, base, ANCHOR, params, noise, draft_topk=k)
    prev = torch.cat([torch.tensor([ANCHOR]), walk.tokens[:-1]])  # [N] target ids
    torch.testing.assert_close(walk.embeds, weights.w1[prev])
    expected = base + weights.scale * (weights.w1[prev] @ weights.w2.T)  # [N, Vd]
    if strategy != "dense":
        keep = torch.zeros_like(expected, dtype=torch.bool).scatter_(-1, base.topk(k, dim=-1).indices, True)
        expected = expected.masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(walk.logits, expected, rtol=1e-5, atol=1e-5)
    if params.greedy:
        picks = walk.logits.argmax(-1)
    else:
        picks = (processed_logits(walk.logits, params) + noise).argmax(-1)
    assert walk.tokens.tolist() == target_ids(weights, picks).tolist()


@pytest.mark.parametrize("strategy", ["dense", "topk", "nvfp4", "fused"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "gumbel"])
def test_a_batch_walks_each_request_as_if_alone(weights, strategy, params):
    """B = 3 blocks with their own base logits, anchors and noise: each row of the batched walk is that
    request's own walk (no request reads another's previous token)."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(3, N, VD, generator=gen) * 2  # [B, N, Vd]
    anchors = torch.tensor([ANCHOR, 3, 29])
    noise = None if params.greedy else gumbel_noise((3, N, VD), gen)
    batched = markov.markov_walk(strategy, weights, base, anchors, params, noise, draft_topk=7)
    assert batched.tokens.shape == (3, N) and batched.embeds.shape == (3, N, R)
    for b in range(3):
        alone = markov_walk(strategy, weights, base[b], int(anchors[b]), params,
                            None if noise is None else noise[b], draft_topk=7)
        assert batched.tokens[b].tolist() == alone.tokens.tolist(), (strategy, b)
        torch.testing.assert_close(batched.logits[b], alone.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batched.embeds[b], alone.embeds)


def test_draft_to_target_adds_the_offsets_of_the_draft_ids():
    d2t = torch.tensor([2, 2, 5])  # draft ids 0, 1, 2 -> target ids 2, 3, 7
    assert draft_to_target(d2t, torch.tensor([[2, 0], [1, 1]])).tolist() == [[7, 2], [3, 3]]
    assert draft_to_target(None, torch.tensor([2, 0])).tolist() == [2, 0]  # full vocabulary: the same ids


def test_draft_without_markov_head_picks_each_position_from_its_base_logits(base):
    greedy = markov_walk("dense", None, base, ANCHOR, GREEDY)
    assert greedy.tokens.tolist() == base.argmax(-1).tolist()
    assert greedy.embeds is None
    noise = noise_for(SAMPLED)
    sampled = markov_walk("dense", None, base, ANCHOR, SAMPLED, noise)
    assert sampled.tokens.tolist() == (base / SAMPLED.temperature + noise).argmax(-1).tolist()
    torch.testing.assert_close(sampled.logits, base)


def test_sampling_without_noise_is_refused(weights, base):
    with pytest.raises(ValueError, match="Gumbel noise"):
        markov_walk("dense", weights, base, ANCHOR, SAMPLED)


@pytest.mark.parametrize(
    "requested, topk, nvfp4, params, cuda, expected",
    [
        ("auto", None, True, GREEDY, True, "dense"),  # no --draft-topk: the dense stage
        ("auto", 8, False, GREEDY, False, "topk"),
        ("auto", 8, True, GREEDY, False, "nvfp4"),
        ("auto", 8, True, SAMPLED, True, "fused"),
        ("auto", 8, False, FILTERED, True, "topk"),  # fused cannot apply top-k / top-p
        ("dense", 8, True, FILTERED, True, "dense"),
        ("fused", 8, False, GREEDY, False, "fused"),  # the fused walk's torch twin runs on CPU too
    ],
)
def test_resolve_markov(requested, topk, nvfp4, params, cuda, expected):
    assert resolve_markov(requested, MarkovHead(True, nvfp4=nvfp4), topk, params, cuda) == expected


def test_resolve_markov_without_markov_head_is_dense():
    assert resolve_markov("auto", MarkovHead(False), 8, GREEDY, True) == "dense"


@pytest.mark.parametrize(
    "requested, topk, nvfp4, params, message",
    [
        ("sparse", 8, True, GREEDY, "must be one of auto, dense"),
        ("topk", None, True, GREEDY, "give a draft top-k"),
        ("nvfp4", 8, False, GREEDY, "markov_w2 is NVFP4"),
        ("fused", 8, True, FILTERED, "applies only a temperature"),
    ],
)
def test_resolve_markov_errors_name_the_fix(requested, topk, nvfp4, params, message):
    with pytest.raises(SettingError, match=message):
        resolve_markov(requested, MarkovHead(True, nvfp4=nvfp4), topk, params, False)
