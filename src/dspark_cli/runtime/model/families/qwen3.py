"""The Qwen3 draft layer (DeepSpec `Qwen3DSparkModel`, vLLM `qwen3_dspark.py`): pre-norm attention with q/k norms
and full RoPE, a SwiGLU MLP, unscaled embeddings, plain logits (docs/format.md §2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.model.layers import RMSNorm, apply_rope, block_attention, split_heads


class Attention(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        bias = config.attention_bias
        self.q_proj = nn.Linear(H, self.heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.heads * D, H, bias=bias)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[B, T, H] -> k, v [B, kv_heads, T, D] (k normed and rotated)."""
        k = apply_rope(self.k_norm(split_heads(self.k_proj(x), self.kv_heads, self.head_dim)), cos, sin)
        return k, split_heads(self.v_proj(x), self.kv_heads, self.head_dim)

    def forward(self, x, cos, sin, context: tuple[torch.Tensor, torch.Tensor], attn_mask):
        """Block x [B, Q, H] attends to [context ; block]; attn_mask [B|1, Q, C+Q] bool or None (all)."""
        q = apply_rope(self.q_norm(split_heads(self.q_proj(x), self.heads, self.head_dim)), cos, sin)
        k, v = self.key_value(x, cos, sin)
        return self.o_proj(block_attention(q, k, v, context, attn_mask))


class MLP(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
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
