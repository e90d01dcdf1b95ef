"""The sequential Markov stage, measured method by method (`dspark bench markov`, docs/bench.md).

One draft step walks the N positions of a block for B requests (docs/format.md §3.1-3.2):

    e_i = W1[prev_i];  logits_i = base_i + alpha * W2 @ e_i;  d_i = pick(logits_i);  prev_i+1 = d_i + d2t[d_i]

Each method is a strategy of the runtime's walk (runtime.markov.markov_walk), timed exactly as `dspark generate`
runs it, batch-first, fed the same inputs:
  dense  per position: [B, r] x [r, Vd] + add + argmax / Gumbel-max over [B, Vd] fp32     (vLLM's default path)
  topk   per draft step: the top-k selection and a [B, N, Vd] fp32 buffer of -inf; per position: gather k W2 rows
         + bmm + scatter into the -inf row + argmax / Gumbel-max over it                 (`dspark_draft_topk`)
  nvfp4  as topk with the NVFP4 W2 (the `nvfp4_gathered_bias` kernel on CUDA, its torch twin elsewhere)
  fused  the top-k selection, then the whole walk in one kernel (`kernels.markov.markov_walk`)
The top-k selection that topk, nvfp4 and fused run first (once per draft step) is also timed alone
("select").

Inputs make the four agree: the base logits are -inf outside k candidates per position (the top-k of
random logits), so the dense path ranks the same tokens as the gathered ones. Before anything is
timed, every method's tokens are checked against the float32 reference walk; a token may differ from
the reference only where its score is within the rounding of the method's dtype of the best score
(bf16 weights round scores; see `check_tokens`).
"""

from __future__ import annotations

import functools
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.markov import (
    Candidates,
    MarkovWeights,
    draft_to_target,
    fused_walk,
    markov_walk,
    select_candidates,
)
from dspark_cli.runtime.sampling import SamplingParams, gumbel_noise
from dspark_cli.runtime.units import format_bytes

METHODS = ("dense", "topk", "nvfp4", "fused")
FORMATS = ("bf16", "nvfp4")
METHOD_TITLES = {
    "dense": "1 dense",
    "topk": "2 top-k bf16",
    "nvfp4": "3 top-k nvfp4",
    "fused": "4 fused walk",
    "select": "top-k select",
}
# Bandwidth of the device's memory in GB/s from its spec sheet, by device name (first match wins).
PEAK_GBPS = (
    (r"\bH200\b", 4800.0),
    (r"\bH100\b.*\bNVL\b", 3900.0),
    (r"\bH100\b.*\bPCIe\b", 2000.0),
    (r"\bH100\b", 3350.0),
    (r"\bB200\b", 8000.0),
    (r"\bA100\b.*\bPCIe\b.*80GB|\bA100\b.*80GB.*\bPCIe\b", 1935.0),
    (r"\bA100\b.*80GB", 2039.0),
    (r"\bA100\b", 1555.0),
    (r"\bL40S\b", 864.0),
    (r"\bL4\b", 300.0),
    (r"\bA10G\b", 600.0),
    (r"\bRTX 4090\b", 1008.0),
)
# Triton-interpreter work allowed per kernel check: programs x positions (~5-15 ms each on a CPU core).
INTERPRETER_BUDGET = 64
# Bytes per [B, N, Vd] logit entry a batch holds at once, rounded up: random logits, base row and Gumbel noise
# (fp32 or bf16 each), and per live walk (eager, and each method's CUDA graph) its fp32 copy of the base logits
# and its fp32 logit rows.
INPUT_BYTES_PER_LOGIT = 48
_FP32_ACCUMULATION = 2.0**-24  # relative rounding of one float32 addition
# A row whose (p90 - min) / min exceeds this is flagged "too noisy to compare": on a shared CPU, two rows doing
# the same work differ by up to this much from load alone.
SPREAD_LIMIT = 0.25


@dataclass(frozen=True)
class BenchConfig:
    block: int = 7
    batches: tuple[int, ...] = (1, 8)
    topks: tuple[int, ...] = (16, 64, 256)
    formats: tuple[str, ...] = FORMATS
    temperatures: tuple[float, ...] = (0.0, 1.0)
    device: str = "cpu"
    reps: int = 10
    warmup: int = 2
    peak_gbps: float | None = None  # None: from the device name, else a copy measured in the run
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16  # weights and logit rows (vLLM runs bf16; float32 for exact parity tests)

    def __post_init__(self) -> None:
        if self.device == "cuda" and not torch.cuda.is_available():
            raise DsparkError("the cuda device was requested but torch sees no CUDA device; use the cpu.")


