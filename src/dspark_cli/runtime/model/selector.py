"""DFlash2's path selector: the low-rank top-K edge scores of a block (docs/formats-other.md §7.4; vLLM
`qwen3_dflash2.py` `CandidateSelector`, llama.cpp b11434 `build_dflash2_selector`, read for the semantics).

For mask slot j with final-norm hidden h_j, candidates c_j (the top-k ids of the draft's logits) and their logits
u_j, and predecessors p_j (the anchor for the first slot, the previous slot's candidates after it):

    S_j[a, b] = u_j[b] + sum_r P[p_j[a], r] * (W h_j)[r] * Q[c_j[b], r]          [k, k]

P = predecessor_codebook [V, r], Q = successor_codebook [V, r], W = hidden_projection [r, H]. The walk over S
(greedy or sampled) is runtime/decode/selector.py's.
"""

from __future__ import annotations

import torch
from torch import nn


class CandidateSelector(nn.Module):
    def __init__(self, vocab: int, rank: int, hidden: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))  # indexed by target id
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def init_parameters(self, std: float) -> None:
        """Both codebooks N(0, std), like the Markov head's tables: at zero the edge term and both its gradients
        would stay zero (a product of the two codebooks)."""
        nn.init.normal_(self.predecessor_codebook, std=std)
        nn.init.normal_(self.successor_codebook, std=std)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [..., N, V] -> (ids [..., N, k] int64, their logits [..., N, k]), largest first."""
        values, ids = logits.topk(self.top_k, dim=-1)
        return ids, values

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, unary: torch.Tensor,
                anchor: torch.Tensor) -> torch.Tensor:
        """hidden [..., N, H], candidate ids / logits [..., N, k], anchor ids [...] -> scores [..., N, k, k]
        (predecessor index a, candidate index b) in fp32."""
        first = anchor[..., None, None].expand(*ids.shape[:-2], 1, ids.shape[-1])  # [..., 1, k]
        predecessors = torch.cat([first, ids[..., :-1, :]], dim=-2)  # [..., N, k]
        return unary.float()[..., None, :] + self.pairwise(hidden, predecessors, ids)  # [..., N, k, k]

    def pairwise(self, hidden: torch.Tensor, predecessors: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """hidden [..., N, H], predecessor ids [..., N, m], candidate ids [..., N, k] -> the low-rank edge term
        [..., N, m, k] fp32: sum_r P[pred, r] * (W h)[r] * Q[cand, r]."""
        gate = self.hidden_projection(hidden).float()  # [..., N, r]
        pred = self.predecessor_codebook[predecessors].float() * gate[..., None, :]  # [..., N, m, r]
        succ = self.successor_codebook[ids].float()  # [..., N, k, r]
        return pred @ succ.transpose(-1, -2)  # [..., N, m, k]

    def teacher_bias(self, hidden: torch.Tensor, logits: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Training: the pairwise term of each slot's top-k candidates given the true previous token, scattered over
        the vocabulary (0 elsewhere). hidden [..., N, H], logits [..., N, V], previous ids [..., N] -> [..., N, V]."""
        ids = logits.detach().topk(self.top_k, dim=-1).indices  # [..., N, k]
        edge = self.pairwise(hidden, previous[..., None], ids)[..., 0, :]  # [..., N, k]
        return torch.zeros_like(logits).scatter(-1, ids, edge.to(logits.dtype))
