"""The Gemma-4 draft layer: DeepSpec's `Gemma4DSparkModel` (deepspec/modeling/dspark/gemma4/modeling.py) as vLLM's
`gemma4_dspark.py` serves it (docs/format.md §6). Where it differs from Qwen3:

- attention: head_dim = global_head_dim; with attention_k_eq_v there is no v_proj and the values are the keys'
  projection, normalised by a weightless RMSNorm (v_norm) and not rotated; scores are not scaled (scale 1.0,
  q_norm and k_norm fix the scale); proportional RoPE (only part of each head rotates);
- sandwich norms: post_attention_layernorm on the attention output and pre/post_feedforward_layernorm around the
  GELU-tanh MLP, each before its residual add; the layer output is multiplied by layer_scalar;
- RMSNorm multiplies by its weight in fp32 before casting back (plain w, not Gemma 2/3's 1 + w);
- token embeddings are multiplied by sqrt(hidden_size); logits are soft-capped, tanh(l / cap) * cap, before the
  Markov bias is added (DeepSpec's compute_logits, then sample_block_tokens).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.model.layers import apply_rope, block_attention, split_heads

ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


class Norm(nn.Module):
    """Gemma-4's RMSNorm: x * (mean(x^2) + eps)^-1/2 * w, all in fp32, cast back; no weight if with_scale=False."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        bias = config.attention_bias
        self.q_proj = nn.Linear(H, self.heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.kv_heads * D, bias=bias)
        self.v_proj = None if config.attention_k_eq_v else nn.Linear(H, self.kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.heads * D, H, bias=bias)
        self.q_norm = Norm(D, config.rms_norm_eps)
        self.k_norm = Norm(D, config.rms_norm_eps)
        self.v_norm = Norm(D, config.rms_norm_eps, with_scale=False)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[B, T, H] -> k, v [B, kv_heads, T, D]: k normed and rotated, v = v_norm(v_proj(x) or k_proj(x))."""
        k = split_heads(self.k_proj(x), self.kv_heads, self.head_dim)
        v = k if self.v_proj is None else split_heads(self.v_proj(x), self.kv_heads, self.head_dim)
        return apply_rope(self.k_norm(k), cos, sin), self.v_norm(v)

    def forward(self, x, cos, sin, context: tuple[torch.Tensor, torch.Tensor], attn_mask):
        q = apply_rope(self.q_norm(split_heads(self.q_proj(x), self.heads, self.head_dim)), cos, sin)
        k, v = self.key_value(x, cos, sin)
        return self.o_proj(block_attention(q, k, v, context, attn_mask, scale=1.0))


class MLP(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.act = ACTIVATIONS.get(config.hidden_act, ACTIVATIONS["gelu_pytorch_tanh"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = Norm(H, eps)
        self.post_attention_layernorm = Norm(H, eps)
        self.pre_feedforward_layernorm = Norm(H, eps)
        self.post_feedforward_layernorm = Norm(H, eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # saved and loaded like a weight (DeepSpec, vLLM)

    def forward(self, x, cos, sin, context, attn_mask):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, context, attn_mask))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar


def embed_scale(config: DraftConfig) -> float:
    return math.sqrt(config.hidden_size)


def logits(raw: torch.Tensor, config: DraftConfig) -> torch.Tensor:
    cap = config.final_logit_softcapping
    return raw if cap is None else torch.tanh(raw / cap) * cap
