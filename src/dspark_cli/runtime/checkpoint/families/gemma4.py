"""The Gemma-4 draft family: DeepSpec `Gemma4DSparkModel` (deepspec/modeling/dspark/gemma4/{config,modeling}.py),
served by vLLM's `gemma4_dspark.Gemma4DSparkForCausalLM` (docs/format.md §6).

The config is the target's Gemma-4 text config with the draft fields overridden (DeepSpec `build_draft_config`).
Its draft layers are all full attention, so the geometry is the full-attention one: head dim `global_head_dim`,
and with `attention_k_eq_v` the `num_global_key_value_heads` key/value heads, in the order vLLM's
`gemma4_layer_config` resolves them (transformers >= 5.15 writes them as `per_layer_config` instead).
"""

from __future__ import annotations

from typing import Any

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.families import Family, LayerTensor
from dspark_cli.runtime.checkpoint.target_config import TargetConfig

ARCHITECTURE = "Gemma4DSparkModel"
DEFAULT_FULL_ROPE = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _layer_overrides(view: dict[str, Any]) -> list[dict[str, Any]]:
    """per_layer_config entries (transformers >= 5.15), by layer index; empty when the key is absent."""
    table = view.get("per_layer_config")
    if not isinstance(table, dict):
        return []
    return [entry for _, entry in sorted((int(k), v) for k, v in table.items() if str(k).isdigit()
                                         and isinstance(v, dict))]


def full_attention_geometry(view: dict[str, Any]) -> tuple[int | None, int | None]:
    """(head_dim, num_key_value_heads) of a full-attention layer, as vLLM's gemma4_layer_config resolves them:
    per_layer_config first, else global_head_dim (or head_dim) and, with attention_k_eq_v,
    num_global_key_value_heads (or num_key_value_heads)."""
    overrides = _layer_overrides(view)
    first = overrides[0] if overrides else {}
    head_dim = _int(first.get("head_dim")) or _int(view.get("global_head_dim")) or _int(view.get("head_dim"))
    kv = _int(first.get("num_key_value_heads"))
    if kv is None and view.get("attention_k_eq_v"):
        kv = _int(view.get("num_global_key_value_heads"))
    return head_dim, kv or _int(view.get("num_key_value_heads"))


def full_attention_rope(view: dict[str, Any]) -> dict[str, Any]:
    params = view.get("rope_parameters")
    rope = params.get("full_attention") if isinstance(params, dict) else None
    return rope if isinstance(rope, dict) else DEFAULT_FULL_ROPE


def resolve(view: dict[str, Any]) -> dict[str, Any]:
    head_dim, kv = full_attention_geometry(view)
    rope = full_attention_rope(view)
    theta = rope.get("rope_theta", DEFAULT_FULL_ROPE["rope_theta"])
    factor = rope.get("partial_rotary_factor", 1.0) if rope.get("rope_type") == "proportional" else 1.0
    cap = view.get("final_logit_softcapping")
    return {
        "head_dim": head_dim,
        "num_key_value_heads": kv,
        "rope_theta": float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else 1e6,
        "rope_partial_factor": float(factor) if isinstance(factor, (int, float)) and 0 < factor <= 1 else 1.0,
        "attention_k_eq_v": bool(view.get("attention_k_eq_v", False)),
        "final_logit_softcapping": float(cap) if isinstance(cap, (int, float)) and cap > 0 else None,
        "hidden_act": str(view.get("hidden_activation", "gelu_pytorch_tanh")),
        "target_hidden_size": _int(view.get("hidden_size")),  # fc is [H, n*H]: DeepSpec and vLLM have no other width
    }


