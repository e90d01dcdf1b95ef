"""The Markov stage: turn a batch of blocks' base logits into draft tokens, one position at a time.

For each request b and position i = 0..N-1 (prev_0 = the request's anchor, a target-vocab id):

    e_i      = W1[prev_i]                                   # [r]
    u_i      = e_i (vanilla) | head.step(s, e_i, h_i)       # [r] gated / RNN heads (runtime/model/heads/)
    logits_i = base_i + scale * W2 @ u_i                    # [Vd] draft vocabulary
    d_i      = pick(logits_i)                               # argmax, or Gumbel-max of the processed logits
    prev_i+1 = draft_to_target(d2t, d_i)                    # back to a target id

One walk (`walk`) runs this loop batch-first; how logits_i is computed is a bias function it is given
(docs/format.md §3.1-3.2):
  dense   `dense_bias`: the full [Vd] bias at every step (vLLM's `_sample_sequential`);
  topk    `gathered_bias` with a bf16/fp32 W2: candidates = the top-k of the base logits per position, fixed
          before the walk; only their W2 rows are read; the row is -inf elsewhere, so the draft distribution
          lives on the k candidates (k = Vd is exactly dense);
  nvfp4   `gathered_bias` with the NVFP4 W2, dequantizing only the gathered rows (kernels.markov.nvfp4_gathered_bias,
          the Triton kernel on CUDA, its torch twin elsewhere).
The fused kernel is the other implementation of the whole walk (`fused_walk`, kernels.markov.markov_walk).
`markov_walk` picks one by strategy; generate and `dspark bench markov` both call it. With the same Gumbel
noise every strategy picks the same tokens. A draft without a Markov head (DFlash, rank 0) picks every
position from its base logits. Gated and RNN heads (DeepSpec's markov_head_type) turn e_i into the latent u_i
from the draft's hidden state h_i of the position (and, RNN, a state that starts at zero every block); the
dense, topk and nvfp4 strategies run them (the bias functions take u_i), the fused kernel reads W1 itself and
runs vanilla heads only.

Picking: greedy takes argmax(logits_i). Sampling takes argmax(processed_logits(logits_i) + g_i) with
g_i standard Gumbel noise, an exact sample of q_i = sampling.target_probs(logits_i, params): the draft
uses the target's temperature / top-k / top-p, and q_i is what rejection sampling must be given.
The fused kernel applies only a temperature, so it refuses top-k / top-p sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from dspark_cli.runtime.decode.sampling import gumbel_argmax, processed_logits
from dspark_cli.runtime.settings import SamplingParams

if TYPE_CHECKING:
    from dspark_cli.kernels.nvfp4 import NVFP4Weight
    from dspark_cli.runtime.model.heads.vanilla import VanillaHead

# A bias function writes position i's corrected logits: (e_i [B, r], i, row [B, Vd] fp32) -> None.
BiasFn = Callable[[torch.Tensor, int, torch.Tensor], None]


@dataclass(frozen=True)
class MarkovWeights:
    """The Markov head's tensors as the walk reads them."""

    w1: torch.Tensor  # [V, r], indexed by target id
    w2: torch.Tensor  # [Vd, r], rows by draft id (dequantized when the checkpoint head is NVFP4)
    w2_nvfp4: "NVFP4Weight | None"  # the checkpoint's NVFP4 W2 (packed rows for the gathers), or None
    scale: float  # logit_scale
    d2t: torch.Tensor | None  # [Vd] int64 offsets: target id = draft id + d2t[draft id]
    head: "VanillaHead | None" = None  # a gated / RNN head (its step makes u_i); None: vanilla, u_i = e_i

    @property
    def head_type(self) -> str:
        return "vanilla" if self.head is None else self.head.type_name

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
            head=draft.markov_head if draft.markov_head.uses_hidden else None,
        )


@dataclass
class MarkovResult:
    """A batch of walked blocks."""

    tokens: torch.Tensor  # [B, N] int64 target ids
    logits: torch.Tensor  # [B, N, Vd] fp32 corrected logits (-inf outside the candidates for topk/nvfp4/fused)
    embeds: torch.Tensor | None  # [B, N, r] e_i = W1[prev_i] (confidence-head input); None without a Markov head