@dataclass(frozen=True)
class Head:
    """One format's Markov head: `weights.w2` is dense ([Vd, r], the dequantized NVFP4 weight for nvfp4) and
    `weights.w2_nvfp4` is the packed NVFP4 W2 (nvfp4 format only)."""

    fmt: str
    weights: MarkovWeights
    note: str  # where the weights come from

    @property
    def vocab(self) -> int:
        return self.weights.w1.shape[0]

    @property
    def draft_vocab(self) -> int:
        return self.weights.w2.shape[0]

    @property
    def rank(self) -> int:
        return self.weights.w1.shape[1]


@dataclass
class WalkInputs:
    """One configuration's inputs, shared by every method."""

    base: torch.Tensor  # [B, N, Vd] base logits, -inf outside each position's k candidates
    values: torch.Tensor  # [B, N, k] the candidates' base logits (top-k of base, largest first)
    cand_ids: torch.Tensor  # [B, N, k] int64 their draft ids
    first_prev: torch.Tensor  # [B] int64 the anchors' target ids
    temperature: float
    noise: torch.Tensor | None  # [B, N, Vd] fp32 standard Gumbel noise (temperature > 0)
    gumbel: torch.Tensor | None  # [B, N, k] fp32 the same noise at the candidates

    @property
    def batch(self) -> int:
        return self.base.shape[0]

    @property
    def block(self) -> int:
        return self.base.shape[1]

    @property
    def topk(self) -> int:
        return self.values.shape[-1]

    def requests(self, count: int) -> "WalkInputs":
        """The first `count` requests, as contiguous copies (each request's walk is independent)."""

        def first(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:count].contiguous()

        return WalkInputs(first(self.base), first(self.values), first(self.cand_ids), first(self.first_prev),
                          self.temperature, first(self.noise), first(self.gumbel))


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


@dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    reps: int
    min_us: float

    @property
    def spread(self) -> float:
        """(p90 - min) / min: how far a typical slow repetition is from the fastest."""
        return (self.p90_us - self.min_us) / self.min_us if self.min_us > 0 else 0.0

    @property
    def too_noisy(self) -> bool:
        return self.spread > SPREAD_LIMIT

    def to_dict(self) -> dict:
        return {"median_us": self.median_us, "min_us": self.min_us, "p10_us": self.p10_us, "p90_us": self.p90_us,
                "spread": self.spread, "too_noisy": self.too_noisy, "reps": self.reps}


@dataclass
class Row:
    """One method (or the shared top-k selection) at one configuration."""

    fmt: str
    temperature: float
    batch: int
    topk: int | None  # None for dense, which does not depend on k (its check covers every k)
    method: str  # one of METHODS, or "select"
    mode: str  # "eager", "graph" (CUDA graph replay) or "interpreter" (Triton kernel checked on CPU, not timed)
    engine: str  # what ran: "torch", "torch twin", "Triton"
    block: int
    check: TokenCheck | None = None  # None for "select"
    requests_checked: int = 0
    timing: Timing | None = None
    weight_bytes: int | None = None
    lower_bound_us: float | None = None
    speedup_vs_dense: float | None = None
    speedup_vs_topk: float | None = None

    @property
    def title(self) -> str:
        return METHOD_TITLES[self.method]

    @property
    def us_per_position(self) -> float | None:
        return None if self.timing is None else self.timing.median_us / self.block

    @property
    def achieved_gbps(self) -> float | None:
        if self.timing is None or not self.weight_bytes:
            return None
        return self.weight_bytes / (self.timing.median_us * 1e3)

    def to_dict(self) -> dict:
        return {
            "format": self.fmt, "temperature": self.temperature, "batch": self.batch, "topk": self.topk,
            "method": self.method, "title": self.title, "mode": self.mode, "engine": self.engine,
            "tokens": None if self.check is None else self.check.to_dict(), "requests_checked": self.requests_checked,
            "timing": None if self.timing is None else self.timing.to_dict(),
            "us_per_step": None if self.timing is None else self.timing.median_us,
            "us_per_position": self.us_per_position, "weight_bytes": self.weight_bytes,
            "achieved_gbps": self.achieved_gbps, "lower_bound_us": self.lower_bound_us,
            "speedup_vs_dense": self.speedup_vs_dense, "speedup_vs_topk": self.speedup_vs_topk,
        }


