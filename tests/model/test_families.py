"""Draft families (Qwen3, Gemma-4) and Markov head types (vanilla, gated, rnn), pinned against references written
here from DeepSpec's definitions (docs/format.md §3.6, §6), independently of runtime/model/:

1. the Gemma-4 block forward (context K/V, the query block, soft-capped logits) equals `gemma4_reference`;
2. the walk's tokens, q and confidences equal DeepSpec's `sample_block_tokens` semantics (`walk_reference`) for
   every head type, dense and top-k (k = Vd), greedy and sampled with the same Gumbel noise;
3. greedy speculative decoding is token-identical to the target's own greedy decoding for a Gemma-4 pair and for
   gated / RNN drafts (float32), for several strategies and block sizes;
4. validate checks Gemma-4 drafts with their own rules (DSP040-DSP047) and keeps DSP012 for gated / RNN heads.

scripts/deepspec_parity.py runs the same comparisons against DeepSpec's own modules (docs/format.md §6.4).
"""

import math

import pytest
from loop import generate
import torch
import torch.nn.functional as F
from ckpt_factory import DraftSpec, drop, target_config, write_draft
from pair_factory import bigram_draft, bigram_target

from dspark_cli.runtime.checkpoint.families import FAMILIES
from dspark_cli.runtime.checkpoint.heads import HEAD_TYPES
from dspark_cli.runtime.checkpoint.read import open_checkpoint
from dspark_cli.runtime.checkpoint.rules import validate_checkpoint
from dspark_cli.runtime.decode import sampling
from dspark_cli.runtime.decode.markov import MarkovWeights, markov_walk
from dspark_cli.errors import SettingError
from dspark_cli.runtime.settings import MarkovHead, resolve_markov
from dspark_cli.runtime.settings import SamplingParams
from dspark_cli.runtime.decode.speculative import Drafter, draft_backbone, markov_stage
from dspark_cli.runtime.model.draft import DraftContext
from dspark_cli.runtime.model.draft_io import load_draft
from dspark_cli.runtime.model.families import BACKBONES
from dspark_cli.runtime.model.heads import HEADS
from dspark_cli.runtime.model.target import TargetModel

F32 = torch.float32
GEMMA = DraftSpec(family="gemma4", dtype=F32)


def test_every_family_and_head_type_is_registered_on_both_sides():
    assert set(BACKBONES) == set(FAMILIES)
    assert set(HEADS) == set(HEAD_TYPES) and all(cls.type_name == name for name, cls in HEADS.items())


# --- 1. the Gemma-4 block forward -------------------------------------------------------------------------------


def _rms(x, weight, eps=1e-6):
    y = x * (x.pow(2).mean(-1, keepdim=True) + eps) ** -0.5
    return y if weight is None else y * weight


