"""Tiny DSpark checkpoints in DeepSpec's exact format (docs/format.md §1.1–1.2), and mutations of them.

    spec = DraftSpec()                      # small geometry; every field can be changed
    path = write_draft(tmp_path / "d", spec)  # config.json + model.safetensors (or shards)
    path = write_draft(..., mutate=drop("d2t"), edit={"markov_rank": None})

`tiny_target` writes a matching random Qwen3 target with transformers. `DraftSpec(family="gemma4")` is a
DeepSpec Gemma-4 draft (Gemma4DSparkModel) and `tiny_target` then writes a Gemma-4 text target;
`markov_head_type` "gated" / "rnn" adds those heads' projections.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class DraftSpec:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 256  # draft input vocab (= target vocab normally)
    draft_vocab_size: int | None = None  # None: same as vocab_size, key not written
    markov_rank: int = 32  # 0: a DFlash-style draft (no Markov head, no markov keys)
    target_layer_ids: tuple[int, ...] = (0, 2)
    target_hidden_size: int | None = None
    target_layers: int = 4  # depth of the target (num_target_layers)
    block_size: int = 4
    mask_token_id: int = 250
    confidence: bool = True
    confidence_with_markov: bool = True
    own_embed: bool = True  # DeepSpec always saves embed_tokens and lm_head
    own_lm_head: bool = True
    attention_bias: bool = False
    sample_from_anchor: bool | None = None  # None: key not written (default True)
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    extra_config: dict = field(default_factory=dict)
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn
    family: str = "qwen3"  # qwen3 | gemma4 (DeepSpec Gemma4DSparkModel)
    global_head_dim: int = 32  # Gemma-4 full-attention geometry (the draft layers are all full attention)
    num_global_key_value_heads: int = 1
    attention_k_eq_v: bool = True
    final_logit_softcapping: float | None = 30.0

    @property
    def vd(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    def with_(self, **changes) -> "DraftSpec":
        return replace(self, **changes)


def gemma4_text_config(spec: DraftSpec, layers: int) -> dict:
    """A Gemma-4 text config (model_type gemma4_text) as transformers 5.10 writes it: global_head_dim and
    num_global_key_value_heads at the top level; every layer full attention (what a draft has)."""
    return {
        "model_type": "gemma4_text",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "global_head_dim": spec.global_head_dim,
        "num_global_key_value_heads": spec.num_global_key_value_heads,
        "attention_k_eq_v": spec.attention_k_eq_v,
        "attention_bias": spec.attention_bias,
        "attention_dropout": 0.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
        "final_logit_softcapping": spec.final_logit_softcapping,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "sliding_window": 512,
        "layer_types": ["full_attention"] * layers,
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
    }


def gemma4_draft_config(spec: DraftSpec) -> dict:
    """config.json as DeepSpec's Gemma-4 build_draft_config writes it (the target's text config + overrides)."""
    config = gemma4_text_config(spec, spec.num_hidden_layers)
    config.update(
        architectures=["Gemma4DSparkModel"],
        target_model_type="gemma4_text",
        target_text_model_type="gemma4_text",
        num_target_layers=spec.target_layers,
        block_size=spec.block_size,
        mask_token_id=spec.mask_token_id,
        target_layer_ids=list(spec.target_layer_ids),
        num_anchors=512,
        enable_confidence_head=spec.confidence,
        markov_rank=spec.markov_rank,
        torch_dtype="bfloat16",
    )
    if spec.confidence:
        config["confidence_head_with_markov"] = spec.confidence_with_markov
    if spec.markov_rank:
        config["markov_head_type"] = spec.markov_head_type
    config.update(spec.extra_config)
    return config


def draft_config(spec: DraftSpec) -> dict:
    """config.json as DeepSpec's build_draft_config writes it (target Qwen3 config + draft overrides)."""
    if spec.family == "gemma4":
        return gemma4_draft_config(spec)
    config = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": spec.attention_bias,
        "max_position_embeddings": 4096,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": False,
        "num_target_layers": spec.target_layers,
        "target_layer_ids": list(spec.target_layer_ids),
        "mask_token_id": spec.mask_token_id,
        "block_size": spec.block_size,
        "num_anchors": 512,
        "layer_types": ["full_attention"] * spec.num_hidden_layers,
        "torch_dtype": "bfloat16",
    }
    if spec.target_hidden_size is not None:
        config["target_hidden_size"] = spec.target_hidden_size
    if spec.draft_vocab_size is not None:
        config["draft_vocab_size"] = spec.draft_vocab_size
    if spec.markov_rank:
        config.update(markov_rank=spec.markov_rank, markov_head_type=spec.markov_head_type)
    else:
        config["architectures"] = ["DFlashDraftModel"]
        config["dflash_config"] = {"mask_token_id": spec.mask_token_id, "target_layer_ids": list(spec.target_layer_ids)}
        del config["mask_token_id"], config["target_layer_ids"]
    config["enable_confidence_head"] = spec.confidence
    if spec.confidence:
        config["confidence_head_with_markov"] = spec.confidence_with_markov
    if spec.sample_from_anchor is not None:
        config["sample_from_anchor"] = spec.sample_from_anchor
    config.update(spec.extra_config)
    return config