def layer_tensors(config) -> list[LayerTensor]:
    H, I, D = config.hidden_size, config.intermediate_size, config.head_dim
    hq, hkv = config.num_attention_heads * D, config.num_key_value_heads * D
    projections = [("q", hq, "num_attention_heads*head_dim"), ("k", hkv, "num_key_value_heads*head_dim")]
    if not config.attention_k_eq_v:  # with k_eq_v the values are the keys' projection (no v_proj)
        projections.append(("v", hkv, "num_key_value_heads*head_dim"))
    out: list[LayerTensor] = [(f"self_attn.{x}_proj.weight", (rows, H), f"[{f}, hidden_size]")
                              for x, rows, f in projections]
    out.append(("self_attn.o_proj.weight", (H, hq), "[hidden_size, num_attention_heads*head_dim]"))
    if config.attention_bias:
        out += [(f"self_attn.{x}_proj.bias", (rows,), f"[{f}]") for x, rows, f in projections]
        out.append(("self_attn.o_proj.bias", (H,), "[hidden_size]"))
    out += [
        ("self_attn.q_norm.weight", (D,), "[head_dim]"),
        ("self_attn.k_norm.weight", (D,), "[head_dim]"),
        ("mlp.gate_proj.weight", (I, H), "[intermediate_size, hidden_size]"),
        ("mlp.up_proj.weight", (I, H), "[intermediate_size, hidden_size]"),
        ("mlp.down_proj.weight", (H, I), "[hidden_size, intermediate_size]"),
    ]
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    return out + [(f"{n}.weight", (H,), "[hidden_size]") for n in norms]


