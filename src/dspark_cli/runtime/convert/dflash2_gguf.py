"""The DFlash2 half of the llama.cpp dflash GGUF (convert/gguf.py writes the rest): its keys, tensor names, which
tensors stay F32, and llama.cpp's start-up refusals checked before anything is written. Torch-free.

What llama.cpp b11434 expects, read from its source:
- conversion/qwen.py DFlashModel (registered for DFlash2DraftModel too): a draft is DFlash2 when its dflash_config
  has `conv_kernel_size`; the four keys `dflash.conv_kernel_size`, `conv_group_size`, `selector_rank`,
  `selector_top_k` are written from dflash_config, `dflash_config.output_multiplier` as `dflash.logit_scale` and
  a positive `final_logit_softcapping` as `dflash.final_logit_softcapping`, which dflash.cpp applies to the
  selector's logits only; modify_tensors adds `.weight` to the two codebooks.
- gguf-py tensor_mapping.py / constants.py: `layers.N.attention_conv.base_kernel` -> `blk.N.attn_conv_base`,
  `kernel_projection` -> `blk.N.attn_conv_proj.weight` (mlp_conv: `ffn_conv_*`), `candidate_selector.*` ->
  `selector_predecessor.weight`, `selector_successor.weight`, `selector_hidden.weight`.
- conversion/base.py prepare_tensors: a tensor whose name does not end in `.weight` (the conv base kernels) is
  written as F32.
- src/models/dflash.cpp load_arch_tensors: start-up refuses a draft missing any of the four keys (or the block
  size), a hidden size not divisible by the group size, or one below top_k·(top_k + 1) (the selector's lattice row,
  top_k candidate ids and top_k² pairwise scores, lives in a hidden-size row); the shapes it loads are
  base_kernel {H, K, 2}, kernel_projection {H, 2·K·H/G}, codebooks {R, V}, hidden_projection {H, R} (ggml order:
  numpy's reversed, so each tensor is written as stored, none transposed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dspark_cli.runtime.checkpoint.families.dflash2 import ARCHITECTURE
from dspark_cli.runtime.checkpoint.families.dflash2 import KEYS as SELECTOR_KEYS

ARCH = "dflash"
LAYER_TENSORS = {  # DFlash2 names inside layers.N -> llama.cpp names inside blk.N
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
TOP_TENSORS = {
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}


@dataclass(frozen=True)
class Dflash2Keys:
    """dflash_config's DFlash2 values as llama.cpp reads them (None: absent or not a positive integer)."""

    conv_kernel_size: int | None
    conv_group_size: int | None
    selector_rank: int | None
    selector_top_k: int | None
    output_multiplier: float | None
    final_logit_softcapping: float | None


def dflash2_keys(raw: dict[str, Any]) -> Dflash2Keys | None:
    """The DFlash2 keys of a draft's config.json, or None when it is not DFlash2: neither architectures
    DFlash2DraftModel nor conv_kernel_size in dflash_config (llama.cpp's converter writes the DFlash2 keys on the
    latter alone, and its loader then needs all four)."""
    table = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    architectures = raw.get("architectures") if isinstance(raw.get("architectures"), list) else []
    if "conv_kernel_size" not in table and ARCHITECTURE not in architectures:
        return None
    return Dflash2Keys(*(_positive_int(table.get(key)) for key in SELECTOR_KEYS),
                       output_multiplier=_number(table.get("output_multiplier")),
                       final_logit_softcapping=_number(table.get("final_logit_softcapping")))


def startup_refusal(keys: Dflash2Keys, hidden_size: int | None, block_size: int | None) -> str | None:
    """Why llama.cpp b11434 would refuse this DFlash2 draft at start-up (src/models/dflash.cpp), or None."""
    missing = [key for key in SELECTOR_KEYS if getattr(keys, key) is None]
    if missing or not block_size:
        named = ", ".join(missing + ([] if block_size else ["block_size"]))
        return f"its dflash_config lacks a positive {named}, which llama.cpp's DFlash2 model requires at start-up"
    if not hidden_size or hidden_size % keys.conv_group_size:
        return (f"its hidden size {hidden_size} is not a multiple of conv_group_size {keys.conv_group_size}, "
                "which llama.cpp refuses at start-up")
    lattice = keys.selector_top_k * (keys.selector_top_k + 1)
    if hidden_size < lattice:
        return (f"its hidden size {hidden_size} is below selector_top_k·(selector_top_k + 1) = {lattice}, the "
                "selector lattice row llama.cpp packs into one hidden-size row, so llama.cpp refuses it at start-up")
    return None


def gguf_keys(keys: Dflash2Keys) -> tuple[dict[str, int], dict[str, float]]:
    """(uint32 keys, float32 keys) conversion/qwen.py writes for a DFlash2 draft."""
    uints = {f"{ARCH}.{key}": getattr(keys, key) for key in SELECTOR_KEYS}
    floats = {}
    if keys.output_multiplier is not None:
        floats[f"{ARCH}.logit_scale"] = keys.output_multiplier
    if keys.final_logit_softcapping is not None and keys.final_logit_softcapping > 0:
        floats[f"{ARCH}.final_logit_softcapping"] = keys.final_logit_softcapping
    return uints, floats


def llamacpp_name(name: str) -> str | None:
    """llama.cpp's name for a DFlash2-only tensor (DeepSpec name, no `model.` prefix), or None."""
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        mapped = LAYER_TENSORS.get(rest)
        return f"blk.{index}.{mapped}" if mapped else None
    return TOP_TENSORS.get(name)


def kept_f32(gguf_name: str) -> bool:
    """Whether llama.cpp's converter writes this tensor as F32 whatever its dtype (a name not ending `.weight`)."""
    return not gguf_name.endswith(".weight")


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
