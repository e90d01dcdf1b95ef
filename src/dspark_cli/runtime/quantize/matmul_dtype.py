"""Which dtype multiplies faster on this CPU: bf16 or fp32 (decided once per process by timing both).

A bf16 matmul halves the bytes read, but its speed depends on the CPU: with AVX512-BF16 or AMX, oneDNN runs it
natively and it is about 2-5x faster than fp32 (measured: [64, 256] x [256, 151936] in 95-110 ms bf16 vs
237-565 ms fp32, on a 2-core AVX512-BF16 Xeon under load); without them it is emulated and 5-7x slower than fp32.
torch's `backends.cpu.get_cpu_capability()` reports "AVX512" on both kinds of CPU, so the answer is measured:
a [64, 256] x [256, 4096] product, a few interleaved repetitions in each dtype (a few ms in all).
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import torch

_CALIBRATION_SHAPE = (64, 256, 4096)  # rows, inner, columns: the bias screen's shape, fewer columns
_CALIBRATION_REPS = 5


@functools.cache
def fast_matmul_dtype() -> torch.dtype:
    """torch.bfloat16 if a bf16 matmul beats an fp32 one on this CPU (best of a few runs each), else torch.float32."""
    rows, inner, columns = _CALIBRATION_SHAPE
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, inner, generator=gen), torch.randn(inner, columns, generator=gen)
    a16, b16 = a.bfloat16(), b.bfloat16()
    return pick_faster(lambda: a16 @ b16, lambda: a @ b, time.perf_counter)


def pick_faster(
    bf16_matmul: Callable[[], object], fp32_matmul: Callable[[], object], clock: Callable[[], float]
) -> torch.dtype:
    """Time both calls `_CALIBRATION_REPS` times, alternating (after one untimed warm-up each), and return the dtype
    whose best time is lower; a tie goes to fp32, which never is the slow one by much."""
    best = {torch.bfloat16: float("inf"), torch.float32: float("inf")}
    calls = {torch.bfloat16: bf16_matmul, torch.float32: fp32_matmul}
    for call in calls.values():
        call()
    for _ in range(_CALIBRATION_REPS):
        for dtype, call in calls.items():
            started = clock()
            call()
            best[dtype] = min(best[dtype], clock() - started)
    return torch.bfloat16 if best[torch.bfloat16] < best[torch.float32] else torch.float32