@dataclass
class BenchReport:
    device: str  # "cuda" or "cpu"
    device_name: str
    peak_gbps: float
    peak_source: str
    launch_us: float  # one tiny kernel launch, measured in the run
    source: str  # "random weights" or the checkpoint
    vocab: int
    draft_vocab: int
    rank: int
    block: int
    alpha: float
    has_d2t: bool
    reps: int
    warmup: int
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every checked method emitted the reference tokens (up to rounding near-ties)."""
        return all(row.check is None or row.check.ok for row in self.rows)

    def to_dict(self) -> dict:
        return {
            "device": self.device, "device_name": self.device_name, "peak_gbps": self.peak_gbps,
            "peak_source": self.peak_source, "launch_us": self.launch_us, "source": self.source,
            "vocab": self.vocab, "draft_vocab": self.draft_vocab, "rank": self.rank, "block": self.block,
            "alpha": self.alpha, "d2t": self.has_d2t, "reps": self.reps, "warmup": self.warmup,
            "tokens_ok": self.ok, "notes": self.notes, "rows": [row.to_dict() for row in self.rows],
        }


# --- weights ------------------------------------------------------------------------------------------------


def random_heads(config: BenchConfig, vocab: int, draft_vocab: int, rank: int) -> dict[str, Head]:
    """Random Markov heads [V, r] / [Vd, r] for each format (NVFP4: W2 quantized with quantize_nvfp4).

    With draft_vocab < vocab, d2t maps the draft ids onto a random sorted subset of target ids.
    The bias alpha * <W2[d], W1[p]> has unit variance, comparable to the spread of the candidates' base logits.
    """
    _check_shapes(config, vocab, draft_vocab, rank)
    gen = torch.Generator(config.device).manual_seed(config.seed)
    device = config.device
    w1 = torch.randn(vocab, rank, generator=gen, device=device).to(config.dtype)  # [V, r]
    w2 = (torch.randn(draft_vocab, rank, generator=gen, device=device) / math.sqrt(rank)).to(config.dtype)  # [Vd, r]
    d2t = None
    if draft_vocab < vocab:
        target_ids = torch.randperm(vocab, generator=gen, device=device)[:draft_vocab].sort().values  # [Vd]
        d2t = target_ids - torch.arange(draft_vocab, device=device)
    weights = MarkovWeights(w1=w1, w2=w2, w2_nvfp4=None, scale=1.0, d2t=d2t)
    return {fmt: _head_in_format(fmt, weights, config.dtype, "random weights") for fmt in config.formats}


def checkpoint_heads(config: BenchConfig, source: str) -> dict[str, Head]:
    """The Markov head of a draft checkpoint (local folder or hub id), in each requested format.

    Only the Markov head is used: a target embedding / lm_head the draft shares is stood in by meta tensors.
    A bf16 head is quantized in memory for the nvfp4 format; an NVFP4 head gives its dequantized weights to bf16.
    """
    from dspark_cli.runtime.checkpoint import open_checkpoint
    from dspark_cli.runtime.config import DraftConfig
    from dspark_cli.runtime.draft import DSparkDraft
    from dspark_cli.runtime.paths import require_utf8_path

    require_utf8_path(source, "the draft")
    ckpt = open_checkpoint(source)
    draft_config = DraftConfig.from_dict(ckpt.config)
    if not draft_config.markov_rank:
        raise DsparkError(f"{ckpt.source} has no Markov head (markov_rank 0, a DFlash draft); there is no "
                          "sequential Markov stage to benchmark.")
    hidden, vocab, draft_vocab = draft_config.hidden_size, draft_config.vocab_size, draft_config.draft_vocab_size
    draft = DSparkDraft.from_checkpoint(
        ckpt,
        target_embed=torch.empty(vocab, hidden, device="meta"),
        target_lm_head=torch.empty(draft_vocab, hidden, device="meta"),
        dtype=config.dtype,
        device=config.device,
    )
    loaded = MarkovWeights.from_draft(draft)
    weights = MarkovWeights(
        w1=loaded.w1.detach(), w2=loaded.w2.detach(), w2_nvfp4=loaded.w2_nvfp4, scale=loaded.scale,
        d2t=None if loaded.d2t is None else loaded.d2t.detach(),
    )
    _check_shapes(config, weights.w1.shape[0], weights.w2.shape[0], weights.w1.shape[1], source=str(ckpt.source))
    corrupt = [name for name, tensor in (("markov_w1", weights.w1), ("markov_w2", weights.w2))
               if not torch.isfinite(tensor).all()]
    if corrupt:
        raise DsparkError(f"{ckpt.source}: {' and '.join(corrupt)} hold NaN or inf values, so every Markov score would "
                          "be NaN and no method's tokens could be checked; fix or re-export the draft.")
    stored = "NVFP4" if weights.w2_nvfp4 is not None else str(weights.w2.dtype).removeprefix("torch.")
    return {fmt: _head_in_format(fmt, weights, config.dtype, f"{ckpt.source} (markov_w2 stored as {stored})")
            for fmt in config.formats}


def _head_in_format(fmt: str, weights: MarkovWeights, dtype: torch.dtype, note: str) -> Head:
    from dspark_cli.kernels.nvfp4 import quantize_nvfp4

    if fmt == "bf16":
        w2 = weights.w2.to(dtype)
        if weights.w2_nvfp4 is not None:
            note += "; bf16 runs its dequantized weights"
        return Head(fmt, MarkovWeights(weights.w1, w2, None, weights.scale, weights.d2t), note)
    packed = weights.w2_nvfp4
    if packed is None:
        packed = quantize_nvfp4(weights.w2)
        note += "; quantized to NVFP4 in memory"
    dense = packed.dequantize(torch.float32).to(dtype)  # [Vd, r]: what the dense and top-k bf16 methods read
    return Head(fmt, MarkovWeights(weights.w1, dense, packed, weights.scale, weights.d2t), note)


def _check_shapes(config: BenchConfig, vocab: int, draft_vocab: int, rank: int, source: str = "--vocab/--rank") -> None:
    if min(vocab, draft_vocab, rank) < 1 or draft_vocab > vocab:
        raise DsparkError(f"{source}: need vocab >= draft vocab >= 1 and rank >= 1, got vocab {vocab}, "
                          f"draft vocab {draft_vocab}, rank {rank}.")
    if "nvfp4" in config.formats and rank % 16:
        raise DsparkError(f"{source}: NVFP4 needs the Markov rank to be a multiple of 16 (group size), got {rank}; "
                          "use the bf16 format.")
    too_large = [k for k in config.topks if k > draft_vocab]
    if too_large:
        raise DsparkError(f"top-k {too_large[0]} exceeds the draft vocabulary ({draft_vocab}); use smaller values.")
    _check_memory(config, vocab, draft_vocab, rank)


def memory_needed(config: BenchConfig, vocab: int, draft_vocab: int, rank: int) -> tuple[int, int]:
    """Rough peak bytes of a run: (weights, inputs of the largest batch). Weights: W1 and W2 drawn in fp32 and
    kept in bf16, plus a dequantized W2 per format; inputs: ~INPUT_BYTES_PER_LOGIT per [B, N, Vd] entry."""
    weights = (vocab + draft_vocab) * rank * 6 + len(config.formats) * draft_vocab * rank * 6
    inputs = max(config.batches) * config.block * draft_vocab * INPUT_BYTES_PER_LOGIT
    return weights, inputs


def available_memory(device: str) -> int | None:
    """Bytes free for new tensors: the CUDA device's free memory, else the host's MemAvailable (None: unknown)."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _check_memory(config: BenchConfig, vocab: int, draft_vocab: int, rank: int) -> None:
    """Refuse, before anything is allocated, shapes whose tensors cannot fit in the device's free memory."""
    weights, inputs = memory_needed(config, vocab, draft_vocab, rank)
    free = available_memory(config.device)
    if free is not None and weights + inputs > free:
        raise DsparkError(f"this benchmark needs about {format_bytes(weights + inputs)} of memory "
                          f"({format_bytes(weights)} of Markov weights for V={vocab}, Vd={draft_vocab}, r={rank}, "
                          f"and {format_bytes(inputs)} of logit rows for batch {max(config.batches)} x block "
                          f"{config.block}) but {config.device} has {format_bytes(free)} free; use a smaller "
                          "vocabulary, rank, batch or block.")


