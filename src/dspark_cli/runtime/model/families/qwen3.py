"""The Qwen3 draft layer (DeepSpec `Qwen3DSparkModel`, vLLM `qwen3_dspark.py`): pre-norm attention with q/k norms
and full RoPE, a SwiGLU MLP, unscaled embeddings, plain logits (docs/format.md §2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.model.layers import Attention, GatedMLP, RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = GatedMLP(config, F.silu)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, context, attn_mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


Norm = RMSNorm  # the final norm and hidden_norm


def embed_scale(config: DraftConfig) -> float | None:
    return None


def logits(raw: torch.Tensor, config: DraftConfig) -> torch.Tensor:
    return raw
