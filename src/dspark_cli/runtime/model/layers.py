"""Pieces every draft family's decoder layer uses: RMSNorm, rotary embeddings, non-causal block attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
