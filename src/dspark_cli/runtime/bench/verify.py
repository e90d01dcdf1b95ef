"""`dspark bench verify`: the cost of the target's score pass over t tokens, t = 1..T, on this device; with several
batch sizes, of B requests scoring t tokens each in one pass.

    costs = time_verify(target, context=512, max_tokens=8, reps=20, warmup=3)
    costs.to_dict()     # {"format": "dspark-verify-costs/1", "tokens": [1..8], "ms": [...], ...}: `dspark plan --costs`
    grid = time_verify_batches(target, context=512, max_tokens=8, batches=(1, 4, 16), reps=20, warmup=3)
    grid.to_dict()      # {"format": "dspark-verify-costs/2", "batches": [1, 4, 16], "tokens": [1..8],
                        #  "ms": [[...] per batch], "measured_by": ...}: `dspark plan --concurrency --costs`

A speculative round scores [anchor, d_1..d_n] after the committed context: one target forward over n + 1 tokens with
the cache holding `context` positions (TargetModel.score, hidden states captured as for a draft), then the cache is
cropped back. Each length is timed in rotated, interleaved rounds (bench/timer.py), so load on a shared machine hits
every length alike; the median is the cost. Batch 1, as `dspark eval` runs.

The batch sweep runs the same forward on B sequences at once (transformers' batched cache, B random contexts of
`context` tokens, the draft's hidden states captured and concatenated as a round does), every (B, t) timed in the
same interleaved rounds. It is dspark's PyTorch forward on this device: a first estimate of an engine's step cost,
not the engine's own (its kernels, CUDA graphs and scheduler differ); the table says so (`measured_by`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_cli.runtime.bench.timer import Timing, time_interleaved
from dspark_cli.runtime.devices import available_memory, check_fits

COSTS_FORMAT = "dspark-verify-costs/1"
GRID_FORMAT = "dspark-verify-costs/2"
MEASURED_BY = ("dspark bench verify: the target's PyTorch (transformers) forward on this device, B sequences of t "
               "tokens after a cached context; not an engine's own step-cost table")


@dataclass
class VerifyCosts:
    target: str
    device: str
    dtype: str
    context: int
    timings: dict[int, Timing]  # tokens scored -> timing

    def to_dict(self) -> dict:
        tokens = sorted(self.timings)
        return {"format": COSTS_FORMAT, "target": self.target, "device": self.device, "dtype": self.dtype,
                "context": self.context, "tokens": tokens, "ms": [self.timings[t].median_us / 1000 for t in tokens],
                "timings": {str(t): self.timings[t].to_dict() for t in tokens}}


def verify_costs(target: str, draft: str | None, device: torch.device, dtype: torch.dtype, context: int,
                 max_tokens: int, reps: int, warmup: int) -> VerifyCosts:
    """Load the target (`TargetModel`, capturing the hidden states `draft` reads, as a round does; else layer 1)
    and time its score pass (`time_verify`)."""
    from dspark_cli.runtime.checkpoint.config import DraftConfig
    from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
    from dspark_cli.runtime.checkpoint.target_files import check_target_files
    from dspark_cli.runtime.model.target import TargetModel

    read_target_config(target)  # a draft given as the target is refused here, before anything loads
    check_target_files(target)
    indices = [1]
    if draft is not None:
        indices = DraftConfig.from_dict(open_checkpoint(draft).config).hidden_state_indices or indices
    model = TargetModel.load(target, indices, dtype=dtype, device=device)
    return time_verify(model, target, context, max_tokens, reps, warmup)


def time_verify(target, source: str, context: int, max_tokens: int, reps: int, warmup: int, seed: int = 0
                ) -> VerifyCosts:
    """Median milliseconds of target.score over 1..max_tokens tokens after a `context`-token prefill."""
    if context < 1 or max_tokens < 1:
        raise ValueError(f"the context and the number of tokens must be at least 1, got {context} and {max_tokens}")
    limit = getattr(target.config, "max_position_embeddings", None)
    if isinstance(limit, int) and context + max_tokens > limit:
        raise ValueError(f"a context of {context} plus {max_tokens} tokens is more than the target's "
                         f"{limit} positions; use a shorter context")
    generator = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    prompt = torch.randint(vocab, (context,), generator=generator).to(target.device)  # [C]
    block = torch.randint(vocab, (max_tokens,), generator=generator).to(target.device)  # [T]
    target.prefill(prompt)

    def pass_over(t: int):
        def run():
            target.score(block[:t])  # [t] -> logits [t, V], features [t, n*Ht]
            target.crop(context)
        return run

    lengths = list(range(1, max_tokens + 1))
    timings = time_interleaved([pass_over(t) for t in lengths], target.device.type, reps, warmup)
    return VerifyCosts(source, str(target.device), str(target.dtype).removeprefix("torch."), context,
                       dict(zip(lengths, timings)))


@dataclass
class BatchVerifyCosts:
    target: str
    device: str
    dtype: str
    context: int
    timings: dict[tuple[int, int], Timing]  # (batch, tokens per request) -> timing

    def to_dict(self) -> dict:
        batches = sorted({b for b, _ in self.timings})
        tokens = sorted({t for _, t in self.timings})
        return {"format": GRID_FORMAT, "measured_by": MEASURED_BY, "target": self.target, "device": self.device,
                "dtype": self.dtype, "context": self.context, "batches": batches, "tokens": tokens,
                "ms": [[self.timings[b, t].median_us / 1000 for t in tokens] for b in batches],
                "timings": {str(b): {str(t): self.timings[b, t].to_dict() for t in tokens} for b in batches}}


def batch_verify_costs(target: str, draft: str | None, device: torch.device, dtype: torch.dtype, context: int,
                       max_tokens: int, batches: tuple[int, ...], reps: int, warmup: int) -> BatchVerifyCosts:
    """Load the target as verify_costs does and time B x t passes (`time_verify_batches`)."""
    from dspark_cli.runtime.checkpoint.config import DraftConfig
    from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
    from dspark_cli.runtime.checkpoint.target_config import TargetConfig
    from dspark_cli.runtime.checkpoint.target_files import check_target_files
    from dspark_cli.runtime.model.target import TargetModel

    config = read_target_config(target)
    check_target_files(target)
    parts = batch_memory_needed(TargetConfig.from_dict(config).text, open_checkpoint(target).tensors.values(), dtype,
                                context, max_tokens, max(batches))
    check_fits(parts, available_memory(device), device, f"bench verify at batch {max(batches)}",
               "use smaller batch sizes, a shorter context or fewer tokens")
    indices = [1]
    if draft is not None:
        indices = DraftConfig.from_dict(open_checkpoint(draft).config).hidden_state_indices or indices
    model = TargetModel.load(target, indices, dtype=dtype, device=device)
    return time_verify_batches(model, target, context, max_tokens, batches, reps, warmup)


def batch_memory_needed(text: dict, tensors, dtype: torch.dtype, context: int, max_tokens: int,
                        batch: int) -> dict[str, int]:
    """Rough peak bytes of the largest batch, a lower bound: the weights in `dtype` (tensors: the checkpoint's
    TensorInfo), the KV cache of batch x (context + max_tokens) positions, the prefill's MLP activations (gate, up and
    their product over batch x context positions) and the pass's float32 logits (batch x max_tokens x vocab). text:
    the target's text config."""
    size = torch.empty((), dtype=dtype).element_size()
    heads, hidden = text.get("num_attention_heads") or 1, text.get("hidden_size") or 0
    head_dim = text.get("head_dim") or hidden // heads
    kv_width = 2 * (text.get("num_key_value_heads") or heads) * head_dim  # K and V per layer and position
    positions = batch * (context + max_tokens)
    return {"weights": sum(t.numel for t in tensors) * size,
            f"KV cache for {batch} x {context + max_tokens} positions":
                positions * (text.get("num_hidden_layers") or 0) * kv_width * size,
            "prefill activations": 3 * batch * context * (text.get("intermediate_size") or hidden) * size,
            "logits": 4 * batch * max_tokens * (text.get("vocab_size") or 0)}


