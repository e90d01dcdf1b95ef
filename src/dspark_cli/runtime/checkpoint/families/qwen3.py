"""The Qwen3 draft family (DeepSpec `Qwen3DSparkModel`, vLLM `qwen3_dspark.Qwen3DSparkForCausalLM`; also z-lab DFlash,
SpecForge and speculators drafts, which share its decoder layer): docs/format.md §1."""

from __future__ import annotations

from typing import Any

from dspark_cli.runtime.checkpoint.families import Family, LayerTensor


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


FAMILY = Family(
    name="qwen3",
    architectures=("Qwen3DSparkModel", "DSparkDraftModel", "DFlashDraftModel", "Qwen3DFlashModel", "DFlashQwen3Model"),
    title="Qwen3",
    resolve=resolve,
    layer_tensors=layer_tensors,
    layer_linears=layer_linears,
    vllm_shares_embeddings=True,
)
