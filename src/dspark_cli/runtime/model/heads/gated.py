"""The gated Markov head (DeepSpec `GatedMarkovHead`; speculators MarkovHead head_type "gated"):

    g_k = sigmoid(gate_proj([h_k ; e_k]))      gate_proj: Linear(H + r -> r) with bias; hidden first
    u_k = g_k * e_k                            the bias is W2 u_k

h_k is the draft's final-norm hidden state of position k (the one lm_head reads)."""

from __future__ import annotations

import torch
from torch import nn

from dspark_cli.runtime.model.heads.vanilla import VanillaHead


class GatedHead(VanillaHead):
    type_name = "gated"
    uses_hidden = True

    def __init__(self, vocab: int, draft_vocab: int, rank: int, hidden: int):
        super().__init__(vocab, draft_vocab, rank, hidden)
        self.gate_proj = nn.Linear(hidden + rank, rank)

    def _latent(self, embed: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(embed.dtype), embed], dim=-1)))
        return gate * embed

    def step(self, state, embed, hidden):
        return self._latent(embed, hidden), state

    def block_latents(self, embeds, hidden):
        return self._latent(embeds, hidden)
