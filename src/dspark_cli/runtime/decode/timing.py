"""SectionTimer: wall-clock milliseconds per named section, one record per speculative round.

    timer = SectionTimer(device)
    timer.start_round()
    with timer.section("draft"):
        ...
    timer.rounds      # [{"draft": 1.9, "markov": 0.5, ...}, ...] ms per section name, one dict per round

On CUDA it synchronizes at each section edge, so a section covers the kernels it launched.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch


class SectionTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.started = self.now()
        self.rounds: list[dict[str, float]] = []

    def now(self) -> float:
        """Seconds (perf_counter), after the device's queued work."""
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start_round(self) -> None:
        self.rounds.append({})

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Add the time spent in the block to `name` in the current round (ms)."""
        start = self.now()
        try:
            yield
        finally:
            record = self.rounds[-1]
            record[name] = record.get(name, 0.0) + 1000.0 * (self.now() - start)