# --- inputs -------------------------------------------------------------------------------------------------


def make_inputs(head: Head, batch: int, block: int, topk: int, temperature: float, gen: torch.Generator) -> WalkInputs:
    """Random inputs for one configuration: the candidates are the top-k of N(0, 1) logits over the draft
    vocabulary; every other base logit is -inf. Gumbel noise when temperature > 0."""
    device, dtype = head.weights.w1.device, head.weights.w2.dtype
    logits = torch.randn(batch, block, head.draft_vocab, generator=gen, device=device)  # [B, N, Vd] fp32
    top_values, top_ids = logits.topk(topk, dim=-1)  # [B, N, k]
    del logits
    base = torch.full((batch, block, head.draft_vocab), float("-inf"), dtype=dtype, device=device)
    base.scatter_(-1, top_ids, top_values.to(dtype))
    candidates = select_candidates(base, topk)
    first_prev = torch.randint(0, head.vocab, (batch,), generator=gen, device=device)  # [B] target ids
    noise = gumbel = None
    if temperature > 0:
        noise = gumbel_noise((batch, block, head.draft_vocab), gen, device)  # [B, N, Vd]
        gumbel = noise.gather(-1, candidates.ids)  # [B, N, k]
    return WalkInputs(base, candidates.values, candidates.ids, first_prev, temperature, noise, gumbel)


