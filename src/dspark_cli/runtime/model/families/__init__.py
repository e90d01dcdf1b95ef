"""The registry of draft families' forward passes: one module per family, registered here by the name its
torch-free schema has in `runtime/checkpoint/families/` (docs/architecture.md "Adding a draft family").

A family module provides `DecoderLayer(config)` (with `.self_attn.key_value(context, cos, sin)` for the context
K/V and `forward(x, cos, sin, context_kv, attn_mask)`), `Norm` (its RMSNorm), `embed_scale(config)` (a factor on the
token embeddings, or None) and `logits(raw, config)` (what happens to lm_head's output before the Markov bias). A family whose layers convolve
along the query block (DFlash2) sets `BLOCK_CONVOLUTION = True`; its layers then take the block length.
"""

from __future__ import annotations

from types import ModuleType

from dspark_cli.runtime.model.families import dflash2, gemma4, qwen3

BACKBONES: dict[str, ModuleType] = {"qwen3": qwen3, "gemma4": gemma4, "dflash2": dflash2}
