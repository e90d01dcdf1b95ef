"""The Markov stage: turn a block's base logits into draft tokens, one position at a time.

For position i = 0..N-1 (prev_0 = the anchor, a target-vocab id):

    e_i      = W1[prev_i]                                   # [r]
    logits_i = base_i + scale * W2 @ e_i                    # [Vd] draft vocabulary
    d_i      = pick(logits_i)                               # argmax, or Gumbel-max of the processed logits
    prev_i+1 = d_i + d2t[d_i]                               # back to a target id

Four strategies compute the same thing at different cost (dspark-format.md §3.1-3.2):
  dense   the full [Vd] bias at every step (vLLM's `_sample_sequential`);
  topk    candidates = the top-k of the base logits per position, fixed before the walk; only their W2
          rows are read; the row is -inf elsewhere, so the draft distribution lives on the k candidates
          (k = Vd is exactly dense);
  nvfp4   topk with an NVFP4 W2, dequantizing only the gathered rows (kernels.markov.nvfp4_gathered_bias,
          the Triton kernel on CUDA, its torch twin elsewhere);
  fused   the whole walk over the top-k candidates in one kernel (kernels.markov.markov_walk).
With the same Gumbel noise they pick the same tokens. A draft without a Markov head (DFlash, rank 0)
picks every position from its base logits.

Picking: greedy takes argmax(logits_i). Sampling takes argmax(processed_logits(logits_i) + g_i) with
g_i standard Gumbel noise, an exact sample of q_i = sampling.target_probs(logits_i, params): the draft
uses the target's temperature / top-k / top-p, and q_i is what rejection sampling must be given.
The fused kernel applies only a temperature, so it refuses top-k / top-p sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dspark_cli.runtime.sampling import SamplingParams, gumbel_argmax, processed_logits

if TYPE_CHECKING:
    from dspark_cli.kernels.nvfp4 import NVFP4Weight

STRATEGIES = ("dense", "topk", "nvfp4", "fused")


@dataclass(frozen=True)
class MarkovWeights:
    """The Markov head's tensors as the walk reads them."""

    w1: torch.Tensor  # [V, r], indexed by target id
    w2: torch.Tensor  # [Vd, r], rows by draft id (dequantized when the checkpoint head is NVFP4)
    w2_nvfp4: "NVFP4Weight | None"  # the checkpoint's NVFP4 W2 (packed rows for the gathers), or None
    scale: float  # logit_scale
    d2t: torch.Tensor | None  # [Vd] int64 offsets: target id = draft id + d2t[draft id]

    @classmethod
    def from_draft(cls, draft) -> "MarkovWeights | None":
        """The weights of a DSparkDraft's Markov head; None for a draft without one (DFlash)."""
        if draft.markov_head is None:
            return None
        return cls(
            w1=draft.markov_head.markov_w1.weight,
            w2=draft.markov_head.markov_w2.weight,
            w2_nvfp4=draft.w2_nvfp4,
            scale=draft.config.logit_scale,
            d2t=draft.d2t,
        )


@dataclass
class MarkovResult:
    """One block's walk."""

    tokens: torch.Tensor  # [N] int64 target ids
    logits: torch.Tensor  # [N, Vd] fp32 corrected logits (-inf outside the candidates for topk/nvfp4/fused)
    embeds: torch.Tensor | None  # [N, r] e_i = W1[prev_i] (confidence-head input); None without a Markov head


def choose_strategy(
    requested: str, weights: MarkovWeights | None, draft_topk: int | None, params: SamplingParams, on_cuda: bool
) -> str:
    """Resolve "auto" and check that the requested strategy can run; raises ValueError with the fix.

    auto: dense without --draft-topk; with it, the fused walk on CUDA (when the sampling allows it),
    else nvfp4 for an NVFP4 head, else topk.
    """
    filtered_sampling = not params.greedy and (params.top_k > 0 or params.top_p < 1.0)
    if requested == "auto":
        if weights is None or draft_topk is None:
            return "dense"
        if on_cuda and not filtered_sampling:
            return "fused"
        return "nvfp4" if weights.w2_nvfp4 is not None else "topk"
    if requested not in STRATEGIES:
        raise ValueError(f"unknown Markov strategy {requested!r}; choose one of auto, {', '.join(STRATEGIES)}")
    if requested != "dense" and draft_topk is None:
        raise ValueError(f"the {requested} Markov strategy gathers top-k candidates; pass --draft-topk K")
    if requested == "nvfp4" and (weights is None or weights.w2_nvfp4 is None):
        raise ValueError("the nvfp4 Markov strategy needs a draft whose markov_w2 is NVFP4 (see `dspark quantize`)")
    if requested == "fused" and filtered_sampling:
        raise ValueError("the fused Markov walk applies only a temperature; drop --top-k/--top-p or pick "
                         "--markov dense/topk")
    return requested


