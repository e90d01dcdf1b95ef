"""Markov kernels against their torch twins under the Triton interpreter, and the twins against the
dense Markov formula logits_i = base_i + alpha * W2 @ W1[prev]."""

import pytest
import torch

from dspark_cli.kernels import triton_available
from dspark_cli.kernels.markov import (
    gathered_bias_reference,
    markov_walk,
    markov_walk_reference,
    markov_walk_triton,
    nvfp4_gathered_bias,
    nvfp4_gathered_bias_reference,
)
from dspark_cli.kernels.nvfp4 import NVFP4Weight, quantize_nvfp4

ALPHA = 0.75


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_candidates(batch: int, n_steps: int, topk: int, vocab: int, seed: int) -> torch.Tensor:
    """Distinct draft ids per (request, position): int64 [B, N, k]."""
    gen = generator(seed)
    rows = [torch.randperm(vocab, generator=gen)[:topk] for _ in range(batch * n_steps)]
    return torch.stack(rows).view(batch, n_steps, topk)


def gathered_inputs(batch: int, topk: int, rank: int, vocab: int, seed: int):
    gen = generator(seed)
    w2 = torch.randn(vocab, rank, generator=gen).bfloat16()
    embed = torch.randn(batch, rank, generator=gen).bfloat16()
    values = torch.randn(batch, topk, generator=gen).bfloat16()
    index = random_candidates(batch, 1, topk, vocab, seed)[:, 0]
    return w2, embed, values, index


def minus_inf(batch: int, vocab: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((batch, vocab), float("-inf"), dtype=dtype)


@pytest.mark.parametrize("batch, topk, rank", [(1, 4, 16), (2, 16, 32), (3, 40, 64)])
def test_nvfp4_gathered_bias_matches_reference(batch, topk, rank):
    w2, embed, values, index = gathered_inputs(batch, topk, rank, vocab=256, seed=topk)
    weight = quantize_nvfp4(w2)
    values_before = values.clone()
    ours, theirs = minus_inf(batch, 256), minus_inf(batch, 256)
    nvfp4_gathered_bias(embed, weight, values, index, ours, ALPHA)
    nvfp4_gathered_bias_reference(embed, weight, values, index, theirs, ALPHA)
    assert torch.equal(values, values_before)
    selected = torch.zeros(batch, 256, dtype=torch.bool).scatter_(1, index, True)
    assert torch.isfinite(ours[selected]).all()
    assert torch.all(ours[~selected] == float("-inf")) and torch.all(theirs[~selected] == float("-inf"))
    assert torch.allclose(ours[selected], theirs[selected], rtol=1e-5, atol=1e-5)


def test_nvfp4_gathered_bias_bf16_logits_within_one_ulp():
    # The interpreter truncates the float32 -> bf16 store instead of rounding to nearest.
    w2, embed, values, index = gathered_inputs(2, 16, 64, vocab=256, seed=5)
    weight = quantize_nvfp4(w2)
    ours, exact = minus_inf(2, 256, torch.bfloat16), minus_inf(2, 256)
    nvfp4_gathered_bias(embed, weight, values, index, ours, ALPHA)
    nvfp4_gathered_bias_reference(embed, weight, values, index, exact, ALPHA)
    selected = torch.isfinite(exact)
    assert torch.allclose(ours.float()[selected], exact[selected], rtol=2**-7, atol=1e-6)
    assert torch.all(ours.float()[~selected] == float("-inf"))


@pytest.mark.parametrize("layout", ["row of a [B, N, V] buffer", "transposed [V, B] buffer"])
def test_nvfp4_gathered_bias_writes_through_strided_views(layout):
    w2, embed, values, index = gathered_inputs(3, 16, 32, vocab=128, seed=7)
    weight = quantize_nvfp4(w2)
    if layout == "row of a [B, N, V] buffer":
        buffer = torch.full((3, 4, 128), float("-inf"))
        view = buffer[:, 2]
    else:
        buffer = torch.full((128, 3), float("-inf"))
        view = buffer.t()
    expected = minus_inf(3, 128)
    nvfp4_gathered_bias(embed, weight, values, index, view, ALPHA)
    nvfp4_gathered_bias_reference(embed, weight, values, index, expected, ALPHA)
    assert torch.allclose(view, expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(buffer).sum() == 3 * 16  # nothing outside the view was written


def test_gathered_bias_with_every_id_equals_dense():
    vocab, rank = 128, 32
    gen = generator(11)
    w2 = torch.randn(vocab, rank, generator=gen)
    embed = torch.randn(2, rank, generator=gen)
    base = torch.randn(2, vocab, generator=gen)
    index = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(2)])  # k = Vd, shuffled
    values = base.gather(1, index)
    weight = quantize_nvfp4(w2)
    dense_nvfp4 = base + ALPHA * (embed @ weight.dequantize().T)  # [2, Vd]
    dense_bf16 = base + ALPHA * (embed @ w2.bfloat16().float().T)
    cases = [
        (nvfp4_gathered_bias, weight, dense_nvfp4),
        (nvfp4_gathered_bias_reference, weight, dense_nvfp4),
        (gathered_bias_reference, w2.bfloat16(), dense_bf16),
    ]
    for gathered, w, dense in cases:
        logits = minus_inf(2, vocab)
        gathered(embed, w, values, index, logits, ALPHA)
        assert torch.allclose(logits, dense, rtol=1e-5, atol=1e-5), gathered.__name__