def layer_linears(config, p: str) -> list[tuple[str, tuple[str, ...]]]:
    """vLLM's Gemma4DSparkDecoderLayer: q/k/(v)/o as separate Linear layers, gate/up stacked into gate_up_proj."""
    attn, mlp = f"{p}self_attn.", f"{p}mlp."
    names = "qk" if config.attention_k_eq_v else "qkv"
    return [(f"model.{attn}{x}_proj", (f"{attn}{x}_proj.weight",)) for x in names + "o"] + [
        (f"model.{mlp}gate_up_proj", (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight")),
        (f"model.{mlp}down_proj", (f"{mlp}down_proj.weight",)),
    ]


# --- validate rules of the family (docs/validate.md, DSP040-DSP047) ---------------------------------------------------

VLLM_FILE = "vllm/model_executor/models/gemma4_dspark.py"


def embeddings_shipped(ctx):
    """DSP040: vLLM's Gemma4DSparkForCausalLM sets dspark_shares_target_embeddings = False, so a missing
    embed_tokens / lm_head is never taken from the target; its load_weights does not notice and the parameter
    stays uninitialised."""
    from dspark_cli.runtime.checkpoint.rules.codes import Results

    out = Results()
    for name, has in (("embed_tokens.weight", ctx.has_embed), ("lm_head.weight", ctx.has_lm_head)):
        if not has:
            out.add("DSP040", f"the Gemma-4 draft has no {name!r}; vLLM's Gemma-4 DSpark model "
                    f"({VLLM_FILE}, Gemma4DSparkForCausalLM: dspark_shares_target_embeddings = False) never "
                    "shares it from the target and loads nothing into it.",
                    "Save the draft with its own embed_tokens and lm_head (DeepSpec does; `dspark train` does for "
                    "Gemma-4 drafts).")
    return out


def vocabulary(ctx):
    """DSP042: vLLM's Gemma-4 DSpark model has no d2t (draft_id_to_target_id = None) and builds lm_head with
    vocab_size rows, so a reduced draft vocabulary cannot be served."""
    from dspark_cli.runtime.checkpoint.rules.codes import Results

    out, config = Results(), ctx.config
    if config.reduced_vocab or "d2t" in ctx.tensors:
        out.add("DSP042", f"draft_vocab_size is {config.draft_vocab_size} (vocab_size {config.vocab_size})"
                + (" and the draft ships d2t" if "d2t" in ctx.tensors else "") + f"; vLLM's Gemma-4 DSpark model "
                f"({VLLM_FILE}, Gemma4DSparkForCausalLM.__init__) has no draft-to-target map and builds lm_head "
                "with vocab_size rows.", "Use the full vocabulary for a Gemma-4 draft (DeepSpec does).")
    return out


def attention_layout(ctx):
    """DSP041 (k_eq_v), DSP044 (layer types), DSP045 (Gemma-4 features DeepSpec refuses), DSP047 (geometry)."""
    from dspark_cli.runtime.checkpoint.rules.codes import Results

    out, config, view = Results(), ctx.config, ctx.config.vllm_config
    if not config.attention_k_eq_v:
        out.add("DSP041", "attention_k_eq_v is false: the draft has v_proj; vLLM's Gemma-4 DSpark model "
                f"({VLLM_FILE}, Gemma4DSparkModel._build_fused_kv_buffers) asserts 'Gemma4 DSpark fused precompute "
                "assumes uniform attention_k_eq_v layers' and fails at start-up (dspark runs it).",
                "Train Gemma-4 drafts with attention_k_eq_v = true to serve them with vLLM (`dspark train` writes "
                "that for any Gemma-4 target; Gemma-4 12B has it).")
    types = view.get("layer_types")
    if isinstance(types, list) and any(t != "full_attention" for t in types):
        out.add("DSP044", f"layer_types is {types!r}; DeepSpec's Gemma-4 drafts are all full_attention, dspark "
                "runs only those, and vLLM would give a sliding layer the sliding head size, RoPE and window.",
                "Set layer_types to ['full_attention'] * num_hidden_layers, as DeepSpec's build_draft_config does.")
    refused = [key for key, bad in (("enable_moe_block", bool(view.get("enable_moe_block"))),
                                    ("hidden_size_per_layer_input", bool(view.get("hidden_size_per_layer_input"))))
               if bad]
    if view.get("use_double_wide_mlp") and _int(view.get("num_kv_shared_layers")):
        refused.append("use_double_wide_mlp with num_kv_shared_layers")
    if refused:
        out.add("DSP045", f"the config enables {', '.join(refused)}; DeepSpec's Gemma4DSparkModel refuses MoE blocks "
                "and per-layer inputs, and vLLM's Gemma-4 DSpark layer (Gemma4MTPDecoderLayer) has a plain MLP of "
                "intermediate_size.", "Set enable_moe_block false, hidden_size_per_layer_input 0 and "
                "num_kv_shared_layers 0 (what a dense Gemma-4 target gives).")
    overrides = _layer_overrides(view)
    if overrides and any(o != overrides[0] for o in overrides):
        out.add("DSP047", "per_layer_config gives the draft layers different head sizes or key/value heads; vLLM's "
                "fused context K/V precompute needs one geometry for every layer.",
                "Use one full-attention geometry for every draft layer.")
    if "global_head_dim" not in view and not overrides:
        out.add("DSP047", "the config has neither global_head_dim nor per_layer_config: vLLM then uses head_dim "
                f"({view.get('head_dim')!r}) for the full-attention layers, while transformers' Gemma-4 config "
                "defaults global_head_dim to 512.", "Write global_head_dim (and num_global_key_value_heads) as "
                "DeepSpec's config does.")
    return out


def heads(ctx):
    """DSP043 (confidence head not loaded by vLLM), DSP046 (vLLM soft-caps the Markov bias too)."""
    from dspark_cli.runtime.checkpoint.rules.codes import Results

    out, config = Results(), ctx.config
    if any(name.startswith("confidence_head.") for name in ctx.tensors):
        out.add("DSP043", f"vLLM's Gemma-4 DSpark loader ({VLLM_FILE}, Gemma4DSparkForCausalLM.load_weights) skips "
                "every confidence_head tensor, so vLLM serves this draft without its confidence head.",
                "Nothing to do for dspark (generate and eval use the head); do not count on adaptive verification "
                "in vLLM.")
    if config.final_logit_softcapping and config.has_markov:
        out.add("DSP046", f"final_logit_softcapping is {config.final_logit_softcapping}: DeepSpec adds the Markov "
                "bias after soft-capping the base logits, but vLLM computes the bias through the same soft-capping "
                f"LogitsProcessor ({VLLM_FILE}: LogitsProcessor(soft_cap=...); qwen3_dspark.py markov_bias), i.e. "
                "tanh(bias / cap) * cap, so vLLM's proposals differ slightly from the trained ones.",
                "Nothing to fix in the checkpoint; dspark follows DeepSpec. Expect slightly different acceptance in "
                "vLLM when Markov biases are large.")
    return out


# --- a new draft for a target (dspark train) ------------------------------------------------------------------------

# Targets a Gemma-4 draft is built for (DeepSpec's Gemma4DSparkTrainer): outer and text model_types.
TARGET_MODEL_TYPES = ("gemma4", "gemma4_unified", "gemma4_text", "gemma4_unified_text")
# What a Gemma-4 target may enable that no draft has (DeepSpec's Gemma4DSparkModel refuses MoE blocks and per-layer
# inputs; vLLM's Gemma4MTPDecoderLayer is attention + a plain MLP of intermediate_size). The switches are written
# off explicitly, since a missing key takes transformers' Gemma4TextConfig default (hidden_size_per_layer_input 256,
# the E2B / E4B kind); the sizes that only matter when a switch is on are left out.
TARGET_ONLY_OFF = {
    "hidden_size_per_layer_input": 0,  # per-layer input embeddings (E2B / E4B)
    "enable_moe_block": False,  # MoE blocks (the 26B-A4B kind)
    "num_kv_shared_layers": 0,  # the last layers reuse earlier layers' K/V: the target's cache layout
    "use_double_wide_mlp": False,  # wider MLPs of the KV-sharing layers
}
TARGET_ONLY_SIZES = ("vocab_size_per_layer_input", "num_experts", "top_k_experts", "moe_intermediate_size")


def draft_config(target: TargetConfig, shape, target_layers: list[int], mask, anchors: int) -> dict[str, Any]:
    """DeepSpec's Gemma-4 build_draft_config: the target's text config with the draft fields overridden, the outer
    model_type kept as target_model_type (DeepSpec get_gemma4_text_config; shape: train's DraftShape, mask: its
    MaskChoice). The full-attention geometry is written as global_head_dim / num_global_key_value_heads (not the
    target's per_layer_config, whose indices are the target's layers), so that any transformers version rebuilds it
    for the draft's layers.

    The target-only settings (`TARGET_ONLY_OFF`: per-layer inputs, MoE blocks, KV sharing) are written off, so that a
    draft for any Gemma-4 variant passes validate's DSP045 and runs in dspark and vLLM.

    One departure from DeepSpec: the draft always has attention_k_eq_v (values = the keys' projection), whatever
    the target has. The draft's attention is its own network, and vLLM's Gemma-4 DSpark model serves only that
    layout (validate's DSP041); DeepSpec would copy a target's false and write a draft vLLM refuses."""
    if mask.vocab_size != target.vocab_size:
        raise DsparkError("the tokenizer has no free id for the mask token, and a Gemma-4 draft cannot add one "
                          "(vLLM's Gemma-4 DSpark model has no separate draft vocabulary); pass the mask-token-id "
                          "option with an id the tokenizer never produces (DeepSpec's Gemma-4 draft uses 4).")
    head_dim, kv_heads = full_attention_geometry(target.text)
    config = {k: v for k, v in target.text.items()
              if k not in ("_name_or_path", "dtype", "torch_dtype", "transformers_version", "auto_map",
                           "per_layer_config", *TARGET_ONLY_SIZES)}
    config.update(TARGET_ONLY_OFF)
    config.update(
        architectures=[ARCHITECTURE],
        target_model_type=target.outer_model_type,
        target_text_model_type=target.model_type,
        attention_k_eq_v=True,
        global_head_dim=head_dim,
        num_global_key_value_heads=kv_heads,
        num_target_layers=target.num_hidden_layers,
        num_hidden_layers=shape.layers,
        block_size=shape.block_size,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * shape.layers,
        mask_token_id=mask.token_id,
        target_layer_ids=list(target_layers),
        num_anchors=anchors,
        enable_confidence_head=shape.confidence,
        confidence_head_with_markov=bool(shape.confidence and shape.confidence_with_markov and shape.markov_rank),
        markov_rank=shape.markov_rank,
        use_cache=True,
    )
    if shape.markov_rank:
        config["markov_head_type"] = shape.markov_head_type
    return config


FAMILY = Family(
    name="gemma4",
    architectures=(ARCHITECTURE,),
    title="Gemma-4",
    resolve=resolve,
    layer_tensors=layer_tensors,
    layer_linears=layer_linears,
    vllm_shares_embeddings=False,
    draft_config=draft_config,
    rules=(embeddings_shipped, vocabulary, attention_layout, heads),
    optional_layer_tensors=(("layer_scalar", (1,), "[1]"),),  # a buffer DeepSpec saves; vLLM defaults it to 1.0
    target_model_types=TARGET_MODEL_TYPES,
    needs_target="a Gemma-4 target (model_type gemma4 or gemma4_text)",
)
