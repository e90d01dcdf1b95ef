"""The Gated DeltaNet score pass (model/gdn_scoring.py): dspark's own forward of a Qwen3.5 / Qwen3-Next mixer during
a score pass, and its rollback as a copy of the state at the kept position.

- the kernel: one unpadded chunk gives transformers' chunked kernel's outputs and final state, and the state after
  every position equals transformers' one-token recurrent kernel stepped to that position;
- on the tiny random targets of every Gated DeltaNet family: the score pass's logits equal transformers' chunked
  forward's, and after scoring 6 tokens and keeping j (every j), every cache tensor (from transformers 5.25 the
  layers' position counts too) equals a fresh target's that read only the kept prefix, and so does the cache length
  transformers reads;
- the scheme: no snapshot and no mixer replay on these targets, and dspark's forward runs only inside score().
"""

from __future__ import annotations

import inspect

import pytest
import torch
from stateful_factory import tiny_stateful_model
from test_stateful_targets import BLOCK, PROMPT, cache_tensors, reference_cache

from dspark_cli.runtime.model import gdn_scoring, target_state
from dspark_cli.runtime.model.gdn_scoring import delta_rule_block, is_gated_deltanet
from dspark_cli.runtime.model.target import TargetModel

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
GDN_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


@pytest.fixture(scope="module")
def models():
    return {family: tiny_stateful_model(family) for family in GDN_FAMILIES}


def random_block(length: int, key_heads: int, heads: int, dim: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(length, key_heads, dim, generator=generator)  # [T, Hk, Dk]
    key = torch.randn(length, key_heads, dim, generator=generator)
    value = torch.randn(length, heads, dim, generator=generator)  # [T, H, Dv]
    g = -torch.rand(length, heads, generator=generator) * 2  # log decay <= 0
    beta = torch.rand(length, heads, generator=generator)
    start = torch.randn(heads, dim, dim, generator=generator) * 0.3  # S0 [H, Dk, Dv]
    return query, key, value, g, beta, start


@pytest.mark.parametrize("length", [1, 2, 5, 9, 70])
def test_one_unpadded_chunk_matches_transformers_kernels_at_every_position(length):
    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                              torch_recurrent_gated_delta_rule)

    query, key, value, g, beta, start = random_block(length, 2, 4, 16)
    out, block = delta_rule_block(query, key, value, g, beta, start)  # grouped: each q/k head serves 2 value heads
    query, key = (x.repeat_interleave(2, dim=1) for x in (query, key))  # 5.17's kernels leave that to the mixer
    chunked, final = torch_chunk_gated_delta_rule(query[None], key[None], value[None], g=g[None], beta=beta[None],
                                                  initial_state=start[None], output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)  # padded to 64 positions
    torch.testing.assert_close(out, chunked[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block.state_after(length), final[0], rtol=1e-5, atol=1e-5)
    state = start[None]
    torch.testing.assert_close(block.state_after(0), start)
    for position in range(length):  # the one-token kernel plain decoding uses, stepped position by position
        step = slice(position, position + 1)
        _, state = torch_recurrent_gated_delta_rule(query[None, step], key[None, step], value[None, step],
                                                    g=g[None, step], beta=beta[None, step], initial_state=state,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(block.state_after(position + 1), state[0], rtol=1e-5, atol=1e-5,
                                   msg=lambda text: f"state after {position + 1} of {length}: {text}")


def gdn_states(cache) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in cache_tensors(cache).items() if "_states." in name}


@pytest.mark.parametrize("family", GDN_FAMILIES)
def test_score_pass_logits_equal_the_chunked_forward_and_the_cache_ends_after_the_block(models, family):
    model = models[family]
    target = TargetModel(model, (1,))
    assert target.state.gated_deltanet is not None and target.state.replay is None
    target.prefill(torch.tensor(PROMPT))
    logits, _ = target.score(torch.tensor(BLOCK))
    reference = TargetModel(model)  # transformers' own forward: dspark's runs only inside score()
    reference.prefill_plain(torch.tensor(PROMPT))
    with torch.inference_mode():
        expected = reference._forward(torch.tensor(BLOCK), capture=False)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    ours, theirs = gdn_states(target.cache), gdn_states(reference.cache)
    assert ours.keys() == theirs.keys() and len(ours) >= 4
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-5, msg=lambda text: f"{name}: {text}")


