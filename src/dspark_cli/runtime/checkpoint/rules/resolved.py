"""The report's `resolved` section: the values vLLM would resolve from the checkpoint (docs/validate.md)."""

from __future__ import annotations

from typing import Any

from dspark_cli.runtime.checkpoint.formats import FORMAT_NAMES
from dspark_cli.runtime.checkpoint.layout import MARKOV_W2
from dspark_cli.runtime.checkpoint.rules.context import RuleContext


def resolve(ctx: RuleContext) -> dict[str, Any]:
    config = ctx.config
    resolved: dict[str, Any] = {"format": FORMAT_NAMES[config.format], "architecture": config.architecture}
    if not ctx.is_draft:
        return resolved
    resolved["mask_token"] = {"value": config.mask_token.value, "source": config.mask_token.source}
    resolved["target_layer_ids"] = {
        "value": config.layer_ids, "source": config.target_layer_ids.source,
        "hidden_states_indices": config.hidden_state_indices,
    }
    resolved["block_size"] = {"value": config.block_size.value, "source": config.block_size.source}
    resolved["vocab_size"] = config.vocab_size
    resolved["draft_vocab_size"] = {
        "value": config.draft_vocab_size,
        "source": "draft_vocab_size" if config.vllm_config.get("draft_vocab_size") is not None
        else "vocab_size (default)",
    }
    resolved["target_vocab_size"] = {
        "value": ctx.target_vocab, "source": "the target option" if ctx.target else "assumed = vocab_size",
    }
    depth, depth_source = ctx.target_depth
    resolved["target_depth"] = {"value": depth, "source": depth_source}
    resolved["family"] = config.family
    resolved["markov_rank"] = config.markov_rank
    resolved["markov_head_type"] = config.markov_head_type
    resolved["head_format"] = _head_format(ctx)
    resolved["quantized_linear_layers"] = _quantized_layers(ctx)
    resolved["confidence_head"] = _confidence_summary(ctx)
    resolved["layout"] = "N queries, slot j predicts p+j+1" if config.sample_from_anchor else (
        "1+N queries, mask slot j predicts p+j")
    if config.kind == "dspark":  # the layout vLLM's DSpark speculator serves (DSP033 when it differs)
        resolved["vllm_layout"] = "1+N queries (dspark_bonus_anchor true)" if config.vllm_bonus_anchor else (
            "N queries (dspark_bonus_anchor false or missing)")
    resolved["embed_tokens"] = "own" if ctx.has_embed else "shared from target"
    resolved["lm_head"] = "own" if ctx.has_lm_head else "shared from target"
    resolved["tensors"] = len(ctx.on_disk)
    resolved["shards"] = len(ctx.ckpt.shards)
    resolved["bytes"] = sum(info.nbytes for info in ctx.on_disk.values())
    return resolved


def _head_format(ctx: RuleContext) -> str | None:
    w2 = ctx.tensors.get(MARKOV_W2)
    if w2 is None:
        return None
    if MARKOV_W2 not in ctx.nvfp4_weights:
        return w2.dtype.lower()
    if ctx.head_claim == "W4A16_NVFP4":
        return f"nvfp4 (W4A16, {ctx.quant.algo})"
    return "nvfp4 (not loadable by vLLM, see the DSP3xx findings)"


def _quantized_layers(ctx: RuleContext) -> dict[str, int]:
    """How many Linear weights (markov_w2 aside) each quantized storage holds: {"nvfp4": n, "fp8": m}, empty when
    the layers are unquantized."""
    counts = {"nvfp4": len(ctx.nvfp4_weights - {MARKOV_W2}), "fp8": len(ctx.fp8_weights)}
    return {kind: count for kind, count in counts.items() if count}


def _confidence_summary(ctx: RuleContext) -> str:
    config = ctx.config
    if config.kind != "dspark" or not config.enable_confidence_head:
        return "off"
    return "on, input [hidden; markov]" if config.confidence_head_with_markov else "on, input [hidden]"