def draft_tensors(spec: DraftSpec) -> Tensors:
    """Random weights under DeepSpec's state-dict names (no `model.` prefix)."""
    gen = torch.Generator().manual_seed(spec.seed)
    H, I, D = spec.hidden_size, spec.intermediate_size, spec.head_dim
    hq, hkv = spec.num_attention_heads * D, spec.num_key_value_heads * D
    ht = spec.target_hidden_size or H

    def rand(*shape: int, std: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(spec.dtype)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(spec.dtype)

    tensors: Tensors = {}
    if spec.family == "gemma4":
        tensors.update(gemma4_layer_tensors(spec, rand, norm, gen))
    for i in range(spec.num_hidden_layers if spec.family == "qwen3" else 0):
        p = f"layers.{i}."
        tensors.update(attention_and_mlp(p, spec, rand, norm, H, I, D, hq, hkv, with_v=True))
        tensors.update({p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H)})
        tensors.update(attention_biases(p, spec, rand, H, hq, hkv, with_v=True))
    tensors["norm.weight"] = norm(H)
    tensors["fc.weight"] = rand(H, len(spec.target_layer_ids) * ht)
    tensors["hidden_norm.weight"] = norm(H)
    if spec.own_embed:
        tensors["embed_tokens.weight"] = rand(spec.vocab_size, H, std=0.5)
    if spec.own_lm_head:
        tensors["lm_head.weight"] = rand(spec.vd, H, std=0.5)
    if spec.markov_rank:
        tensors["markov_head.markov_w1.weight"] = rand(spec.vocab_size, spec.markov_rank, std=0.5)
        tensors["markov_head.markov_w2.weight"] = rand(spec.vd, spec.markov_rank, std=0.5)
        r = spec.markov_rank
        if spec.markov_head_type == "gated":
            tensors["markov_head.gate_proj.weight"] = rand(r, H + r, std=0.3)
            tensors["markov_head.gate_proj.bias"] = rand(r, std=0.3)
        elif spec.markov_head_type == "rnn":
            tensors["markov_head.joint_proj.weight"] = rand(3 * r, 2 * r + H, std=0.3)
            tensors["markov_head.joint_proj.bias"] = rand(3 * r, std=0.3)
    if spec.confidence:
        width = H + (spec.markov_rank if spec.confidence_with_markov and spec.markov_rank else 0)
        tensors["confidence_head.proj.weight"] = rand(1, width, std=0.1)
        tensors["confidence_head.proj.bias"] = rand(1, std=0.1)
    if spec.draft_vocab_size is not None and spec.draft_vocab_size != spec.vocab_size:
        tensors["d2t"] = reduced_vocab_d2t(spec.draft_vocab_size, spec.vocab_size)
    return tensors


def gemma4_layer_tensors(spec: DraftSpec, rand, norm, gen: torch.Generator) -> Tensors:
    """Gemma-4 draft layers: full-attention geometry, no v_proj with attention_k_eq_v, sandwich norms, layer_scalar."""
    H, I, D = spec.hidden_size, spec.intermediate_size, spec.global_head_dim
    kv = spec.num_global_key_value_heads if spec.attention_k_eq_v else spec.num_key_value_heads
    hq, hkv = spec.num_attention_heads * D, kv * D
    tensors: Tensors = {}
    for i in range(spec.num_hidden_layers):
        p = f"layers.{i}."
        with_v = not spec.attention_k_eq_v
        tensors.update(attention_and_mlp(p, spec, rand, norm, H, I, D, hq, hkv, with_v))
        tensors[p + "layer_scalar"] = (0.5 + torch.rand(1, generator=gen)).to(spec.dtype)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            tensors[p + f"{name}.weight"] = norm(H)
        tensors.update(attention_biases(p, spec, rand, H, hq, hkv, with_v))
    return tensors