def markov_walk(
    strategy: str,
    weights: MarkovWeights | None,
    base_logits: torch.Tensor,
    anchor: int,
    params: SamplingParams,
    noise: torch.Tensor | None = None,
    draft_topk: int | None = None,
) -> MarkovResult:
    """Walk one block. base_logits [N, Vd]; noise [N, Vd] standard Gumbel (needed unless greedy).

    `strategy` is one of STRATEGIES (see choose_strategy); draft_topk is the candidate count of the
    gathered strategies, clamped to Vd.
    """
    base = base_logits.float()  # [N, Vd]
    if not params.greedy and noise is None:
        raise ValueError("sampling (temperature > 0) needs Gumbel noise [N, Vd]")
    if weights is None:
        picks = torch.stack([_pick(base[i], params, noise, i) for i in range(base.shape[0])])  # [N] draft ids
        return MarkovResult(tokens=picks, logits=base, embeds=None)
    if strategy == "dense":
        return _dense_walk(weights, base, anchor, params, noise)
    k = min(draft_topk, base.shape[-1])
    if strategy == "fused":
        return _fused_walk(weights, base, anchor, params, noise, k)
    return _gathered_walk(weights, base, anchor, params, noise, k, nvfp4=strategy == "nvfp4")


def _pick(row: torch.Tensor, params: SamplingParams, noise: torch.Tensor | None, i: int) -> torch.Tensor:
    """[Vd] fp32 logits -> 0-dim draft id: argmax, or a Gumbel-max sample of target_probs(row, params)."""
    if params.greedy:
        return row.argmax()
    return gumbel_argmax(processed_logits(row[None], params), 1.0, noise[i][None])[0]


def _to_target(weights: MarkovWeights, draft_id: torch.Tensor) -> torch.Tensor:
    return draft_id if weights.d2t is None else draft_id + weights.d2t[draft_id]


def _dense_walk(weights, base, anchor, params, noise) -> MarkovResult:
    n_steps = base.shape[0]
    logits = torch.empty_like(base)  # [N, Vd]
    tokens = torch.empty(n_steps, dtype=torch.long, device=base.device)
    embeds = torch.empty(n_steps, weights.w1.shape[1], dtype=weights.w1.dtype, device=base.device)
    prev = torch.tensor(anchor, device=base.device)
    for i in range(n_steps):
        embeds[i] = weights.w1[prev]  # [r]
        bias = weights.w2 @ embeds[i].to(weights.w2.dtype)  # [Vd, r] x [r] -> [Vd]
        logits[i] = base[i] + weights.scale * bias.float()
        prev = _to_target(weights, _pick(logits[i], params, noise, i))
        tokens[i] = prev
    return MarkovResult(tokens=tokens, logits=logits, embeds=embeds)


def _gathered_walk(weights, base, anchor, params, noise, k: int, *, nvfp4: bool) -> MarkovResult:
    from dspark_cli.kernels import triton_available
    from dspark_cli.kernels.markov import gathered_bias_reference, nvfp4_gathered_bias, nvfp4_gathered_bias_reference

    n_steps = base.shape[0]
    values, cand_ids = base.topk(k, dim=-1)  # [N, k], [N, k] draft ids
    logits = torch.full_like(base, float("-inf"))  # [N, Vd]
    tokens = torch.empty(n_steps, dtype=torch.long, device=base.device)
    embeds = torch.empty(n_steps, weights.w1.shape[1], dtype=weights.w1.dtype, device=base.device)
    if nvfp4:  # the Triton kernel on CUDA, its torch twin elsewhere; both write the candidates in place
        w2 = weights.w2_nvfp4
        add_bias = nvfp4_gathered_bias if triton_available(base) else nvfp4_gathered_bias_reference
    else:
        w2, add_bias = weights.w2, gathered_bias_reference
    prev = torch.tensor(anchor, device=base.device)
    for i in range(n_steps):
        embeds[i] = weights.w1[prev]  # [r]
        add_bias(embeds[i][None], w2, values[i][None], cand_ids[i][None], logits[i][None], weights.scale)  # row i
        prev = _to_target(weights, _pick(logits[i], params, noise, i))
        tokens[i] = prev
    return MarkovResult(tokens=tokens, logits=logits, embeds=embeds)


def _fused_walk(weights, base, anchor, params, noise, k: int) -> MarkovResult:
    from dspark_cli.kernels.markov import markov_walk as fused_walk

    values, cand_ids = base.topk(k, dim=-1)  # [N, k]
    gumbel = None if params.greedy else noise.gather(-1, cand_ids)[None]  # [1, N, k]
    w2 = weights.w2_nvfp4 if weights.w2_nvfp4 is not None else weights.w2
    first_prev = torch.tensor([anchor], device=base.device)
    tokens, corrected = fused_walk(values[None], cand_ids[None], first_prev, weights.w1, w2, weights.scale,
                                   weights.d2t, gumbel, params.temperature)  # fmt: skip  # [1, N], [1, N, k]
    logits = torch.full_like(base, float("-inf")).scatter_(-1, cand_ids, corrected[0])  # [N, Vd]
    prev_ids = torch.cat([first_prev, tokens[0, :-1]])  # [N] target ids before each position
    return MarkovResult(tokens=tokens[0], logits=logits, embeds=weights.w1[prev_ids])
