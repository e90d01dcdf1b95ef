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
from dspark_cli.runtime.model.layers import Attention, GatedMLP

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


class DecoderLayer(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, Norm, values_from_keys=config.attention_k_eq_v,
                                   v_norm=Norm(config.head_dim, eps, with_scale=False), scale=1.0)
        self.mlp = GatedMLP(config, ACTIVATIONS.get(config.hidden_act, ACTIVATIONS["gelu_pytorch_tanh"]))
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
