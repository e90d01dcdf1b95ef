"""The timer of `dspark bench markov` (runtime/bench/run.py): calls timed in rotated, interleaved rounds (CUDA events on
CUDA, a wall clock elsewhere), their spread, CUDA-graph capture, and the cost of one kernel launch.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

# A row whose (p90 - min) / min exceeds this is flagged "too noisy to compare": on a shared CPU, two rows doing
# the same work differ by up to this much from load alone.
SPREAD_LIMIT = 0.25


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
