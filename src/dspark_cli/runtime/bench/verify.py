"""`dspark bench verify`: the cost of the target's score pass over t tokens, t = 1..T, on this device.

    costs = time_verify(target, context=512, max_tokens=8, reps=20, warmup=3)
    costs.to_dict()     # {"format": "dspark-verify-costs/1", "tokens": [1..8], "ms": [...], ...}: `dspark plan --costs`

A speculative round scores [anchor, d_1..d_n] after the committed context: one target forward over n + 1 tokens with
the cache holding `context` positions (TargetModel.score, hidden states captured as for a draft), then the cache is
cropped back. Each length is timed in rotated, interleaved rounds (bench/timer.py), so load on a shared machine hits
every length alike; the median is the cost. Batch 1, as `dspark eval` runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_cli.runtime.bench.timer import Timing, time_interleaved

COSTS_FORMAT = "dspark-verify-costs/1"


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
