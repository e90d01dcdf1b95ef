"""Pieces every draft family's decoder layer uses: RMSNorm, rotary embeddings, block attention and each layer's mask
(dense, causal or sliding-window: docs/format.md §2.3), the attention module and the gated MLP (each family
configures the last two: docs/format.md §2, §6)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dspark_cli.runtime.checkpoint.config import DraftConfig, LayerAttention


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in fp32, cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, partial: float = 1.0):
    """[B, T] int positions -> cos, sin [B, 1, T, head_dim] (neox layout: halves rotated together).

    partial < 1 is Gemma-4's proportional RoPE: the frequencies keep the full head_dim denominator, and only the
    first int(partial * head_dim / 2) of the head_dim / 2 rotate; the rest have frequency 0 (left unrotated)."""
    angles = int(partial * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = torch.cat([1.0 / theta**exponents, exponents.new_zeros(head_dim // 2 - angles)])  # [D/2]
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated at its positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def split_heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """[B, T, heads*D] -> [B, heads, T, D]"""
    return x.view(*x.shape[:2], heads, head_dim).transpose(1, 2)


def layer_mask(rule: LayerAttention, positions: torch.Tensor, context_length: int, attn_mask):
    """The keys a layer's queries see. Queries at positions [B, Q] attend to [context ; block]: the context's keys at
    positions 0..C-1, the block's at the queries' own positions. attn_mask [B|1, Q, C+Q] bool or None (everything) is
    what every layer sees (training's blocks); a dense layer gets it as it is, any other it AND the rule: the key at k
    is visible to the query at q when q - k < window and k <= q (causal) or k - q < window (not causal)."""
    if rule.dense:
        return attn_mask
    B = positions.shape[0]
    context = torch.arange(context_length, device=positions.device).expand(B, -1)  # [B, C]
    distance = positions[:, :, None] - torch.cat([context, positions], dim=1)[:, None, :]  # q - k [B, Q, C+Q]
    bound = float("inf") if rule.window is None else rule.window
    visible = (distance < bound) & ((distance >= 0) if rule.causal else (-distance < bound))  # [B, Q, C+Q]
    return visible if attn_mask is None else visible & attn_mask


def block_attention(q, k, v, context: tuple[torch.Tensor, torch.Tensor], attn_mask, scale: float | None = None):
    """q [B, heads, Q, D] attends to [context ; block] keys/values ([B, kv_heads, C|Q, D]); attn_mask
    [B|1, Q, C+Q] bool or None (everything visible). -> [B, Q, heads*D]"""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = torch.cat([context[0].to(k.dtype), k], dim=2)
    v = torch.cat([context[1].to(v.dtype), v], dim=2)
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    mask = None if attn_mask is None else attn_mask[:, None]  # [B|1, 1, Q, C+Q]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, heads, Q, D]
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


class Attention(nn.Module):
    """A draft layer's attention of the block over [context ; block]: q and k normed by `norm` (the family's RMSNorm)
    and rotated; the values from v_proj, or with values_from_keys (Gemma-4's attention_k_eq_v) from k_proj before its
    norm and rotation; then v_norm when given; scores scaled by `scale` (None: 1/sqrt(head_dim))."""

    def __init__(self, config: DraftConfig, norm: Callable[[int, float], nn.Module] = RMSNorm,
                 values_from_keys: bool = False, v_norm: nn.Module | None = None, scale: float | None = None):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        bias = config.attention_bias
        self.q_proj = nn.Linear(H, self.heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.kv_heads * D, bias=bias)
        self.v_proj = None if values_from_keys else nn.Linear(H, self.kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.heads * D, H, bias=bias)
        self.q_norm = norm(D, config.rms_norm_eps)
        self.k_norm = norm(D, config.rms_norm_eps)
        self.v_norm = v_norm
        self.scale = scale

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[B, T, H] -> k, v [B, kv_heads, T, D]: k normed and rotated, v = v_norm(v_proj(x) or k_proj(x))."""
        k = split_heads(self.k_proj(x), self.kv_heads, self.head_dim)
        v = k if self.v_proj is None else split_heads(self.v_proj(x), self.kv_heads, self.head_dim)
        return apply_rope(self.k_norm(k), cos, sin), v if self.v_norm is None else self.v_norm(v)

    def forward(self, x, cos, sin, context: tuple[torch.Tensor, torch.Tensor], attn_mask):
        """Block x [B, Q, H] attends to [context ; block]; attn_mask [B|1, Q, C+Q] bool or None (all)."""
        q = apply_rope(self.q_norm(split_heads(self.q_proj(x), self.heads, self.head_dim)), cos, sin)
        k, v = self.key_value(x, cos, sin)
        return self.o_proj(block_attention(q, k, v, context, attn_mask, scale=self.scale))


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)): SwiGLU with act = silu (Qwen3), GELU-tanh for Gemma-4."""

    def __init__(self, config: DraftConfig, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
