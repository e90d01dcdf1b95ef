"""The Markov methods `dspark bench markov` times (runtime/bench/run.py), the float32 reference walk, and the check of
a method's tokens against the reference: equal, or different only where scores tie within the dtype's rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_cli.runtime.bench.inputs import WalkInputs
from dspark_cli.runtime.decode.markov import Candidates, MarkovWeights, draft_to_target, fused_walk, markov_walk
from dspark_cli.runtime.settings import SamplingParams

_FP32_ACCUMULATION = 2.0**-24  # relative rounding of one float32 addition


@dataclass(frozen=True)
class TokenCheck:
    """A method's tokens against the float32 reference walk."""

    exact: bool  # identical tokens
    near_ties: int  # positions that picked another candidate scoring within rounding of the best
    mismatch: str | None  # the first position whose token is not a best candidate, else None

    @property
    def ok(self) -> bool:
        return self.mismatch is None

    def label(self) -> str:
        if self.mismatch is not None:
            return "MISMATCH"
        return "exact" if self.exact else f"{self.near_ties} near-tie{'s' if self.near_ties != 1 else ''}"

    def to_dict(self) -> dict:
        return {"ok": self.ok, "exact": self.exact, "near_ties": self.near_ties, "mismatch": self.mismatch}


# --- the methods --------------------------------------------------------------------------------------------


def method_walk(method: str, w: MarkovWeights, x: WalkInputs, triton: bool | None = None) -> torch.Tensor:
    """One method walks x exactly as `dspark generate` does (runtime.markov.markov_walk, strategy = method,
    candidate selection included). triton: force the Triton kernels (True) or their torch twins (False) of
    nvfp4 / fused; None: by device. -> [B, N] target ids."""
    params = SamplingParams(temperature=x.temperature)
    return markov_walk(method, w, x.base, x.first_prev, params, x.noise, x.topk, triton=triton,
                       hidden=x.hidden).tokens


def reference_walk(w: MarkovWeights, x: WalkInputs) -> torch.Tensor:
    """The float32 reference on x's candidates, NVFP4 rows dequantized in float32 -> [B, N]: the fused walk's
    torch twin (markov_walk_reference) for a vanilla head; for a gated / RNN head, which the fused walk does not
    run, the gathered walk with the float32 torch bias (the latents u_k in the head's own dtype)."""
    params = SamplingParams(temperature=x.temperature)
    if w.head is not None:
        strategy = "nvfp4" if w.w2_nvfp4 is not None else "topk"
        return markov_walk(strategy, w, x.base, x.first_prev, params, x.noise, x.topk, triton=False,
                           hidden=x.hidden).tokens
    candidates = Candidates(x.values, x.cand_ids)
    return fused_walk(w, x.base, candidates, x.first_prev, params, x.noise, triton=False).tokens


# --- the token check ----------------------------------------------------------------------------------------


def check_tokens(w: MarkovWeights, x: WalkInputs, tokens: torch.Tensor, reference: torch.Tensor) -> TokenCheck:
    """Compare a method's tokens [B, N] with the reference walk's.

    Identical tokens are exact. Otherwise every position is re-scored in float32 along the method's own
    path (prev = its previous token), and its token must be a candidate whose score is within rounding of
    the best: each score carries up to about eps * (|corrected| + 3 |alpha| sum_r |w2 e|) of error (eps of
    the logit rows' dtype: a bf16 store, the bias, its scale and a bf16 copy of W2 each round once), and two
    scores are compared. Beyond that the method picked a wrong token: a mismatch.
    """
    if torch.equal(tokens, reference):
        return TokenCheck(exact=True, near_ties=0, mismatch=None)
    eps = torch.finfo(x.base.dtype).eps
    prev = torch.cat([x.first_prev[:, None], tokens[:, :-1]], dim=1)  # [B, N] target ids before each position
    latents = _path_latents(w, x, prev)  # [B, N, r]
    cand_targets = draft_to_target(w.d2t, x.cand_ids)  # [B, N, k]
    is_chosen = cand_targets == tokens[..., None]  # [B, N, k]
    found = is_chosen.any(-1)  # [B, N]
    chosen = is_chosen.int().argmax(-1)  # [B, N] candidate index (0 when not found)
    near_ties = 0
    for i in range(x.block):
        score, tol = _position_scores(w, x, i, latents[:, i], eps)  # [B, k], [B]
        best, best_j = score.max(-1)  # [B]
        chosen_score = score.gather(-1, chosen[:, i, None])[:, 0]
        ok = found[:, i] & (chosen_score >= best - tol)
        if not ok.all():
            b = int((~ok).nonzero()[0, 0])
            detail = (f"request {b}, position {i}: token {int(tokens[b, i])} "
                      + (f"scores {float(chosen_score[b]):.6g}" if found[b, i] else "is not a candidate")
                      + f", the best candidate {int(cand_targets[b, i, best_j[b]])} scores {float(best[b]):.6g}"
                      f" (tolerance {float(tol[b]):.2g})")
            return TokenCheck(exact=False, near_ties=near_ties, mismatch=detail)
        near_ties += int((chosen[:, i] != best_j).sum())
    return TokenCheck(exact=False, near_ties=near_ties, mismatch=None)


def _path_latents(w: MarkovWeights, x: WalkInputs, prev: torch.Tensor) -> torch.Tensor:
    """The latents u_k along a path of previous tokens prev [B, N] -> [B, N, r]: W1[prev_k] for a vanilla head; a
    gated / RNN head's step over them and x.hidden, in the head's dtype, as the walk computes them."""
    embeds = w.w1[prev]  # [B, N, r]
    if w.head is None:
        return embeds
    latents = torch.empty_like(embeds)
    state = w.head.initial_state(prev.shape[0], x.base)
    for k in range(prev.shape[1]):
        latents[:, k], state = w.head.step(state, embeds[:, k], x.hidden[:, k])
    return latents


def _position_scores(w: MarkovWeights, x: WalkInputs, i: int, latent: torch.Tensor, eps: float):
    """float32 scores of position i's candidates given its latent [B, r] -> score [B, k], tolerance [B]."""
    from dspark_cli.kernels.nvfp4 import dequantize_rows_nvfp4

    ids = x.cand_ids[:, i]  # [B, k]
    if w.w2_nvfp4 is not None:
        rows = dequantize_rows_nvfp4(w.w2_nvfp4, ids.reshape(-1)).view(*ids.shape, -1)  # [B, k, r]
    else:
        rows = w.w2[ids].float()  # [B, k, r]
    embed = latent.float()  # [B, r]
    dots = torch.bmm(rows, embed[..., None])[..., 0]  # [B, k]
    magnitude = abs(w.scale) * torch.bmm(rows.abs(), embed.abs()[..., None])[..., 0]  # [B, k] sum |alpha w2 e|
    corrected = x.values[:, i].float() + w.scale * dots
    error = eps * (corrected.abs() + 3 * magnitude) + embed.shape[-1] * _FP32_ACCUMULATION * magnitude  # [B, k]
    if x.gumbel is None:
        return corrected, 2 * error.amax(-1) + 1e-6
    score = corrected / x.temperature + x.gumbel[:, i]
    return score, 2 * error.amax(-1) / x.temperature + 1e-6 * (1 + score.abs().amax(-1))


def merge_checks(first: TokenCheck, second: TokenCheck) -> TokenCheck:
    """One check over two input sets; the first mismatch wins."""
    if not first.ok:
        return first
    return TokenCheck(first.exact and second.exact, first.near_ties + second.near_ties, second.mismatch)