def attention_and_mlp(p: str, spec: DraftSpec, rand, norm, H: int, I: int, D: int, hq: int, hkv: int,
                      with_v: bool) -> Tensors:
    """One layer's attention projections and q/k norms (v_proj when with_v) and its gated MLP."""
    tensors = {p + "self_attn.q_proj.weight": rand(hq, H), p + "self_attn.k_proj.weight": rand(hkv, H)}
    if with_v:
        tensors[p + "self_attn.v_proj.weight"] = rand(hkv, H)
    tensors.update({
        p + "self_attn.o_proj.weight": rand(H, hq),
        p + "self_attn.q_norm.weight": norm(D),
        p + "self_attn.k_norm.weight": norm(D),
        p + "mlp.gate_proj.weight": rand(I, H),
        p + "mlp.up_proj.weight": rand(I, H),
        p + "mlp.down_proj.weight": rand(H, I),
    })
    return tensors


def attention_biases(p: str, spec: DraftSpec, rand, H: int, hq: int, hkv: int, with_v: bool) -> Tensors:
    """The attention projections' biases when spec.attention_bias."""
    if not spec.attention_bias:
        return {}
    widths = [("q", hq), ("k", hkv)] + ([("v", hkv)] if with_v else []) + [("o", H)]
    return {p + f"self_attn.{proj}_proj.bias": rand(width) for proj, width in widths}


def reduced_vocab_d2t(vd: int, vocab: int) -> torch.Tensor:
    """Offsets mapping draft ids to `vd` distinct target ids spread over [0, vocab): target = id + d2t[id]."""
    targets = torch.linspace(0, vocab - 1, vd).round().long()
    return targets - torch.arange(vd)


# --- mutations: each takes the tensor dict and returns a new one -------------------------------------------------

Mutation = Callable[[Tensors], Tensors]


def drop(*names: str) -> Mutation:
    return lambda t: {k: v for k, v in t.items() if k not in names}


def replace_tensor(name: str, value: torch.Tensor) -> Mutation:
    return lambda t: {**t, name: value}


def rename(old: str, new: str) -> Mutation:
    return lambda t: {(new if k == old else k): v for k, v in t.items()}


def write_draft(
    path: Path,
    spec: DraftSpec = DraftSpec(),
    *,
    shards: int = 1,
    edit: dict | None = None,
    mutate: Mutation | None = None,
) -> Path:
    """Write a checkpoint folder. `edit` sets config keys (value None deletes the key); `mutate` edits tensors."""
    config = draft_config(spec)
    for key, value in (edit or {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    tensors = draft_tensors(spec)
    if mutate is not None:
        tensors = mutate(tensors)
    return write_folder(path, config, tensors, shards=shards)


def write_folder(path: Path, config: dict, tensors: Tensors, *, shards: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def target_config(spec: DraftSpec) -> dict:
    """A Qwen3 target config matching `spec` (same vocab and hidden size, `target_layers` deep); a Gemma-4 text
    target (sliding and full layers, as Gemma-4 has) for a Gemma-4 draft."""
    if spec.family == "gemma4":
        config = gemma4_text_config(spec, spec.target_layers)
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(spec.target_layers)]
        config["sliding_window"] = 8
        return {"architectures": ["Gemma4ForCausalLM"], **config}
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.target_hidden_size or spec.hidden_size,
        "intermediate_size": 2 * (spec.target_hidden_size or spec.hidden_size),
        "num_hidden_layers": spec.target_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


def tiny_target(path: Path, spec: DraftSpec = DraftSpec(), seed: int = 0) -> Path:
    """A random Qwen3ForCausalLM (Gemma4ForCausalLM for a Gemma-4 spec) saved with save_pretrained (float32)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = target_config(spec)
    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    if spec.family == "gemma4":
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        model = Gemma4ForCausalLM(Gemma4TextConfig(**kwargs))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**kwargs))
    with torch.no_grad():  # larger logits than the default init, so greedy decoding is not all ties
        model.lm_head.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def write_target_config(path: Path, spec: DraftSpec = DraftSpec(), **changes) -> Path:
    """Only config.json of a target (what validate reads)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**target_config(spec), **changes}, indent=2))
    return path


# --- NVFP4 markov_w2 as `dspark quantize` writes it (docs/nvfp4.md §4) ----------------------------------------------

VLLM_MARKOV_W2 = "model.markov_head.markov_w2"  # the prefix vLLM asks the quantization config about
W4A16_LAYER = {"quant_algo": "W4A16_NVFP4", "group_size": 16}