@pytest.mark.parametrize("family", GDN_FAMILIES)
def test_keeping_any_prefix_leaves_the_state_of_a_fresh_target_that_read_only_it(models, family):
    model = models[family]
    target = TargetModel(model, (1,))
    for keep in range(len(BLOCK) + 1):
        target.prefill(torch.tensor(PROMPT))
        target.score(torch.tensor(BLOCK))
        target.crop(len(PROMPT) + keep)
        # the cache length transformers reads (positions when none are passed; 5.25 answers from layer 0's count)
        assert target.cache.get_seq_length() == len(PROMPT) + keep
        tensors, expected = cache_tensors(target.cache), reference_cache(model, PROMPT + BLOCK[:keep])
        assert tensors.keys() == expected.keys()
        for name, reference in expected.items():
            torch.testing.assert_close(tensors[name], reference, rtol=1e-5, atol=1e-5,
                                       msg=lambda text: f"{family} keep={keep} {name}: {text}")
        fresh = TargetModel(model)
        fresh.prefill_plain(torch.tensor(PROMPT + BLOCK[:keep]))
        torch.testing.assert_close(target.decode_one(50), fresh.decode_one(50), rtol=1e-5, atol=1e-5)


def test_two_rounds_in_a_row_continue_from_the_kept_state(models):
    """A second score pass starts from the state the first one's rollback left (not from the block's end)."""
    model = models["qwen3_5"]
    target = TargetModel(model, (1,))
    target.prefill(torch.tensor(PROMPT))
    target.score(torch.tensor(BLOCK))
    target.crop(len(PROMPT) + 2)
    second = [BLOCK[1], 7, 300, 4]
    logits, _ = target.score(torch.tensor(second))
    target.crop(len(PROMPT) + 3)
    committed = PROMPT + BLOCK[:2]
    with torch.no_grad():
        exact = model(input_ids=torch.tensor([committed + second]), use_cache=False).logits[0, len(committed):]
    torch.testing.assert_close(logits, exact, rtol=1e-4, atol=1e-4)
    tensors, expected = cache_tensors(target.cache), reference_cache(model, committed + second[:1])
    for name, reference in expected.items():
        torch.testing.assert_close(tensors[name], reference, rtol=1e-5, atol=1e-5, msg=lambda text: f"{name}: {text}")


def test_no_snapshot_no_replay_and_dspark_forward_only_inside_score(models, monkeypatch):
    target = TargetModel(models["qwen3_5"], (1,))
    taken, scored = [], []
    original_take, original_score = target_state.StateSnapshot.take, gdn_scoring.score_mixer
    monkeypatch.setattr(target_state.StateSnapshot, "take",
                        classmethod(lambda cls, cache: taken.append(1) or original_take(cache)))
    monkeypatch.setattr(gdn_scoring, "score_mixer", lambda *args: scored.append(1) or original_score(*args))
    target.prefill(torch.tensor(PROMPT))
    target.decode_one(3)
    assert scored == []  # prefill and plain decoding run transformers' own forward
    target.save_state()
    target.score(torch.tensor(BLOCK))
    target.crop(len(PROMPT) + 2)
    assert len(scored) == 3 and taken == []  # the tiny Qwen3.5 has 3 Gated DeltaNet layers


def test_only_gated_deltanet_mixers_are_taken_over(models):
    lfm2 = tiny_stateful_model("lfm2")
    target = TargetModel(lfm2, (1,))
    assert target.state.gated_deltanet is None and target.state.replay is not None
    assert not any(is_gated_deltanet(module) for module in lfm2.modules())
    assert sum(is_gated_deltanet(module) for module in models["qwen3_next"].modules()) == 3


def test_targets_built_on_one_model_share_one_forward_and_keep_their_own_blocks(models):
    model = models["qwen3_next"]
    first, second = TargetModel(model, (1,)), TargetModel(model, (1,))
    for mixer in first.state.gated_deltanet.mixers:  # one routing forward around transformers' own, not two nested
        assert inspect.getclosurevars(mixer.forward).nonlocals["original"].__func__ is type(mixer).forward
    first.prefill(torch.tensor(PROMPT))
    second.prefill(torch.tensor(PROMPT[:5]))
    first.score(torch.tensor(BLOCK))
    second.score(torch.tensor(BLOCK[:3]))
    first.crop(len(PROMPT) + 1)
    second.crop(5 + 2)
    for target, ids in ((first, PROMPT + BLOCK[:1]), (second, PROMPT[:5] + BLOCK[:2])):
        for name, reference in reference_cache(model, ids).items():
            torch.testing.assert_close(cache_tensors(target.cache)[name], reference, rtol=1e-5, atol=1e-5)
