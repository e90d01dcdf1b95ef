"""Causal and sliding-window draft layers (docs/format.md §2.3), against references written here from the formula:
a query at position q sees the key at position k when q - k < window and, in a causal layer, k <= q, in a
non-causal one k - q < window (vLLM's Triton unified attention, `compute_kv_seq_mask`).

1. one layer's attention equals an explicit masked softmax over the keys the formula keeps (a sliding causal, a
   sliding non-causal and a causal full layer), and a whole draft whose layers differ equals the formula's forward;
2. a window wider than everything the block can reach gives the dense result, a narrower one does not;
3. training's packed, teacher-forced forward (runtime/train/loss.py) sees what inference sees, for the DSpark,
   DFlash and DFlash2 families, so a window draft trains under the mask it drafts with.
Greedy decoding with window drafts is lossless in tests/decode/test_speculative.py.
"""

import pytest
import torch
from ckpt_factory import DraftSpec, draft_config, write_draft

from dspark_cli.runtime.checkpoint.config import DraftConfig, LayerAttention
from dspark_cli.runtime.model.draft import DraftContext, DSparkDraft
from dspark_cli.runtime.model.draft_io import load_draft
from dspark_cli.runtime.model.layers import apply_rope, layer_mask, rope_cos_sin, split_heads
from dspark_cli.runtime.train.loss import block_hidden, build_blocks

SLIDING, FULL = "sliding_attention", "full_attention"
C, Q = 9, 5  # context positions 0..8, the block at 9..13: a window of 3 cuts both the context and the block


def visible(rule: LayerAttention, q: int, k: int) -> bool:
    """The formula for one query position q and one key position k."""
    if rule.window is not None and q - k >= rule.window:
        return False
    if rule.causal:
        return k <= q
    return rule.window is None or k - q < rule.window


