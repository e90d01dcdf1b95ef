"""The Qwen3 draft family (DeepSpec `Qwen3DSparkModel`, vLLM `qwen3_dspark.Qwen3DSparkForCausalLM`; also z-lab DFlash,
SpecForge and speculators drafts, which share its decoder layer): docs/format.md §1."""

from __future__ import annotations

from typing import Any

from dspark_cli.runtime.checkpoint.families import Family, LayerTensor
from dspark_cli.runtime.checkpoint.target_config import TargetConfig

ARCHITECTURE = "Qwen3DSparkModel"


def resolve(view: dict[str, Any]) -> dict[str, Any]:
    """Qwen3 keys are DraftConfig's defaults (head_dim, num_key_value_heads, rope_theta at the top level)."""
    return {}


def layer_tensors(config) -> list[LayerTensor]:
    H, I, D = config.hidden_size, config.intermediate_size, config.head_dim
    hq, hkv = config.num_attention_heads * D, config.num_key_value_heads * D
    out: list[LayerTensor] = [
        ("self_attn.q_proj.weight", (hq, H), "[num_attention_heads*head_dim, hidden_size]"),
        ("self_attn.k_proj.weight", (hkv, H), "[num_key_value_heads*head_dim, hidden_size]"),
        ("self_attn.v_proj.weight", (hkv, H), "[num_key_value_heads*head_dim, hidden_size]"),
        ("self_attn.o_proj.weight", (H, hq), "[hidden_size, num_attention_heads*head_dim]"),
    ]
    if config.attention_bias:
        out += [
            ("self_attn.q_proj.bias", (hq,), "[num_attention_heads*head_dim]"),
            ("self_attn.k_proj.bias", (hkv,), "[num_key_value_heads*head_dim]"),
            ("self_attn.v_proj.bias", (hkv,), "[num_key_value_heads*head_dim]"),
            ("self_attn.o_proj.bias", (H,), "[hidden_size]"),
        ]
    return out + [
        ("self_attn.q_norm.weight", (D,), "[head_dim]"),
        ("self_attn.k_norm.weight", (D,), "[head_dim]"),
        ("mlp.gate_proj.weight", (I, H), "[intermediate_size, hidden_size]"),
        ("mlp.up_proj.weight", (I, H), "[intermediate_size, hidden_size]"),
        ("mlp.down_proj.weight", (H, I), "[hidden_size, intermediate_size]"),
        ("input_layernorm.weight", (H,), "[hidden_size]"),
        ("post_attention_layernorm.weight", (H,), "[hidden_size]"),
    ]


