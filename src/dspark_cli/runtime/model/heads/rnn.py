"""The RNN Markov head (DeepSpec `RNNHead`; speculators MarkovHead head_type "rnn"): a GRU-like state over the
block, zero before position 0 of every block.

    z_k       = [s_{k-1} ; e_k ; h_k]                 state, embedding, hidden, in that order
    a, c, o   = joint_proj(z_k).chunk(3)              joint_proj: Linear(2r + H -> 3r) with bias
    s_k       = sigmoid(a) * s_{k-1} + (1 - sigmoid(a)) * tanh(c)
    u_k       = tanh(o)                                from z_k, i.e. the previous state; the bias is W2 u_k

Position k sees every earlier token of the block through s_{k-1}, not only the previous one."""

from __future__ import annotations

import torch
from torch import nn

from dspark_cli.runtime.model.heads.vanilla import VanillaHead


class RNNHead(VanillaHead):
    type_name = "rnn"
    uses_hidden = True
    recurrent = True

    def __init__(self, vocab: int, draft_vocab: int, rank: int, hidden: int):
        super().__init__(vocab, draft_vocab, rank, hidden)
        self.rank = rank
        self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def initial_state(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(batch, self.rank, dtype=self.joint_proj.weight.dtype, device=like.device)

    def step(self, state, embed, hidden):
        """state s_{k-1} [B, r], e_k [B, r], h_k [B, H] -> (u_k [B, r], s_k [B, r])"""
        z = torch.cat([state, embed.to(state.dtype), hidden.to(state.dtype)], dim=-1)  # [B, 2r + H]
        gate_raw, candidate_raw, output_raw = self.joint_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        return torch.tanh(output_raw), gate * state + (1.0 - gate) * torch.tanh(candidate_raw)

    def block_latents(self, embeds, hidden):
        """Unrolled over the K positions of each block from a zero state: [..., K, r], [..., K, H] -> [..., K, r]"""
        lead = embeds.shape[:-2]
        flat_e, flat_h = embeds.reshape(-1, *embeds.shape[-2:]), hidden.reshape(-1, *hidden.shape[-2:])  # [M, K, .]
        state = self.initial_state(flat_e.shape[0], embeds)
        latents = []
        for k in range(embeds.shape[-2]):
            latent, state = self.step(state, flat_e[:, k], flat_h[:, k])
            latents.append(latent)
        return torch.stack(latents, dim=1).view(*lead, embeds.shape[-2], -1)  # [..., K, r]