@dataclass(frozen=True)
class Candidates:
    """The top-k of the base logits per position, fixed before the walk."""

    values: torch.Tensor  # [B, N, k] base logits, largest first
    ids: torch.Tensor  # [B, N, k] int64 draft ids


def draft_to_target(d2t: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocab ids [...] -> target-vocab ids [...] (d2t [Vd] stores offsets: target = id + d2t[id])."""
    return ids if d2t is None else ids + d2t[ids]


def select_candidates(base: torch.Tensor, k: int) -> Candidates:
    """[B, N, Vd] -> the top-k per position (k clamped to Vd), once per draft step."""
    values, ids = base.topk(min(k, base.shape[-1]), dim=-1)
    return Candidates(values, ids)


def markov_walk(
    strategy: str,
    weights: MarkovWeights | None,
    base_logits: torch.Tensor,
    first_prev: torch.Tensor,
    params: SamplingParams,
    noise: torch.Tensor | None = None,
    draft_topk: int | None = None,
    *,
    triton: bool | None = None,
    hidden: torch.Tensor | None = None,
) -> MarkovResult:
    """Walk B blocks. base_logits [B, N, Vd]; first_prev [B] int64 anchors (target ids); noise [B, N, Vd]
    standard Gumbel (needed unless greedy); hidden [B, N, H] the draft's final-norm hidden states (needed by
    gated and RNN heads).

    `strategy` is one of settings.STRATEGIES (settings.resolve_markov); draft_topk is the candidate count of the
    gathered strategies, clamped to Vd. triton: run the nvfp4 / fused Triton kernels (True) or their torch
    twins (False); None: the kernels where Triton can run on base_logits' device.
    """
    base = base_logits.float()  # [B, N, Vd]
    if not params.greedy and noise is None:
        raise ValueError("sampling (temperature > 0) needs Gumbel noise [B, N, Vd]")
    if weights is not None and weights.head is not None and hidden is None:
        raise ValueError(f"the {weights.head_type} Markov head needs the draft's hidden states [B, N, H]")
    if weights is None:
        picks = pick(base.flatten(0, 1), params, None if noise is None else noise.flatten(0, 1))  # [B*N] draft ids
        return MarkovResult(tokens=picks.view(base.shape[:2]), logits=base, embeds=None)
    if strategy == "dense":
        return walk(weights, dense_bias(weights, base), torch.empty_like(base), first_prev, params, noise, hidden)
    candidates = select_candidates(base, draft_topk)
    if strategy == "fused":
        if weights.head is not None:
            raise ValueError("the fused Markov walk runs vanilla heads only")
        return fused_walk(weights, base, candidates, first_prev, params, noise, triton=triton)
    bias = gathered_bias(weights, candidates, nvfp4=strategy == "nvfp4", triton=triton)
    return walk(weights, bias, torch.full_like(base, float("-inf")), first_prev, params, noise, hidden)


@torch.no_grad()  # a gated / RNN head's parameters require grad; the walk is inference only
def walk(
    weights: MarkovWeights,
    bias: BiasFn,
    logits: torch.Tensor,
    first_prev: torch.Tensor,
    params: SamplingParams,
    noise: torch.Tensor | None,
    hidden: torch.Tensor | None = None,
) -> MarkovResult:
    """The sequential walk. logits [B, N, Vd] fp32: the rows `bias` writes, filled beforehand wherever it
    does not (-inf outside the candidates); first_prev [B] target ids; noise [B, N, Vd] or None (greedy);
    hidden [B, N, H] for a gated / RNN head (weights.head), whose state starts fresh for these blocks."""
    batch, n_steps, _ = logits.shape
    tokens = torch.empty(batch, n_steps, dtype=torch.long, device=logits.device)
    embeds = torch.empty(batch, n_steps, weights.w1.shape[1], dtype=weights.w1.dtype, device=logits.device)
    head = weights.head
    state = None if head is None else head.initial_state(batch, logits)
    prev = first_prev  # [B]
    for i in range(n_steps):
        embeds[:, i] = weights.w1[prev]  # [B] -> [B, r]
        latent = embeds[:, i]
        if head is not None:
            latent, state = head.step(state, latent, hidden[:, i])  # u_i [B, r], next state
        bias(latent, i, logits[:, i])
        prev = draft_to_target(weights.d2t, pick(logits[:, i], params, None if noise is None else noise[:, i]))
        tokens[:, i] = prev
    return MarkovResult(tokens=tokens, logits=logits, embeds=embeds)


def pick(rows: torch.Tensor, params: SamplingParams, noise: torch.Tensor | None) -> torch.Tensor:
    """[B, Vd] fp32 logits -> [B] draft ids: argmax, or a Gumbel-max sample of target_probs(rows, params)."""
    if params.greedy:
        return rows.argmax(-1)
    return gumbel_argmax(processed_logits(rows, params), 1.0, noise)


def dense_bias(weights: MarkovWeights, base: torch.Tensor) -> BiasFn:
    """row = base_i + scale * W2 @ e_i over the whole draft vocabulary. base [B, N, Vd] fp32."""

    def write(embed: torch.Tensor, i: int, row: torch.Tensor) -> None:
        bias = F.linear(embed.to(weights.w2.dtype), weights.w2)  # [B, r] x [r, Vd] -> [B, Vd]
        torch.add(base[:, i], weights.scale * bias.float(), out=row)

    return write


def gathered_bias(weights: MarkovWeights, candidates: Candidates, *, nvfp4: bool, triton: bool | None = None) -> BiasFn:
    """row[candidate] = value + scale * <W2[candidate], e_i> for the k candidates of position i; the rest of
    the row is left as it is (-inf). nvfp4: read the NVFP4 W2 (the Triton kernel when `triton`, None: where
    Triton can run), else the dense W2."""
    from dspark_cli.kernels import triton_available
    from dspark_cli.kernels.markov import gathered_bias_reference, nvfp4_gathered_bias, nvfp4_gathered_bias_reference

    if nvfp4:
        w2 = weights.w2_nvfp4
        use_kernel = triton_available(candidates.values) if triton is None else triton
        add_bias = nvfp4_gathered_bias if use_kernel else nvfp4_gathered_bias_reference
    else:
        w2, add_bias = weights.w2, gathered_bias_reference

    def write(embed: torch.Tensor, i: int, row: torch.Tensor) -> None:
        add_bias(embed, w2, candidates.values[:, i], candidates.ids[:, i], row, weights.scale)  # k entries of [B, Vd]

    return write


def fused_walk(
    weights: MarkovWeights,
    base: torch.Tensor,
    candidates: Candidates,
    first_prev: torch.Tensor,
    params: SamplingParams,
    noise: torch.Tensor | None,
    *,
    triton: bool | None = None,
) -> MarkovResult:
    """The whole walk over the candidates in one call (kernels.markov: the Triton kernel when `triton`,
    None: where Triton can run; else its torch reference). base [B, N, Vd] shapes the fp32 logits [B, N, Vd],
    -inf outside the candidates."""
    from dspark_cli.kernels import markov as kernels

    if triton is None:
        run = kernels.markov_walk
    else:
        run = kernels.markov_walk_triton if triton else kernels.markov_walk_reference
    gumbel = None if params.greedy else noise.gather(-1, candidates.ids)  # [B, N, k]
    w2 = weights.w2_nvfp4 if weights.w2_nvfp4 is not None else weights.w2
    tokens, corrected = run(candidates.values, candidates.ids, first_prev, weights.w1, w2, weights.scale,
                            weights.d2t, gumbel, params.temperature)  # [B, N], [B, N, k]
    logits = torch.full_like(base, float("-inf"), dtype=torch.float32).scatter_(-1, candidates.ids, corrected)
    prev_ids = torch.cat([first_prev[:, None], tokens[:, :-1]], dim=1)  # [B, N] target ids before each position
    return MarkovResult(tokens=tokens, logits=logits, embeds=weights.w1[prev_ids])
