"""The DFlash2 draft layer: Qwen3's layer (qwen3.py) with a grouped dynamic convolution along the query block
around its attention and around its MLP (docs/formats-other.md §7.3; vLLM `qwen3_dflash2.py` `_grouped_conv`,
llama.cpp b11434 `build_dflash2_conv`, read for the semantics).

Per path, the coefficients come from the path's input x [B, L, H]: kernel_projection(x) viewed [B, L, 2, K, G], one
set for the input side (0) and one for the output side (1); the weight of tap t at position q and channel h is
base_kernel[side, t, h] + coefficients[q, side, t, h // g]. A side's output at q sums tap t over position q - t of
the same block (zero before the block's first slot): blocks are runs of `block_length` positions (the whole row
when None, as in generation; training packs its anchors' blocks into one row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.model.families import qwen3
from dspark_cli.runtime.model.layers import RMSNorm

BLOCK_CONVOLUTION = True  # draft.block_hidden passes the block length to this family's layers


class GroupedConv(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        H, K = config.hidden_size, config.conv_kernel_size
        self.taps, self.group_size, self.groups = K, config.conv_group_size, H // config.conv_group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, K, H))  # [side, tap, channel]
        self.kernel_projection = nn.Linear(H, 2 * K * self.groups, bias=False)

    def init_parameters(self, std: float) -> None:
        """A new draft's convolution starts as the identity: tap 0 of both sides 1, the other taps 0 (the dynamic
        part, kernel_projection, is a Linear and drawn like the others)."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, H] -> the dynamic part of both sides' kernels [B, L, 2, K, G]."""
        return self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))

    def forward(self, y: torch.Tensor, coefficients: torch.Tensor, side: int, block_length: int | None) -> torch.Tensor:
        """y [B, L, H] convolved along L within blocks, with coefficients [B, L, 2, K, G] -> [B, L, H]."""
        B, L, H = y.shape
        weights = (self.base_kernel[side].unflatten(-1, (self.groups, self.group_size))  # [K, G, g]
                   + coefficients[:, :, side, :, :, None])  # [B, L, K, G, g]
        weights = weights.flatten(-2)  # [B, L, K, H]
        slot = torch.arange(L, device=y.device)
        slot = slot if block_length is None else slot % block_length  # position within the block [L]
        out = weights[:, :, 0] * y
        for tap in range(1, self.taps):
            earlier = F.pad(y[:, : L - tap], (0, 0, tap, 0))  # y at q - tap, zeros before the row [B, L, H]
            out = out + weights[:, :, tap] * earlier * (slot >= tap)[:, None].to(y.dtype)
        return out


class DecoderLayer(qwen3.DecoderLayer):
    def __init__(self, config: DraftConfig):
        super().__init__(config)
        self.attention_conv = GroupedConv(config)
        self.mlp_conv = GroupedConv(config)

    def forward(self, x, cos, sin, context, attn_mask, block_length: int | None = None):
        h = self.input_layernorm(x)
        c = self.attention_conv.coefficients(h)  # [B, L, 2, K, G]
        h = self.attention_conv(h, c, 0, block_length)
        h = self.attention_conv(self.self_attn(h, cos, sin, context, attn_mask), c, 1, block_length)
        x = x + h
        h = self.post_attention_layernorm(x)
        c = self.mlp_conv.coefficients(h)
        h = self.mlp_conv(h, c, 0, block_length)
        return x + self.mlp_conv(self.mlp(h), c, 1, block_length)


Norm = RMSNorm


def embed_scale(config: DraftConfig) -> float | None:
    return config.embedding_scale


def logits(raw: torch.Tensor, config: DraftConfig) -> torch.Tensor:
    cap = config.final_logit_softcapping
    return raw if cap is None else torch.tanh(raw / cap) * cap