# --- the methods --------------------------------------------------------------------------------------------


def method_walk(method: str, w: MarkovWeights, x: WalkInputs, triton: bool | None = None) -> torch.Tensor:
    """One method walks x exactly as `dspark generate` does (runtime.markov.markov_walk, strategy = method,
    candidate selection included). triton: force the Triton kernels (True) or their torch twins (False) of
    nvfp4 / fused; None: by device. -> [B, N] target ids."""
    params = SamplingParams(temperature=x.temperature)
    return markov_walk(method, w, x.base, x.first_prev, params, x.noise, x.topk, triton=triton).tokens


def reference_walk(w: MarkovWeights, x: WalkInputs) -> torch.Tensor:
    """The float32 reference (markov_walk_reference on x's candidates): NVFP4 rows dequantized in float32. -> [B, N]."""
    params = SamplingParams(temperature=x.temperature)
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
    cand_targets = draft_to_target(w.d2t, x.cand_ids)  # [B, N, k]
    is_chosen = cand_targets == tokens[..., None]  # [B, N, k]
    found = is_chosen.any(-1)  # [B, N]
    chosen = is_chosen.int().argmax(-1)  # [B, N] candidate index (0 when not found)
    near_ties = 0
    for i in range(x.block):
        score, tol = _position_scores(w, x, i, prev[:, i], eps)  # [B, k], [B]
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


def _position_scores(w: MarkovWeights, x: WalkInputs, i: int, prev: torch.Tensor, eps: float):
    """float32 scores of position i's candidates given prev [B] -> score [B, k], tolerance [B]."""
    from dspark_cli.kernels.nvfp4 import dequantize_rows_nvfp4

    ids = x.cand_ids[:, i]  # [B, k]
    if w.w2_nvfp4 is not None:
        rows = dequantize_rows_nvfp4(w.w2_nvfp4, ids.reshape(-1)).view(*ids.shape, -1)  # [B, k, r]
    else:
        rows = w.w2[ids].float()  # [B, k, r]
    embed = w.w1[prev].float()  # [B, r]
    dots = torch.bmm(rows, embed[..., None])[..., 0]  # [B, k]
    magnitude = abs(w.scale) * torch.bmm(rows.abs(), embed.abs()[..., None])[..., 0]  # [B, k] sum |alpha w2 e|
    corrected = x.values[:, i].float() + w.scale * dots
    error = eps * (corrected.abs() + 3 * magnitude) + embed.shape[-1] * _FP32_ACCUMULATION * magnitude  # [B, k]
    if x.gumbel is None:
        return corrected, 2 * error.amax(-1) + 1e-6
    score = corrected / x.temperature + x.gumbel[:, i]
    return score, 2 * error.amax(-1) / x.temperature + 1e-6 * (1 + score.abs().amax(-1))


# --- timing -------------------------------------------------------------------------------------------------


def time_call(fn: Callable[[], object], device: str, reps: int, warmup: int) -> Timing:
    """Min, median and p10/p90 of `reps` calls after `warmup`: CUDA events on CUDA, perf_counter on CPU."""
    return time_interleaved([fn], device, reps, warmup)[0]


def interleaved_order(count: int, reps: int) -> list[list[int]]:
    """The call order of `count` functions over `reps` rounds: every round calls each once, starting one further
    along each round (0 1 2, 1 2 0, 2 0 1, ...), so no function always runs first or right after the same one."""
    return [[(start + offset) % count for offset in range(count)] for start in range(reps)]