def layer_linears(config, p: str) -> list[tuple[str, tuple[str, ...]]]:
    """vLLM stacks q/k/v into qkv_proj and gate/up into gate_up_proj (Qwen3DSparkForCausalLM's loader)."""
    attn, mlp = f"{p}self_attn.", f"{p}mlp."
    return [
        (f"model.{attn}qkv_proj", tuple(f"{attn}{x}_proj.weight" for x in "qkv")),
        (f"model.{attn}o_proj", (f"{attn}o_proj.weight",)),
        (f"model.{mlp}gate_up_proj", (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight")),
        (f"model.{mlp}down_proj", (f"{mlp}down_proj.weight",)),
    ]


# --- validate rules of the family (docs/validate.md, DSP035) -------------------------------------------------------

# rope_type values vLLM's get_rope builds (vllm/model_executor/layers/rotary_embedding/__init__.py, get_rope; any
# other raises "Unknown RoPE scaling type"), and the attention kinds _resolve_layer_attention tells apart.
VLLM_ROPE_TYPES = ("default", "linear", "dynamic", "ntk", "yarn", "deepseek_yarn", "deepseek_llama_scaling", "llama3",
                   "longrope", "mllama4", "xdrope")
LAYER_TYPES = ("full_attention", "sliding_attention")


def backbone_values(ctx):
    """DSP035 per config value vLLM's Qwen3 backbone cannot build from (vllm/model_executor/models/qwen3_dflash.py,
    DFlashQwen3DecoderLayer.__init__, which Qwen3DSparkModel reuses): hidden_act (its MLP is qwen2.Qwen2MLP, which
    raises "Unsupported activation ... Only silu is supported for now" for anything else), rms_norm_eps (the eps of
    every RMSNorm), max_position_embeddings (get_rope's cache length), attention_bias, is_neox_style, rope_theta,
    rope_parameters (get_rope: a dict whose rope_type it knows, rope_theta, partial_rotary_factor in (0, 1]),
    layer_types (indexed per layer by _resolve_layer_attention, so it needs one known entry per layer) and the
    sliding window of sliding layers. The geometry keys are DSP010's, logit_scale DSP032's."""
    from dspark_cli.runtime.checkpoint.rules.codes import Results
    from dspark_cli.runtime.checkpoint.rules.values import as_dict, positive_int

    out, view = Results(), ctx.config.vllm_config
    fix = "Copy the value from the config the draft was trained with (DeepSpec copies the target's)."

    def bad(key: str, value, need: str, fails: str) -> None:
        out.add("DSP035", f"config.json key {key!r} is {value!r}; vLLM's Qwen3 backbone needs {need} ({fails}).", fix)

    if "hidden_act" in view and view["hidden_act"] != "silu":
        bad("hidden_act", view["hidden_act"], '"silu"', "Qwen2MLP raises 'Unsupported activation'")
    eps = view.get("rms_norm_eps", 1e-6)
    if not (_number(eps) and 0 < eps < float("inf")):
        bad("rms_norm_eps", eps, "a positive number", "the eps of every RMSNorm")
    if "max_position_embeddings" in view and not positive_int(view["max_position_embeddings"]):
        bad("max_position_embeddings", view["max_position_embeddings"], "a positive integer", "get_rope's max_position")
    for key in ("attention_bias", "is_neox_style"):
        if key in view and not isinstance(view[key], bool):
            bad(key, view[key], "true or false", "it selects the layer's biases / RoPE layout")
    if "rope_theta" in view and not (_number(view["rope_theta"]) and 0 < view["rope_theta"] < float("inf")):
        bad("rope_theta", view["rope_theta"], "a positive number", "the RoPE base set_default_rope_theta keeps")
    out += _rope_parameters(view)
    types, layers = view.get("layer_types"), view.get("num_hidden_layers")
    window = as_dict(view.get("dflash_config")).get("swa_window_size", view.get("sliding_window"))
    if isinstance(types, list) and "sliding_attention" in types and window is not None and not positive_int(window):
        bad("sliding_window", window, "a positive integer", "the attention window of the sliding layers")
    if types is not None:
        known = isinstance(types, list) and all(t in LAYER_TYPES for t in types)
        if not known or (positive_int(layers) and len(types) != layers):
            bad("layer_types", types, f"a list of {layers} entries, each {' or '.join(LAYER_TYPES)}",
                "_resolve_layer_attention reads layer_types[i] for every draft layer")
    return out


def _rope_parameters(view: dict):
    from dspark_cli.runtime.checkpoint.rules.codes import Results

    out = Results()
    params = view.get("rope_parameters")
    if params is None:
        return out
    fix = "Write rope_parameters as the target's: {\"rope_type\": \"default\", \"rope_theta\": ...}."
    if not isinstance(params, dict):
        out.add("DSP035", f"config.json key 'rope_parameters' is {params!r}; vLLM's get_rope needs an object of RoPE "
                "settings.", fix)
        return out
    kind, theta = params.get("rope_type", "default"), params.get("rope_theta", 1e6)
    factor = params.get("partial_rotary_factor", 1.0)
    if kind not in VLLM_ROPE_TYPES:
        out.add("DSP035", f"rope_parameters.rope_type is {kind!r}; vLLM's get_rope raises 'Unknown RoPE scaling "
                f"type' for anything but {', '.join(VLLM_ROPE_TYPES)}.", fix)
    if not (_number(theta) and 0 < theta < float("inf")):
        out.add("DSP035", f"rope_parameters.rope_theta is {theta!r}; RoPE needs a positive base.", fix)
    if not (_number(factor) and 0 < factor <= 1):
        out.add("DSP035", f"rope_parameters.partial_rotary_factor is {factor!r}; vLLM's get_rope raises unless it is "
                "in (0, 1].", fix)
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- a new draft for a target (dspark train) ------------------------------------------------------------------------

def draft_config(target: TargetConfig, shape, target_layers: list[int], mask, anchors: int) -> dict[str, Any]:
    """DeepSpec's Qwen3 build_draft_config: the target's (text) config with the draft fields overridden (shape: train's
    DraftShape, mask: its MaskChoice)."""
    config = {k: v for k, v in target.text.items()
              if k not in ("_name_or_path", "dtype", "torch_dtype", "transformers_version", "auto_map",
                           "sliding_window", "use_sliding_window", "max_window_layers")}
    config.update(
        architectures=[ARCHITECTURE],
        model_type="qwen3",
        hidden_act="silu",  # the draft's MLP is Qwen3's (SiLU) whatever the target's is; vLLM builds only that
        num_hidden_layers=shape.layers,
        num_target_layers=target.num_hidden_layers,
        layer_types=["full_attention"] * shape.layers,
        target_layer_ids=list(target_layers),
        mask_token_id=mask.token_id,
        block_size=shape.block_size,
        num_anchors=anchors,
        markov_rank=shape.markov_rank,
        enable_confidence_head=shape.confidence,
        confidence_head_with_markov=bool(shape.confidence and shape.confidence_with_markov and shape.markov_rank),
        tie_word_embeddings=False,
        vocab_size=mask.vocab_size,
        use_cache=True,
    )
    config.update(_attention_geometry(target.text))
    if shape.markov_rank:
        config["markov_head_type"] = shape.markov_head_type
    if mask.vocab_size != target.vocab_size:
        config["draft_vocab_size"] = target.vocab_size
    return config


def _attention_geometry(text: dict[str, Any]) -> dict[str, Any]:
    """Qwen3 layer geometry for the draft of a target without attention layers (a pure state-space model such as
    Mamba2, whose config has no attention heads or MLP width): heads of up to 128 dims, a 3 H MLP."""
    if "num_attention_heads" in text and "intermediate_size" in text:
        return {}
    hidden = text["hidden_size"]
    head_dim = min(128, hidden)
    heads = max(1, hidden // head_dim)
    return {"num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": head_dim,
            "intermediate_size": 3 * hidden, "rms_norm_eps": text.get("layer_norm_epsilon", 1e-6)}


FAMILY = Family(
    name="qwen3",
    architectures=(ARCHITECTURE, "DSparkDraftModel", "DFlashDraftModel", "Qwen3DFlashModel", "DFlashQwen3Model"),
    title="Qwen3",
    resolve=resolve,
    layer_tensors=layer_tensors,
    layer_linears=layer_linears,
    vllm_shares_embeddings=True,
    draft_config=draft_config,
    rules=(backbone_values,),
)