@pytest.mark.parametrize("gathered", [nvfp4_gathered_bias, nvfp4_gathered_bias_reference])
def test_gathered_bias_rejects_other_group_sizes(gathered):
    w2, embed, values, index = gathered_inputs(1, 4, 32, vocab=64, seed=0)
    weight = quantize_nvfp4(w2)
    group_of_32 = NVFP4Weight(weight.packed, weight.scale[:, :1], weight.global_scale)
    with pytest.raises(ValueError, match="group size of 16"):
        gathered(embed, group_of_32, values, index, minus_inf(1, 64), ALPHA)


def walk_inputs(batch, n_steps, topk, rank, *, draft_vocab=512, vocab=1024, seed=0):
    gen = generator(seed)
    base = torch.randn(batch, n_steps, topk, generator=gen) * 2
    cand = random_candidates(batch, n_steps, topk, draft_vocab, seed)
    first_prev = torch.randint(0, vocab, (batch,), generator=gen)
    w1 = torch.randn(vocab, rank, generator=gen).bfloat16()
    w2 = (torch.randn(draft_vocab, rank, generator=gen) * 0.5).bfloat16()
    d2t = torch.randint(0, vocab - draft_vocab, (draft_vocab,), generator=gen)  # target id = draft id + offset
    gumbel = -torch.log(-torch.log(torch.rand(batch, n_steps, topk, generator=gen)))
    return base, cand, first_prev, w1, w2, d2t, gumbel


@pytest.mark.parametrize("w2_format", ["bf16", "nvfp4"])
@pytest.mark.parametrize("sampling", ["greedy", "gumbel"])
@pytest.mark.parametrize("with_d2t", [False, True])
@pytest.mark.parametrize("batch, topk, rank", [(1, 4, 16), (3, 16, 64), (2, 5, 32)])
def test_markov_walk_triton_matches_reference(w2_format, sampling, with_d2t, batch, topk, rank):
    base, cand, first_prev, w1, w2, d2t, gumbel = walk_inputs(batch, 6, topk, rank, seed=batch * topk + rank)
    w2 = quantize_nvfp4(w2) if w2_format == "nvfp4" else w2
    kwargs = dict(d2t=d2t if with_d2t else None)
    if sampling == "gumbel":
        kwargs.update(gumbel=gumbel, temperature=0.8)
    tokens, corrected = markov_walk_triton(base, cand, first_prev, w1, w2, ALPHA, **kwargs)
    ref_tokens, ref_corrected = markov_walk_reference(base, cand, first_prev, w1, w2, ALPHA, **kwargs)
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(corrected, ref_corrected, rtol=1e-5, atol=1e-5)