def nvfp4_markov_w2(spec: DraftSpec) -> Mutation:
    """Replace markov_w2 [Vd, r] by random NVFP4 tensors: U8 [Vd, r/2], F8_E4M3 [Vd, r/16], F32 [] (r % 16 == 0)."""

    def mutate(tensors: Tensors) -> Tensors:
        gen = torch.Generator().manual_seed(spec.seed + 1)
        vd, r = spec.vd, spec.markov_rank
        out = {k: v for k, v in tensors.items() if k != "markov_head.markov_w2.weight"}
        out["markov_head.markov_w2.weight"] = torch.randint(0, 256, (vd, r // 2), generator=gen, dtype=torch.uint8)
        scales = torch.rand(vd, r // 16, generator=gen) * 400 + 1
        out["markov_head.markov_w2.weight_scale"] = scales.to(torch.float8_e4m3fn)
        out["markov_head.markov_w2.weight_scale_2"] = torch.tensor(1e-4, dtype=torch.float32)
        return out

    return mutate


def nvfp4_quant_configs(layers: dict | None = None) -> tuple[dict, dict]:
    """(config.json `quantization_config`, hf_quant_config.json) in the MIXED_PRECISION form dspark quantize writes."""
    layers = layers if layers is not None else {VLLM_MARKOV_W2: dict(W4A16_LAYER)}
    producer = {"name": "modelopt", "version": "0.47.0"}
    quantization_config = {
        "config_groups": {"group_0": {"weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                                      "targets": list(layers)}},
        "quantized_layers": layers,
        "ignore": [],
        "quant_algo": "MIXED_PRECISION",
        "producer": producer,
        "quant_method": "modelopt",
    }
    hf_quant_config = {
        "producer": producer,
        "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "exclude_modules": [],
                         "quantized_layers": layers},
    }
    return quantization_config, hf_quant_config


def write_nvfp4_draft(
    path: Path,
    spec: DraftSpec = DraftSpec(markov_rank=64),
    *,
    quantization_config: dict | None = None,
    hf_quant_config: dict | None = None,
    edit: dict | None = None,
    mutate: Mutation | None = None,
    shards: int = 1,
) -> Path:
    """A draft whose markov_w2 is NVFP4, with both quantization config files (defaults: what dspark quantize writes).

    Pass `quantization_config={}` or `hf_quant_config={}` to leave that file out."""
    default_json, default_legacy = nvfp4_quant_configs()
    quantization_config = default_json if quantization_config is None else quantization_config
    hf_quant_config = default_legacy if hf_quant_config is None else hf_quant_config
    nvfp4 = nvfp4_markov_w2(spec)
    edit = {**({"quantization_config": quantization_config} if quantization_config else {}), **(edit or {})}
    path = write_draft(path, spec, shards=shards, edit=edit,
                       mutate=nvfp4 if mutate is None else (lambda t: mutate(nvfp4(t))))
    if hf_quant_config:
        (path / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=2))
    return path


# --- other layouts of the same weights (docs/formats-other.md) -----------------------------------------------------


def speculators_config(spec: DraftSpec, kind: str = "dspark") -> dict:
    """The config.json the speculators library writes for `spec` (speculators_model_type 'dspark' or 'dflash')."""
    base = draft_config(spec)
    layer_keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "attention_bias",
                  "max_position_embeddings", "vocab_size", "layer_types", "tie_word_embeddings")
    config = {
        "speculators_model_type": kind,
        "architectures": ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
        "transformer_layer_config": {key: base[key] for key in layer_keys},
        "draft_vocab_size": spec.vd,
        "block_size": spec.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in spec.target_layer_ids],
        "mask_token_id": spec.mask_token_id,
        "speculators_config": {"algorithm": kind, "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": spec.block_size}]},
        "sample_from_anchor": kind == "dspark",
    }
    if kind == "dspark":
        config.update(markov_rank=spec.markov_rank, markov_head_type="vanilla", enable_confidence_head=spec.confidence,
                      confidence_head_with_markov=spec.confidence_with_markov)
    return config


def specforge_config(spec: DraftSpec) -> dict:
    """An un-normalised SpecForge DSpark export: DSparkDraftModel with the DSpark fields under dflash_config."""
    config = draft_config(spec)
    moved = ("mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type", "enable_confidence_head",
             "confidence_head_with_markov")
    nested = {key: config.pop(key) for key in moved if key in config}
    config["architectures"] = ["DSparkDraftModel"]
    config["auto_map"] = {"AutoModel": "dspark.DSparkDraftModel"}
    config["dflash_config"] = {**nested, "projector_type": "dspark"}
    return config