def time_verify_batches(target, source: str, context: int, max_tokens: int, batches: tuple[int, ...], reps: int,
                        warmup: int, seed: int = 0) -> BatchVerifyCosts:
    """Median milliseconds of one forward over B x t tokens after B cached contexts of `context` tokens, for every
    B in `batches` and t = 1..max_tokens."""
    from transformers import DynamicCache

    if context < 1 or max_tokens < 1 or not batches or min(batches) < 1:
        raise ValueError(f"the context, the number of tokens and every batch size must be at least 1, got {context}, "
                         f"{max_tokens} and {list(batches)}")
    if target.state is not None:
        raise ValueError(f"a batched verify pass needs an attention-only target; this {target.family.name} target "
                         "keeps recurrent states: time it at batch 1")
    limit = getattr(target.config, "max_position_embeddings", None)
    if isinstance(limit, int) and context + max_tokens > limit:
        raise ValueError(f"a context of {context} plus {max_tokens} tokens is more than the target's "
                         f"{limit} positions; use a shorter context")
    generator = torch.Generator().manual_seed(seed)
    layers = target.model.get_decoder().layers
    captured: dict[int, torch.Tensor] = {}

    def keep(index: int):
        def hook(module, inputs, output) -> None:
            captured[index] = output[0] if isinstance(output, tuple) else output  # [B, t, Ht]
        return hook

    modules = [target.model.get_decoder().get_input_embeddings() if i == 0 else layers[i - 1]
               for i in target.capture_indices]
    handles = [m.register_forward_hook(keep(i)) for m, i in zip(modules, target.capture_indices)]
    passes, keys = [], []
    try:
        for batch in sorted(set(batches)):
            cache = DynamicCache()
            prompt = torch.randint(target.vocab_size, (batch, context), generator=generator).to(target.device)
            block = torch.randint(target.vocab_size, (batch, max_tokens), generator=generator).to(target.device)
            with torch.inference_mode():
                target.model(input_ids=prompt, position_ids=_positions(0, context, batch, target.device),
                             use_cache=True, logits_to_keep=1, **{target.cache_kwarg: cache})  # [B, C] prefilled
            for t in range(1, max_tokens + 1):
                passes.append(_batched_pass(target, cache, block[:, :t], context, captured))
                keys.append((batch, t))
        timings = time_interleaved(passes, target.device.type, reps, warmup)
    finally:
        for handle in handles:
            handle.remove()
    return BatchVerifyCosts(source, str(target.device), str(target.dtype).removeprefix("torch."), context,
                            dict(zip(keys, timings)))


def _positions(start: int, length: int, batch: int, device) -> torch.Tensor:
    return torch.arange(start, start + length, device=device)[None].expand(batch, -1)  # [B, length]


def _batched_pass(target, cache, block: torch.Tensor, context: int, captured: dict):
    """One verify pass of B requests: [B, t] ids -> logits [B, t, V] and features [B, t, n*Ht], cache cropped back."""
    batch, t = block.shape
    positions = _positions(context, t, batch, block.device)

    def run():
        with torch.inference_mode():
            target.model(input_ids=block, position_ids=positions, use_cache=True, **{target.cache_kwarg: cache})
            torch.cat([captured[i] for i in target.capture_indices], dim=-1)  # [B, t, n*Ht], as a round reads them
            captured.clear()
            cache.crop(-t)  # back to the context (transformers 5 crops by a negative delta)
    return run