def time_interleaved(
    fns: list[Callable[[], object]], device: str, reps: int, warmup: int, clock: Callable[[], float] = time.perf_counter
) -> list[Timing]:
    """Time each of `fns` `reps` times in rotated rounds (`interleaved_order`), after `warmup` untimed rounds, so a
    load change on a shared machine hits all of them alike. CUDA events on CUDA, `clock` (seconds) elsewhere."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    if device == "cuda":
        recorded = []
        torch.cuda.synchronize()
        for order in interleaved_order(len(fns), reps):
            for index in order:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[index]()
                end.record()
                recorded.append((index, start, end))
        torch.cuda.synchronize()
        for index, start, end in recorded:
            samples[index].append(start.elapsed_time(end) * 1e3)
    else:
        for order in interleaved_order(len(fns), reps):
            for index in order:
                began = clock()
                fns[index]()
                samples[index].append((clock() - began) * 1e6)
    return [_timing(times) for times in samples]


def _timing(samples: list[float]) -> Timing:
    return Timing(statistics.median(samples), _quantile(samples, 0.1), _quantile(samples, 0.9), len(samples),
                  min(samples))


def _quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def capture_graph(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """Capture fn (warmed up on a side stream) in a CUDA graph; returns a replay that yields its static output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay


def measure_launch_us(device: str) -> float:
    """Median time of one tiny kernel (an add on one element): the fixed cost of one launch."""
    x = torch.zeros(1, device=device)
    return time_call(lambda: x.add_(1), device, reps=200, warmup=20).median_us


