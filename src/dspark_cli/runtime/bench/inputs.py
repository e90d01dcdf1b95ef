"""The inputs of `dspark bench markov` (runtime/bench/run.py): its configuration, the Markov heads it times (random, or a
draft checkpoint's, in each format), the random walk inputs of one configuration, and the check that a run's
tensors fit in the device's free memory before anything is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.devices import available_memory, check_fits
from dspark_cli.runtime.decode.markov import MarkovWeights, select_candidates
from dspark_cli.runtime.decode.sampling import gumbel_noise

FORMATS = ("bf16", "nvfp4")
# Bytes per [B, N, Vd] logit entry a batch holds at once, rounded up: random logits, base row and Gumbel noise
# (fp32 or bf16 each), and per live walk (eager, and each method's CUDA graph) its fp32 copy of the base logits
# and its fp32 logit rows.
INPUT_BYTES_PER_LOGIT = 48


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
    def head_type(self) -> str:
        return self.weights.head_type

    @property
    def hidden_size(self) -> int | None:
        """The hidden-state width a gated / RNN head reads; None for a vanilla head."""
        return None if self.weights.head is None else self.weights.head.hidden_size

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
    hidden: torch.Tensor | None = None  # [B, N, H] the backbone's hidden states a gated / RNN head reads

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
                          self.temperature, first(self.noise), first(self.gumbel), first(self.hidden))


# --- weights ------------------------------------------------------------------------------------------------


def random_heads(config: BenchConfig, vocab: int, draft_vocab: int, rank: int, head_type: str = "vanilla",
                 hidden: int | None = None) -> dict[str, Head]:
    """Random Markov heads [V, r] / [Vd, r] for each format (NVFP4: W2 quantized with quantize_nvfp4).

    With draft_vocab < vocab, d2t maps the draft ids onto a random sorted subset of target ids.
    The bias alpha * <W2[d], W1[p]> has unit variance, comparable to the spread of the candidates' base logits.
    A gated or RNN head_type adds its projections over `hidden`-wide hidden states (required then), drawn with
    1/sqrt(fan-in) weights so that their pre-activations are of order one.
    """
    from dspark_cli.runtime.checkpoint.heads import HEAD_TYPES

    if head_type not in HEAD_TYPES:
        raise DsparkError(f"the head-type option must be one of {', '.join(HEAD_TYPES)}, got {head_type!r}.")
    if head_type != "vanilla" and (hidden is None or hidden < 1):
        raise DsparkError(f"a {head_type} head needs the hidden option, the hidden size it reads, of at least 1; got {hidden}.")
    _check_shapes(config, vocab, draft_vocab, rank)
    gen = torch.Generator(config.device).manual_seed(config.seed)
    device = config.device
    w1 = torch.randn(vocab, rank, generator=gen, device=device).to(config.dtype)  # [V, r]
    w2 = (torch.randn(draft_vocab, rank, generator=gen, device=device) / math.sqrt(rank)).to(config.dtype)  # [Vd, r]
    d2t = None
    if draft_vocab < vocab:
        target_ids = torch.randperm(vocab, generator=gen, device=device)[:draft_vocab].sort().values  # [Vd]
        d2t = target_ids - torch.arange(draft_vocab, device=device)
    head = None if head_type == "vanilla" else _random_head(head_type, rank, hidden, config, gen)
    weights = MarkovWeights(w1=w1, w2=w2, w2_nvfp4=None, scale=1.0, d2t=d2t, head=head)
    note = "random weights" + ("" if head is None else f", {head_type} head over hidden size {hidden}")
    return {fmt: _head_in_format(fmt, weights, config.dtype, note) for fmt in config.formats}


def _random_head(head_type: str, rank: int, hidden: int, config: BenchConfig, gen: torch.Generator):
    """A gated / RNN head module with random projections (its own markov_w1 / markov_w2 are 1-row stand-ins: the
    walk reads the bench's W1 and W2)."""
    from dspark_cli.runtime.model.heads import HEADS

    head = HEADS[head_type](1, 1, rank, hidden)
    with torch.no_grad():
        for parameter in head.parameters():
            scale = 1 / math.sqrt(parameter.shape[-1]) if parameter.dim() > 1 else 0.1  # weights by fan-in; biases
            parameter.copy_(torch.randn(parameter.shape, generator=gen, device=config.device).cpu() * scale)
    return head.to(config.device, config.dtype).requires_grad_(False)


def checkpoint_heads(config: BenchConfig, source: str) -> dict[str, Head]:
    """The Markov head of a draft checkpoint (local folder or hub id), in each requested format.

    Only the Markov head is used: a target embedding / lm_head the draft shares is stood in by meta tensors.
    A bf16 head is quantized in memory for the nvfp4 format; an NVFP4 head gives its dequantized weights to bf16.
    """
    from dspark_cli.runtime.checkpoint.read import open_checkpoint
    from dspark_cli.runtime.checkpoint.config import DraftConfig
    from dspark_cli.runtime.model.draft_io import load_draft
    from dspark_cli.runtime.io.paths import require_utf8_path

    require_utf8_path(source, "the draft")
    ckpt = open_checkpoint(source)
    draft_config = DraftConfig.from_dict(ckpt.config)
    if draft_config.has_selector:
        raise DsparkError(f"{ckpt.source} is a DFlash2 draft: its path selector, not a Markov head, picks the block's "
                          "tokens, and bench markov times Markov heads only (`dspark generate` reports the selector "
                          "stage's time per round).")
    if not draft_config.markov_rank:
        raise DsparkError(f"{ckpt.source} has no Markov head (markov_rank 0, a DFlash draft); there is no "
                          "sequential Markov stage to benchmark.")
    hidden, vocab, draft_vocab = draft_config.hidden_size, draft_config.vocab_size, draft_config.draft_vocab_size
    draft = load_draft(
        ckpt,
        target_embed=torch.empty(vocab, hidden, device="meta"),
        target_lm_head=torch.empty(draft_vocab, hidden, device="meta"),
        dtype=config.dtype,
        device=config.device,
    )
    loaded = MarkovWeights.from_draft(draft)
    head = None if loaded.head is None else loaded.head.requires_grad_(False)  # gated / RNN: with its projections
    weights = MarkovWeights(
        w1=loaded.w1.detach(), w2=loaded.w2.detach(), w2_nvfp4=loaded.w2_nvfp4, scale=loaded.scale,
        d2t=None if loaded.d2t is None else loaded.d2t.detach(), head=head,
    )
    _check_shapes(config, weights.w1.shape[0], weights.w2.shape[0], weights.w1.shape[1], source=str(ckpt.source))
    corrupt = [name for name, tensor in (("markov_w1", weights.w1), ("markov_w2", weights.w2))
               if not torch.isfinite(tensor).all()]
    if corrupt:
        raise DsparkError(f"{ckpt.source}: {' and '.join(corrupt)} hold NaN or inf values, so every Markov score would "
                          "be NaN and no method's tokens could be checked; fix or re-export the draft.")
    stored = "NVFP4" if weights.w2_nvfp4 is not None else str(weights.w2.dtype).removeprefix("torch.")
    kind = "" if head is None else f", {head.type_name} head over hidden size {hidden}"
    return {fmt: _head_in_format(fmt, weights, config.dtype, f"{ckpt.source} (markov_w2 stored as {stored}{kind})")
            for fmt in config.formats}


def _head_in_format(fmt: str, weights: MarkovWeights, dtype: torch.dtype, note: str) -> Head:
    from dspark_cli.kernels.nvfp4 import quantize_nvfp4

    if fmt == "bf16":
        w2 = weights.w2.to(dtype)
        if weights.w2_nvfp4 is not None:
            note += "; bf16 runs its dequantized weights"
        return Head(fmt, MarkovWeights(weights.w1, w2, None, weights.scale, weights.d2t, weights.head), note)
    packed = weights.w2_nvfp4
    if packed is None:
        packed = quantize_nvfp4(weights.w2)
        note += "; quantized to NVFP4 in memory"
    dense = packed.dequantize(torch.float32).to(dtype)  # [Vd, r]: what the dense and top-k bf16 methods read
    return Head(fmt, MarkovWeights(weights.w1, dense, packed, weights.scale, weights.d2t, weights.head), note)


def _check_shapes(config: BenchConfig, vocab: int, draft_vocab: int, rank: int, source: str = "the vocab option / the rank option") -> None:
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


def _check_memory(config: BenchConfig, vocab: int, draft_vocab: int, rank: int) -> None:
    """Refuse, before anything is allocated, shapes whose tensors cannot fit in the device's free memory."""
    weights, inputs = memory_needed(config, vocab, draft_vocab, rank)
    parts = {f"Markov weights for V={vocab}, Vd={draft_vocab}, r={rank}": weights,
             f"logit rows for batch {max(config.batches)} x block {config.block}": inputs}
    check_fits(parts, available_memory(config.device), config.device, "this benchmark",
               "use a smaller vocabulary, rank, batch or block")


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
    noise = gumbel = hidden = None
    if temperature > 0:
        noise = gumbel_noise((batch, block, head.draft_vocab), gen, device)  # [B, N, Vd]
        gumbel = noise.gather(-1, candidates.ids)  # [B, N, k]
    if head.weights.head is not None:  # a gated / RNN head reads the backbone's (final-norm, so unit-scale) states
        width = head.hidden_size
        hidden = torch.randn(batch, block, width, generator=gen, device=device).to(dtype)  # [B, N, H]
    return WalkInputs(base, candidates.values, candidates.ids, first_prev, temperature, noise, gumbel, hidden)