def _rope(x, positions, dim, theta, partial):
    """Gemma-4 proportional RoPE on x [heads, T, D] at positions [T] (rotate-half layout)."""
    rotated = int(partial * dim // 2)
    inv = torch.zeros(dim // 2)
    inv[:rotated] = theta ** (-torch.arange(rotated) * 2.0 / dim)
    angles = positions[:, None].float() * inv  # [T, D/2]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def gemma4_reference(t: dict, spec: DraftSpec, features: torch.Tensor, ids: torch.Tensor) -> tuple:
    """DeepSpec Gemma4DSparkModel._forward_backbone + compute_logits for one block, from the tensors `t`.
    features [C, n*H] at positions 0..C-1, ids [Q] at C..C+Q-1 -> (hidden [Q, H], logits [Q, V])."""
    H, D, heads = spec.hidden_size, spec.global_head_dim, spec.num_attention_heads
    kv_heads = spec.num_global_key_value_heads if spec.attention_k_eq_v else spec.num_key_value_heads
    C, Q = features.shape[0], ids.shape[0]
    x = t["embed_tokens.weight"][ids] * math.sqrt(H)
    context = _rms(features @ t["fc.weight"].T, t["hidden_norm.weight"])
    positions = torch.arange(C + Q)
    for i in range(spec.num_hidden_layers):
        p = f"layers.{i}."
        normed = _rms(x, t[p + "input_layernorm.weight"])
        stream = torch.cat([context, normed])  # [C+Q, H]: keys and values of context then block
        k = (stream @ t[p + "self_attn.k_proj.weight"].T).view(C + Q, kv_heads, D).transpose(0, 1)
        v = k if spec.attention_k_eq_v else (stream @ t[p + "self_attn.v_proj.weight"].T).view(
            C + Q, kv_heads, D).transpose(0, 1)
        v = _rms(v, None)  # weightless v_norm, no RoPE; with attention_k_eq_v the values are the keys' projection
        k = _rope(_rms(k, t[p + "self_attn.k_norm.weight"]), positions, D, 1e6, 0.25)
        q = (normed @ t[p + "self_attn.q_proj.weight"].T).view(Q, heads, D).transpose(0, 1)
        q = _rope(_rms(q, t[p + "self_attn.q_norm.weight"]), positions[C:], D, 1e6, 0.25)
        k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
        scores = torch.softmax(q @ k.transpose(1, 2), -1)  # scale 1.0, nothing masked
        attn = (scores @ v).transpose(0, 1).reshape(Q, heads * D) @ t[p + "self_attn.o_proj.weight"].T
        x = x + _rms(attn, t[p + "post_attention_layernorm.weight"])
        h = _rms(x, t[p + "pre_feedforward_layernorm.weight"])
        mlp = F.gelu(h @ t[p + "mlp.gate_proj.weight"].T, approximate="tanh") * (h @ t[p + "mlp.up_proj.weight"].T)
        x = (x + _rms(mlp @ t[p + "mlp.down_proj.weight"].T, t[p + "post_feedforward_layernorm.weight"]))
        x = x * t[p + "layer_scalar"]
    hidden = _rms(x, t["norm.weight"])
    raw = hidden @ t["lm_head.weight"].T
    return hidden, torch.tanh(raw / 30.0) * 30.0


def _tensors(path):
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}


def _draft_block(draft, features, ids):
    """dspark's path: the cached context K/V, then one query block -> (hidden [Q, H], base logits [Q, V])."""
    context = DraftContext(draft, capacity=features.shape[0] + ids.shape[0])
    context.append(draft, features)
    with torch.inference_mode():
        positions = context.position_ids(features.shape[0], ids.shape[0])
        hidden = draft.block_hidden(ids[None], positions, context.kv())[0]
        return hidden, draft.base_logits(hidden)


@pytest.mark.parametrize("k_eq_v", [True, False])
def test_gemma4_block_forward_equals_the_reference(tmp_path, k_eq_v):
    spec = GEMMA.with_(seed=3, attention_k_eq_v=k_eq_v)
    path = write_draft(tmp_path / "g", spec)
    draft = load_draft(path)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(9, 2 * spec.hidden_size, generator=gen)
    ids = torch.tensor([17] + [spec.mask_token_id] * (spec.block_size - 1))
    hidden, logits = _draft_block(draft, features, ids)
    ref_hidden, ref_logits = gemma4_reference(_tensors(path), spec, features, ids)
    assert torch.allclose(hidden, ref_hidden, atol=1e-5, rtol=0), (hidden - ref_hidden).abs().max()
    assert torch.allclose(logits, ref_logits, atol=1e-4, rtol=0), (logits - ref_logits).abs().max()
    assert ref_logits.abs().max() > 10  # the soft-cap (30) is far from the identity on these logits


# --- 2. the walk per head type -----------------------------------------------------------------------------------


def walk_reference(t: dict, head: str, base, hidden, anchor: int, temperature: float, noise):
    """DeepSpec's sample_block_tokens (markov_head.py) for one block, with the Gumbel noise dspark draws in place
    of torch.multinomial, and the confidence head of predict_confidence_step. base [N, V], hidden [N, H]
    -> tokens [N], corrected logits [N, V], confidences [N]."""
    w1, w2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    state = torch.zeros(w1.shape[1])
    prev, tokens, rows, confidences = anchor, [], [], []
    for k in range(base.shape[0]):
        e, h = w1[prev], hidden[k]
        if head == "vanilla":
            u = e
        elif head == "gated":
            gate = t["markov_head.gate_proj.weight"] @ torch.cat([h, e]) + t["markov_head.gate_proj.bias"]
            u = torch.sigmoid(gate) * e
        else:
            gate, candidate, output = (t["markov_head.joint_proj.weight"] @ torch.cat([state, e, h])
                                       + t["markov_head.joint_proj.bias"]).chunk(3)
            state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(candidate)
            u = torch.tanh(output)
        row = base[k] + w2 @ u
        confidences.append(torch.sigmoid(t["confidence_head.proj.weight"][0] @ torch.cat([h, e])
                                         + t["confidence_head.proj.bias"][0]))
        prev = int(row.argmax() if temperature == 0 else (row / temperature + noise[k]).argmax())
        tokens.append(prev)
        rows.append(row)
    return torch.tensor(tokens), torch.stack(rows), torch.stack(confidences)


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_walk_tokens_q_and_confidences_follow_deepspec(tmp_path, family, head, temperature):
    spec = DraftSpec(family=family, markov_head_type=head, dtype=F32, block_size=6, seed=5)
    path = write_draft(tmp_path / "d", spec)
    draft, t = load_draft(path), _tensors(path)
    params = SamplingParams(temperature=temperature)
    gen = torch.Generator().manual_seed(1)
    context = DraftContext(draft, capacity=16)
    context.append(draft, torch.randn(7, draft.fc.weight.shape[1], generator=gen))
    for strategy, k in (("dense", None), ("topk", spec.vd)):
        drafter = Drafter(draft, strategy, params, spec.vocab_size, draft_topk=k)
        hidden, base = draft_backbone(drafter, context, 42, spec.block_size)
        proposal = markov_stage(drafter, hidden, base, 42, torch.Generator().manual_seed(9))
        noise = None if params.greedy else sampling.gumbel_noise((1, *base.shape), torch.Generator().manual_seed(9),
                                                                 base.device)[0]
        tokens, rows, confidences = walk_reference(t, head, base.float(), hidden.float(), 42, temperature, noise)
        assert proposal.tokens.tolist() == tokens.tolist()
        assert torch.allclose(proposal.confidences, confidences, atol=1e-5)
        if temperature:
            q = torch.softmax(rows / temperature, -1)  # DeepSpec's q: softmax(corrected / T) in fp32
            assert torch.allclose(proposal.draft_probs, q, atol=1e-5), (proposal.draft_probs - q).abs().max()


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_gated_and_rnn_heads_run_dense_topk_and_nvfp4_but_not_fused(tmp_path, head):
    from dspark_cli.kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    draft = load_draft(write_draft(tmp_path / "d", DraftSpec(markov_head_type=head, dtype=F32, markov_rank=32)))
    weights = MarkovWeights.from_draft(draft)
    greedy = SamplingParams()
    facts = MarkovHead.of_config(draft.config, nvfp4=False)
    assert resolve_markov("auto", facts, 8, greedy, on_cuda=True) == "topk"  # auto never picks fused for them
    with pytest.raises(SettingError, match=f"implements only vanilla heads and this draft's head is {head}"):
        resolve_markov("fused", facts, 8, greedy, on_cuda=True)
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(3, 5, 256, generator=gen)
    hidden = torch.randn(3, 5, 64, generator=gen)
    first = torch.tensor([1, 2, 3])
    dense = markov_walk("dense", weights, base, first, greedy, hidden=hidden)
    topk = markov_walk("topk", weights, base, first, greedy, draft_topk=256, hidden=hidden)
    assert torch.equal(dense.tokens, topk.tokens) and torch.allclose(dense.logits, topk.logits, atol=1e-5)
    packed = quantize_nvfp4(weights.w2.float())
    nvfp4 = MarkovWeights(weights.w1, weights.w2, packed, weights.scale, None, weights.head)
    walked = markov_walk("nvfp4", nvfp4, base, first, greedy, draft_topk=8, hidden=hidden, triton=False)
    reference = markov_walk("topk", MarkovWeights(weights.w1, dequantize_nvfp4(packed, F32), None, weights.scale, None,
                                                  weights.head), base, first, greedy, draft_topk=8, hidden=hidden)
    assert torch.equal(walked.tokens, reference.tokens)  # the NVFP4 rows dequantized, same walk
    kernel = markov_walk("nvfp4", nvfp4, base, first, greedy, draft_topk=8, hidden=hidden, triton=True)  # interpreter
    assert torch.equal(kernel.tokens, walked.tokens) and torch.allclose(kernel.logits, walked.logits, atol=1e-5)
    with pytest.raises(ValueError, match="hidden states"):
        markov_walk("dense", weights, base, first, greedy)


# --- 3. lossless generation ----------------------------------------------------------------------------------------

LOSSLESS = {"gemma4": DraftSpec(family="gemma4", markov_rank=64, block_size=6),
            "qwen3": DraftSpec(markov_rank=64, block_size=6)}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """family -> (target, {head: draft}): bigram targets and drafts whose Markov head knows the bigram (the gated
    head's gate opened, so its drafts are accepted too)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family, spec in LOSSLESS.items():
        target_dir = bigram_target(root / f"{family}-target", spec)
        target = TargetModel.load(target_dir, [i + 1 for i in spec.target_layer_ids])
        drafts = {}
        for head in ("vanilla", "gated", "rnn"):
            path = bigram_draft(root / f"{family}-{head}", spec.with_(markov_head_type=head), target_dir)
            drafts[head] = load_draft(path, target_embed=target.embed_weight, target_lm_head=target.lm_head_weight)
            if head == "gated":
                with torch.no_grad():
                    drafts[head].markov_head.gate_proj.weight.zero_()
                    drafts[head].markov_head.gate_proj.bias.fill_(8.0)
        out[family] = (target, drafts)
    return out


PROMPT, MAX_NEW = [5, 17, 33, 2, 99], 32


@pytest.mark.parametrize("family", sorted(LOSSLESS))
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_greedy_equals_target(pairs, family, head):
    target, drafts = pairs[family]
    expected = target.model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=MAX_NEW)[0, 5:].tolist()
    accepted = 0
    for block_size in (1, 3, 6):
        for strategy, k in (("dense", None), ("topk", 5)):
            result = generate(target, drafts[head], PROMPT, SamplingParams(), block_size=block_size,
                                          stop_ids=[1], max_new_tokens=MAX_NEW, strategy=strategy, draft_topk=k)
            assert result.tokens == expected, (block_size, strategy)
            accepted += sum(r.accepted for r in result.stats.rounds)
    if head != "rnn":  # the RNN head is random here: its rounds are mostly rejections
        assert accepted > 0


# --- 4. validate ----------------------------------------------------------------------------------------------------


def _codes(path, target: DraftSpec):
    return validate_checkpoint(open_checkpoint(path), target_config(target))


def test_a_gemma4_draft_validates_with_its_own_rules(tmp_path):
    spec = DraftSpec(family="gemma4")
    report = _codes(write_draft(tmp_path / "g", spec), spec)
    assert report.errors == []
    assert set(report.codes) == {"DSP043", "DSP046"}  # vLLM drops the confidence head and soft-caps the bias
    assert "DSP003" not in report.codes and report.format == "deepspec-gemma4"
    assert (report.resolved["family"], report.resolved["markov_head_type"]) == ("gemma4", "vanilla")


@pytest.mark.parametrize("spec, kwargs, code", [
    (DraftSpec(family="gemma4"), {"mutate": drop("embed_tokens.weight")}, "DSP040"),
    (DraftSpec(family="gemma4", attention_k_eq_v=False), {}, "DSP041"),
    (DraftSpec(family="gemma4", draft_vocab_size=128), {}, "DSP042"),
    (DraftSpec(family="gemma4"), {"edit": {"layer_types": ["sliding_attention", "full_attention"]}}, "DSP044"),
    (DraftSpec(family="gemma4"), {"edit": {"enable_moe_block": True}}, "DSP045"),
    (DraftSpec(family="gemma4"), {"edit": {"global_head_dim": None}}, "DSP047"),
    (DraftSpec(family="gemma4"), {"mutate": drop("layers.0.self_attn.q_norm.weight")}, "DSP201"),
    (DraftSpec(family="gemma4", markov_head_type="rnn"), {}, "DSP012"),
    (DraftSpec(markov_head_type="gated"), {}, "DSP012"),
])
def test_family_and_head_findings(tmp_path, spec, kwargs, code):
    report = _codes(write_draft(tmp_path / "d", spec, **kwargs), spec)
    assert code in report.codes, report.codes
    assert "DSP205" not in report.codes  # gate_proj / joint_proj / layer_scalar are part of the schema


def test_gemma4_geometry_resolves_from_per_layer_config(tmp_path):
    """transformers >= 5.15 writes the full-attention geometry as per_layer_config; it resolves the same way."""
    spec = DraftSpec(family="gemma4", dtype=F32)
    per_layer = {str(i): {"head_dim": spec.global_head_dim, "num_key_value_heads": spec.num_global_key_value_heads}
                 for i in range(spec.num_hidden_layers)}
    path = write_draft(tmp_path / "g", spec, edit={"global_head_dim": None, "num_global_key_value_heads": None,
                                                   "per_layer_config": per_layer})
    draft = load_draft(path)
    assert (draft.config.head_dim, draft.config.num_key_value_heads) == (32, 1)
    assert _codes(path, spec).errors == []