def reference_attention(attn, x, context, positions, rule):
    """x [1, Q, H] (normed block input), context [1, C, H], positions [Q] -> [1, Q, H]: per head and query, a softmax
    over the keys `visible` keeps, the context's at 0..C-1 and the block's at its own positions."""
    D, heads, group = attn.head_dim, attn.heads, attn.heads // attn.kv_heads
    key_positions = list(range(context.shape[1])) + positions.tolist()
    q = apply_rope(attn.q_norm(split_heads(attn.q_proj(x), heads, D)), *rope(positions, D))[0]  # [heads, Q, D]
    k_context, v_context = attn.key_value(context, *rope(torch.arange(context.shape[1]), D))
    k_block, v_block = attn.key_value(x, *rope(positions, D))
    keys, values = torch.cat([k_context, k_block], 2)[0], torch.cat([v_context, v_block], 2)[0]  # [kv_heads, C+Q, D]
    out = torch.zeros(x.shape[1], heads, D, dtype=x.dtype)
    for h in range(heads):
        for i, p in enumerate(positions.tolist()):
            keep = [j for j, k in enumerate(key_positions) if visible(rule, p, k)]
            weights = torch.softmax(keys[h // group, keep] @ q[h, i] * D**-0.5, dim=0)  # [kept]
            out[i, h] = weights @ values[h // group, keep]
    return attn.o_proj(out.reshape(1, x.shape[1], heads * D))


def rope(positions, head_dim):
    """[Q] positions -> cos, sin [1, 1, Q, head_dim] at the fixtures' rope_theta, in float64."""
    return rope_cos_sin(positions[None], head_dim, 1e6, torch.float64)


def draft_of(spec: DraftSpec, **config) -> DSparkDraft:
    torch.manual_seed(0)
    return DSparkDraft(DraftConfig.from_dict({**draft_config(spec), **config})).double().eval()


def inputs(draft, seed=0):
    gen = torch.Generator().manual_seed(seed)
    H = draft.config.hidden_size
    return (torch.randn(1, Q, H, generator=gen, dtype=torch.float64),
            torch.randn(1, C, H, generator=gen, dtype=torch.float64), torch.arange(C, C + Q))


@pytest.mark.parametrize("rule", [LayerAttention(3, True), LayerAttention(3, False), LayerAttention(None, True),
                                  LayerAttention(2, False)])
def test_one_layer_equals_the_masked_softmax_of_the_formula(rule):
    draft = draft_of(DraftSpec())
    attn = draft.layers[0].self_attn
    x, context, positions = inputs(draft)
    cos, sin = rope(positions, attn.head_dim)
    kv = attn.key_value(context, *rope(torch.arange(C), attn.head_dim))
    with torch.no_grad():
        got = attn(x, cos, sin, kv, layer_mask(rule, positions[None], C, None))
        expected = reference_attention(attn, x, context, positions, rule)
        dense = attn(x, cos, sin, kv, None)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(got, dense)  # the rule cut some key


def test_a_draft_of_mixed_layers_equals_the_formulas_forward():
    """layer_types [sliding, full, sliding] with a window of 3: causal sliding layers around a dense one."""
    spec = DraftSpec(num_hidden_layers=3)
    draft = draft_of(spec, layer_types=[SLIDING, FULL, SLIDING], sliding_window=3)
    rules = [LayerAttention(3, True), LayerAttention(None, False), LayerAttention(3, True)]
    ids = torch.tensor([[7, 250, 250, 250, 250]])
    _, context, positions = inputs(draft)
    with torch.no_grad():
        got = draft.block_hidden(ids, positions[None], draft.context_kv(context, torch.arange(C)[None]))
        x = draft.embed(ids)
        for layer, rule in zip(draft.layers, rules):
            x = x + reference_attention(layer.self_attn, layer.input_layernorm(x), context, positions, rule)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        expected = draft.norm(x)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_a_window_wider_than_the_block_reaches_gives_the_unwindowed_result(causal):
    """Context 0..8 and block 9..13: a window of 14 covers every key, so the layers run as without a window (a
    dense draft when non-causal, a causal one when causal); a window of 3 changes the result."""
    spec = DraftSpec(num_hidden_layers=2)
    swa = {"layer_types": None, "dflash_config": {"use_swa": True, "causal": causal}}
    unwindowed = draft_of(spec, dflash_config={"causal": causal})
    wide = draft_of(spec, **swa, sliding_window=C + Q)
    narrow = draft_of(spec, **swa, sliding_window=3)
    assert set(wide.config.layer_attention) == {LayerAttention(C + Q, causal)}
    ids = torch.tensor([[7, 250, 250, 250, 250]])
    _, context, positions = inputs(unwindowed)
    kv = unwindowed.context_kv(context, torch.arange(C)[None])
    with torch.no_grad():
        expected = unwindowed.block_hidden(ids, positions[None], kv)
        torch.testing.assert_close(wide.block_hidden(ids, positions[None], kv), expected, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(narrow.block_hidden(ids, positions[None], kv), expected)


def test_a_dense_draft_passes_no_mask_to_its_layers():
    """The shipped drafts are dense: their layers get the caller's mask itself (None in generation), so their
    proposals are bit-identical to before windows existed (tests/model/test_draft_trace.py pins the demo's)."""
    draft = draft_of(DraftSpec())
    assert all(rule.dense for rule in draft.config.layer_attention)
    mask = torch.ones(1, Q, C + Q, dtype=torch.bool)
    assert layer_mask(LayerAttention(None, False), torch.arange(C, C + Q)[None], C, None) is None
    assert layer_mask(LayerAttention(None, False), torch.arange(C, C + Q)[None], C, mask) is mask


FAMILIES = {
    "dspark": DraftSpec(block_size=5, dtype=torch.float32),
    "dflash": DraftSpec(markov_rank=0, confidence=False, block_size=5, dtype=torch.float32),
    "dflash2": DraftSpec(family="dflash2", markov_rank=0, confidence=False, block_size=5, dtype=torch.float32),
}
WINDOWS = {
    "sliding-causal": {"layer_types": [SLIDING, FULL], "sliding_window": 3},
    "swa-non-causal": {"layer_types": None, "is_causal": False, "dflash_config": {"use_swa": True,
                                                                                  "swa_window_size": 3}},
}


@pytest.mark.parametrize("window", sorted(WINDOWS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_sees_what_inference_sees(tmp_path, family, window):
    """Two anchors packed in one training row (the context before each anchor, its block only) against the cached
    context and one block at a time, as generation runs it."""
    spec = FAMILIES[family]
    config = draft_config(spec)
    edits = dict(WINDOWS[window])
    if "dflash_config" in edits:
        edits["dflash_config"] = {**config.get("dflash_config", {}), **edits["dflash_config"]}
    draft = load_draft(write_draft(tmp_path / family, spec, edit=edits))
    assert not all(rule.dense for rule in draft.config.layer_attention)
    K, T, anchors = spec.block_size, 24, [7, 15]
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(1, T, draft.fc.weight.shape[1], generator=gen)
    tokens = torch.randint(0, 240, (1, T), generator=gen)
    layout = draft.config.sample_from_anchor
    blocks = build_blocks(tokens, torch.tensor([anchors]), K, spec.mask_token_id, sample_from_anchor=layout)
    with torch.no_grad():
        trained = block_hidden(draft, features, blocks)[0]  # [A, K, H]
        for a, anchor in enumerate(anchors):
            context = DraftContext(draft, capacity=T)
            context.append(draft, features[0, :anchor])
            ids = blocks.input_ids[:, a * K:(a + 1) * K]
            drafted = draft.block_hidden(ids, context.position_ids(anchor, K), context.kv())[0]  # [K, H]
            torch.testing.assert_close(trained[a], drafted, rtol=1e-5, atol=1e-5)