def measure_copy_gbps(device: str) -> float:
    """Memory bandwidth of a large copy in GB/s, counting bytes read + bytes written (STREAM's convention)."""
    n_bytes = (256 if device == "cuda" else 64) * 2**20
    src = torch.ones(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timing = time_call(lambda: dst.copy_(src), device, reps=10, warmup=2)
    return 2 * n_bytes / (timing.median_us * 1e3)


def resolve_peak(device: str, requested: float | None) -> tuple[float, str, str]:
    """-> (peak GB/s, where it comes from, device name)."""
    name = torch.cuda.get_device_name() if device == "cuda" else _cpu_name()
    if requested is not None:
        return requested, "--peak-gbps", name
    if device == "cuda":
        for pattern, gbps in PEAK_GBPS:
            if re.search(pattern, name, flags=re.IGNORECASE):
                return gbps, f"spec sheet of {name}", name
    return measure_copy_gbps(device), "copy bandwidth measured in this run", name


def _cpu_name() -> str:
    import platform

    threads = torch.get_num_threads()
    return f"CPU {platform.processor() or platform.machine()}, {threads} thread{'s' if threads != 1 else ''}"


# --- bytes --------------------------------------------------------------------------------------------------


def weight_bytes(method: str, head: Head, batch: int, block: int, topk: int) -> int:
    """Bytes one draft step reads from the Markov weights: W1 rows of the previous tokens, and all of W2
    (dense, bf16) or the k gathered W2 rows per request and position (bf16, or NVFP4 nibbles + e4m3 scales)."""
    r = head.rank
    w1 = block * batch * r * head.weights.w1.element_size()
    if method == "dense":
        return w1 + block * head.draft_vocab * r * head.weights.w2.element_size()
    if method == "nvfp4" or (method == "fused" and head.fmt == "nvfp4"):
        return w1 + block * batch * topk * (r // 2 + r // 16)
    return w1 + block * batch * topk * r * head.weights.w2.element_size()


# --- the benchmark ------------------------------------------------------------------------------------------


@dataclass
class _Variant:
    method: str
    mode: str
    engine: str
    run: Callable[[], torch.Tensor]
    inputs: WalkInputs  # what it was fed (a subset of the requests for interpreter checks)
    timed: bool = True


def run_bench(
    config: BenchConfig, heads: dict[str, Head], progress: Callable[[str], None] | None = None
) -> BenchReport:
    """Check, then time, every method for every (format, temperature, batch, top-k)."""
    first = heads[config.formats[0]]
    with torch.inference_mode():
        peak, peak_source, device_name = resolve_peak(config.device, config.peak_gbps)
        report = BenchReport(
            device=config.device, device_name=device_name, peak_gbps=peak, peak_source=peak_source,
            launch_us=measure_launch_us(config.device), source=first.note, vocab=first.vocab,
            draft_vocab=first.draft_vocab, rank=first.rank, block=config.block, alpha=first.weights.scale,
            has_d2t=first.weights.d2t is not None, reps=config.reps, warmup=config.warmup,
        )
        report.notes += _notes(config, heads)
        for temperature in config.temperatures:
            for batch in config.batches:
                pending: list[tuple[Row, Callable[[], torch.Tensor]]] = []  # every format's rows of this (T, B)
                for fmt in config.formats:
                    if progress:
                        progress(f"{fmt}, T={temperature:g}, B={batch}")
                    rows, timed = _bench_batch(config, heads[fmt], temperature, batch, report)
                    report.rows += rows
                    pending += timed
                if progress:
                    progress(f"timing T={temperature:g}, B={batch}: {len(pending)} rows interleaved")
                timings = time_interleaved([run for _, run in pending], config.device, config.reps, config.warmup)
                for (row, _), timing in zip(pending, timings):
                    row.timing = timing
    report.rows.sort(key=lambda row: config.formats.index(row.fmt))  # stable: the order within a format is kept
    _add_speedups(report.rows)
    return report


def _notes(config: BenchConfig, heads: dict[str, Head]) -> list[str]:
    notes = [f"{head.fmt}: {head.note}" for head in heads.values()]
    if config.device == "cpu":
        if _interpreter_active():
            notes.append("CPU: the Triton kernels (nvfp4_gathered_bias, markov_walk_triton) run only under the "
                         "Triton interpreter: their tokens are checked (rows 'kernel*'), never timed; the timed "
                         "nvfp4 and fused rows are their torch twins ('twin').")
        else:
            notes.append("CPU: the Triton kernels are not checked here (no interpreter in this process); "
                         "the NVFP4 and fused rows are their torch twins.")
    else:
        notes.append("CUDA: speedups compare like with like (graph rows with graph rows, eager with eager).")
    notes.append(f"Every row of one (T, B) is timed interleaved with the others, both formats included (one call "
                 f"each per round, the order rotated every round); rows whose (p90 - min) / min exceeds "
                 f"{SPREAD_LIMIT:.0%} are marked '!': load made them too noisy to compare.")
    notes.append("Every row runs the code `dspark generate` runs; rows 2-4 include the top-k selection they share "
                 "(once per draft step), also timed alone as its own row. Bytes count reads of Markov weights only "
                 "(not logit rows or noise).")
    return notes


def _interpreter_active() -> bool:
    """True when the Triton kernels run under the interpreter in this process (dspark_cli.kernels decides)."""
    import importlib.util

    import dspark_cli.kernels  # noqa: F401  (chooses the interpreter when there is no CUDA)

    return os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def _bench_batch(
    config: BenchConfig, head: Head, temperature: float, batch: int, report: BenchReport
) -> tuple[list[Row], list[tuple[Row, Callable[[], torch.Tensor]]]]:
    """Rows of one (format, temperature, batch): dense once (checked on every k's inputs, timed on the first),
    then per k the shared selection and methods 2-4; and the (row, call) pairs to time, the checked ones only."""
    seed = (config.seed * 1_000_003 + batch * 1009 + round(temperature * 97)) % 2**64  # manual_seed takes 64 bits
    gen = torch.Generator(config.device).manual_seed(seed)
    dense_rows: dict[str, Row] = {}  # by mode
    dense_runs: list[_Variant] = []  # dense on the first k's inputs, timed once every k is checked
    rows: list[Row] = []
    timed: list[tuple[Row, Callable[[], torch.Tensor]]] = []
    for index, k in enumerate(config.topks):
        x = make_inputs(head, batch, config.block, k, temperature, gen)
        reference = reference_walk(head.weights, x)  # [B, N]
        variants = _variants(config, head, x, dense_graph=index == 0)
        checks = [check_tokens(head.weights, v.inputs, v.run(), reference[: v.inputs.batch]) for v in variants]
        selection = _selection_rows(config, head.fmt, x, temperature, batch)
        rows += [row for row, _ in selection]
        timed += selection
        for variant, check in zip(variants, checks):
            if variant.method == "dense":
                row = dense_rows.setdefault(variant.mode, Row(head.fmt, temperature, batch, None, "dense", variant.mode,
                                                              variant.engine, config.block, requests_checked=batch))
                row.check = check if row.check is None else _merge_checks(row.check, check)
                if index == 0:
                    dense_runs.append(variant)
                continue
            row = Row(head.fmt, temperature, batch, k, variant.method, variant.mode, variant.engine, config.block,
                      check=check, requests_checked=variant.inputs.batch)
            if variant.timed and check.ok:
                timed.append((row, variant.run))
                _cost_row(row, head, report)
            rows.append(row)
    for variant in dense_runs:
        row = dense_rows[variant.mode]
        if row.check.ok:
            timed.append((row, variant.run))
            _cost_row(row, head, report)
    return list(dense_rows.values()) + rows, timed


def _merge_checks(first: TokenCheck, second: TokenCheck) -> TokenCheck:
    """One check over two input sets; the first mismatch wins."""
    if not first.ok:
        return first
    return TokenCheck(first.exact and second.exact, first.near_ties + second.near_ties, second.mismatch)


def _variants(config: BenchConfig, head: Head, x: WalkInputs, dense_graph: bool) -> list[_Variant]:
    """Every way of walking x: eager (and CUDA-graph replays on CUDA), plus on CPU the Triton kernels under the
    interpreter on the first few requests (checked, not timed)."""
    w = head.weights
    cuda = config.device == "cuda"
    kernel = "Triton" if cuda else "torch twin"
    methods = [("dense", "torch"), ("topk", "torch")] + ([("nvfp4", kernel)] if head.fmt == "nvfp4" else [])
    variants = []
    for method, engine in methods + [("fused", kernel)]:
        run = functools.partial(method_walk, method, w, x)
        variants.append(_Variant(method, "eager", engine, run, x))
        if cuda and (method != "dense" or dense_graph):
            variants.append(_Variant(method, "graph", engine, capture_graph(run), x))
    if not cuda and _interpreter_active():
        sub = x.requests(_interpreter_requests(x))
        for method in ("nvfp4", "fused") if head.fmt == "nvfp4" else ("fused",):
            run = functools.partial(method_walk, method, w, sub, triton=True)
            variants.append(_Variant(method, "interpreter", "Triton", run, sub, timed=False))
    return variants


def _interpreter_requests(x: WalkInputs) -> int:
    """How many requests the interpreter checks: about INTERPRETER_BUDGET program-positions."""
    per_request = x.block * math.ceil(x.topk / 32)
    return max(1, min(x.batch, INTERPRETER_BUDGET // per_request))


def _selection_rows(
    config: BenchConfig, fmt: str, x: WalkInputs, temperature: float, batch: int
) -> list[tuple[Row, Callable[[], torch.Tensor]]]:
    """The shared top-k selection rows (eager, and graph on CUDA), with the calls that time them."""

    def select() -> torch.Tensor:
        return select_candidates(x.base, x.topk).ids

    runs = [("eager", select)] + ([("graph", capture_graph(select))] if config.device == "cuda" else [])
    return [(Row(fmt, temperature, batch, x.topk, "select", mode, "torch", x.block), run) for mode, run in runs]


def _cost_row(row: Row, head: Head, report: BenchReport) -> None:
    """The weight bytes a row reads and the bandwidth lower bound of its time."""
    row.weight_bytes = weight_bytes(row.method, head, row.batch, row.block, row.topk or 0)
    row.lower_bound_us = row.weight_bytes / (report.peak_gbps * 1e3) + report.launch_us


def _add_speedups(rows: list[Row]) -> None:
    """Speedup of each timed method over dense and over top-k bf16 at the same configuration and mode: the ratio of
    the min times, which interleaving keeps comparable (medians of rows doing the same work still differed up to
    2.7x under load on a shared CPU, their mins within 3 %)."""
    timed = {(r.fmt, r.temperature, r.batch, r.topk, r.method, r.mode): r for r in rows if r.timing is not None}
    for row in timed.values():
        if row.method not in METHODS:  # the shared selection
            continue
        dense = timed.get((row.fmt, row.temperature, row.batch, None, "dense", row.mode))
        topk = timed.get((row.fmt, row.temperature, row.batch, row.topk, "topk", row.mode))
        if dense is not None:
            row.speedup_vs_dense = dense.timing.min_us / row.timing.min_us
        if topk is not None:
            row.speedup_vs_topk = topk.timing.min_us / row.timing.min_us


# --- the chart ----------------------------------------------------------------------------------------------


def write_latency_chart(report: BenchReport, path) -> None:
    """PNG of µs per draft step against batch size: one panel per (format, temperature), one line per method
    and k (CUDA-graph replays on CUDA, eager calls on CPU; the shared top-k selection is left out)."""
    from dspark_cli.runtime.lineplot import Panel, Series, write_line_chart

    mode = "graph" if report.device == "cuda" else "eager"
    panels: dict[tuple[str, float], dict[str, list[tuple[float, float]]]] = {}
    for row in report.rows:
        if row.timing is None or row.mode != mode or row.method == "select":
            continue
        label = row.title + (" twin" if row.engine == "torch twin" else "")
        label += ("" if row.topk is None else f" k={row.topk}") + (" graph" if mode == "graph" else "")
        series = panels.setdefault((row.fmt, row.temperature), {})
        series.setdefault(label, []).append((row.batch, row.timing.median_us))
    chart = [
        Panel(f"{fmt} Markov head  T={temperature:g}  V={report.vocab} r={report.rank} N={report.block}  "
              f"{report.device}",
              [Series(label, points) for label, points in series.items()])
        for (fmt, temperature), series in panels.items()
    ]
    write_line_chart(path, chart, x_label="batch size", y_label="us per draft step (median)")
