"""The vanilla (first-order) Markov head: the latent of position k is e_k = W1[prev_k] itself, so the bias is
W2 e_k (DeepSpec `VanillaMarkov`, vLLM `DSparkMarkovHead`). The gated and RNN heads derive from it."""

from __future__ import annotations

import torch
from torch import nn


class VanillaHead(nn.Module):
    type_name = "vanilla"  # its markov_head_type
    uses_hidden = False  # the latent depends on the backbone's hidden state (gated, rnn)
    recurrent = False  # the latent carries state from one position to the next (rnn)

    def __init__(self, vocab: int, draft_vocab: int, rank: int, hidden: int):
        super().__init__()
        self.hidden_size = hidden  # the width of the hidden states h_k a gated / RNN head reads
        self.markov_w1 = nn.Embedding(vocab, rank)  # indexed by target-vocab id
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)  # rows indexed by draft id

    def initial_state(self, batch: int, like: torch.Tensor) -> torch.Tensor | None:
        """The state before position 0 of a block ([B, r] zeros for the RNN head; None when stateless)."""
        return None

    def step(self, state, embed: torch.Tensor, hidden: torch.Tensor | None):
        """One position: embed e_k [B, r], hidden h_k [B, H] -> (latent u_k [B, r], next state)."""
        return embed, state

    def block_latents(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced latents of whole blocks: embeds [..., K, r], hidden [..., K, H] -> [..., K, r]."""
        return embeds
