"""The DFlash2 walk: one token per mask slot through the selector's edge scores (docs/formats-other.md §7.4; vLLM
`vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py` `_selector_walk_kernel` and llama.cpp b11434
`common/speculative.cpp` (`is_dflash2`), read for the rule).

For blocks b and slots j = 1..N (scores S [B, N, k, k] from runtime/model/selector.py, candidates c [B, N, k]):

    i_0 = 0                                       # slot 1's rows are all alike: its predecessor is the anchor
    row_j = S_j[i_{j-1}, :]                       # [k] the realized row
    d_j = pick(row_j scattered over the vocabulary, -inf elsewhere)    # argmax, or a Gumbel-max sample
    i_j = the index of d_j among c_j

Sampling draws d_j from q_j = target_probs(row_j, params) (the target's temperature / top-k / top-p on the k
scores), which is the q rejection sampling is given, so the loop stays exact at T > 0. The confidence of slot j is
the top-1 share of softmax(row_j) (what llama.cpp's p_min cuts at), kept as its logit log(p / (1 - p)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_cli.runtime.decode.markov import pick
from dspark_cli.runtime.settings import SamplingParams


@dataclass
class SelectorWalk:
    tokens: torch.Tensor  # [B, N] int64 target ids
    rows: torch.Tensor  # [B, N, V] fp32: the realized rows at the candidate ids, -inf elsewhere
    confidence_logits: torch.Tensor  # [B, N] fp32 logit of each realized row's top-1 softmax share


@torch.no_grad()
def selector_walk(scores: torch.Tensor, ids: torch.Tensor, vocab: int, params: SamplingParams,
                  noise: torch.Tensor | None) -> SelectorWalk:
    """scores [B, N, k, k] fp32, candidate ids [B, N, k], noise [B, N, V] standard Gumbel (None when greedy)."""
    if not params.greedy and noise is None:
        raise ValueError("sampling (temperature > 0) needs Gumbel noise [B, N, V]")
    batch, n_steps, k = ids.shape
    rows = scores.new_full((batch, n_steps, vocab), float("-inf"))
    realized = scores.new_empty(batch, n_steps, k)
    tokens = ids.new_empty(batch, n_steps)
    previous = ids.new_zeros(batch)  # [B] index into the previous slot's candidates
    arange = torch.arange(batch, device=ids.device)
    for j in range(n_steps):
        realized[:, j] = scores[arange, j, previous]  # [B, k]
        rows[:, j].scatter_(-1, ids[:, j], realized[:, j])
        tokens[:, j] = pick(rows[:, j], params, None if noise is None else noise[:, j])  # [B]
        previous = (ids[:, j] == tokens[:, j, None]).long().argmax(-1)  # [B]
    return SelectorWalk(tokens, rows, top1_logit(realized))


def top1_logit(rows: torch.Tensor) -> torch.Tensor:
    """[..., k] scores -> [...] log(p / (1 - p)) of p = the largest softmax share (+inf when k = 1)."""
    best = rows.argmax(-1, keepdim=True)
    others = rows.scatter(-1, best, float("-inf")) - rows.gather(-1, best)  # [..., k]
    return -torch.logsumexp(others, dim=-1)