def test_markov_walk_dense_inputs_with_odd_rank_and_strided_candidates():
    # rank 48 and k 5 are not powers of two; base and cand are non-contiguous views
    base, cand, first_prev, w1, w2, d2t, _ = walk_inputs(2, 4, 10, 48, seed=3)
    base, cand = base[..., ::2], cand[..., ::2]
    tokens, corrected = markov_walk_triton(base, cand, first_prev, w1, w2.float(), ALPHA, d2t=d2t)
    ref_tokens, ref_corrected = markov_walk_reference(base, cand, first_prev, w1, w2.float(), ALPHA, d2t=d2t)
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(corrected, ref_corrected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("w2_format", ["bf16", "nvfp4"])
def test_markov_walk_with_every_candidate_is_dense_greedy_decoding(w2_format):
    """k = Vd, identity d2t: the walk must equal argmax(base_i + alpha * W2 @ W1[prev]) step by step."""
    vocab, rank, n_steps = 64, 16, 5
    gen = generator(21)
    base_full = torch.randn(2, n_steps, vocab, generator=gen)
    w1 = torch.randn(vocab, rank, generator=gen)
    w2 = torch.randn(vocab, rank, generator=gen)
    weight = quantize_nvfp4(w2) if w2_format == "nvfp4" else w2
    w2_dense = weight.dequantize() if w2_format == "nvfp4" else w2
    order = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(2 * n_steps)]).view(2, n_steps, vocab)
    first_prev = torch.tensor([3, 60])
    prev, expected = first_prev, []
    for i in range(n_steps):
        prev = (base_full[:, i] + ALPHA * (w1[prev] @ w2_dense.T)).argmax(-1)
        expected.append(prev)
    for walk in (markov_walk_reference, markov_walk_triton):
        tokens, corrected = walk(base_full.gather(2, order), order, first_prev, w1, weight, ALPHA)
        assert torch.equal(tokens, torch.stack(expected, 1)), walk.__name__


@pytest.mark.parametrize("walk", [markov_walk_reference, markov_walk_triton])
def test_markov_walk_ties_pick_the_lowest_candidate(walk):
    base, cand, first_prev, w1, _, _, gumbel = walk_inputs(2, 3, 8, 16, seed=4)
    zero_w2 = torch.zeros(512, 16)
    tokens, _ = walk(torch.zeros_like(base), cand, first_prev, w1, zero_w2, ALPHA)
    assert torch.equal(tokens, cand[..., 0])
    no_noise = torch.zeros_like(gumbel)
    tokens, _ = walk(torch.zeros_like(base), cand, first_prev, w1, zero_w2, ALPHA, gumbel=no_noise, temperature=0.5)
    assert torch.equal(tokens, cand[..., 0])


@pytest.mark.parametrize("walk", [markov_walk_reference, markov_walk_triton])
def test_markov_walk_temperature_zero_is_greedy(walk):
    base, cand, first_prev, w1, w2, d2t, gumbel = walk_inputs(3, 4, 16, 32, seed=8)
    greedy = walk(base, cand, first_prev, w1, w2, ALPHA, d2t=d2t)
    cold = walk(base, cand, first_prev, w1, w2, ALPHA, d2t=d2t, gumbel=gumbel, temperature=0.0)
    hot = walk(base, cand, first_prev, w1, w2, ALPHA, d2t=d2t, gumbel=gumbel * 50, temperature=1.0)
    assert torch.equal(greedy[0], cold[0])
    assert not torch.equal(greedy[0], hot[0])


def test_markov_walk_reference_step_semantics():
    """One request, two steps, checked by hand: the second step's embedding is W1 of the first token."""
    base, cand, first_prev, w1, w2, d2t, _ = walk_inputs(1, 2, 4, 16, seed=9)
    tokens, corrected = markov_walk_reference(base, cand, first_prev, w1, w2, ALPHA, d2t=d2t)
    prev = first_prev[0]
    for i in range(2):
        expected = base[0, i] + ALPHA * (w2[cand[0, i]].float() @ w1[prev].float())
        assert torch.allclose(corrected[0, i], expected, rtol=1e-6, atol=1e-6)
        draft = cand[0, i, expected.argmax()]
        prev = draft + d2t[draft]
        assert tokens[0, i] == prev


def test_markov_walk_dispatches_to_reference_on_cpu():
    base, cand, first_prev, w1, w2, _, _ = walk_inputs(1, 2, 4, 16, seed=10)
    assert not triton_available(base)
    tokens, corrected = markov_walk(base, cand, first_prev, w1, w2, ALPHA)
    assert torch.equal(tokens, markov_walk_reference(base, cand, first_prev, w1, w2, ALPHA)[0])


def test_markov_walk_rejects_mismatched_shapes():
    base, cand, first_prev, w1, w2, d2t, _ = walk_inputs(2, 3, 4, 16, seed=12)
    with pytest.raises(ValueError, match="disagree on r"):
        markov_walk_reference(base, cand, first_prev, w1, w2[:, :8], ALPHA)
    with pytest.raises(ValueError, match="d2t"):
        markov_walk_reference(base, cand, first_prev, w1, w2, ALPHA, d2t=d2t[:10])
    with pytest.raises(ValueError, match="first_prev"):
        markov_walk_triton(base, cand, first_prev[:1], w1, w2, ALPHA)
