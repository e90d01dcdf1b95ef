"""The bf16-or-fp32 choice of the bias screen: decided by timing, with a fake clock here (no timing asserts)."""

import pytest
import torch

from dspark_cli.runtime.quantize import matmul_dtype
from dspark_cli.runtime.quantize.matmul_dtype import fast_matmul_dtype, pick_faster


class FakeClock:
    """A clock that only moves when a fake matmul 'runs' for its given duration; records the call order."""

    def __init__(self, durations: dict[str, list[float]]):
        self.now = 0.0
        self.durations = {name: iter(times) for name, times in durations.items()}
        self.order: list[str] = []

    def __call__(self) -> float:
        return self.now

    def call(self, name: str):
        def run():
            self.order.append(name)
            self.now += next(self.durations[name])

        return run


def choose(bf16: list[float], fp32: list[float]) -> tuple[torch.dtype, list[str]]:
    clock = FakeClock({"bf16": bf16, "fp32": fp32})
    return pick_faster(clock.call("bf16"), clock.call("fp32"), clock), clock.order


@pytest.mark.parametrize(
    ("bf16", "fp32", "expected"),
    [
        ([9.0, 1.0, 1.0, 1.0, 1.0, 1.0], [9.0, 3.0, 3.0, 3.0, 3.0, 3.0], torch.bfloat16),  # AVX512-BF16 / AMX CPU
        ([0.1, 6.0, 6.0, 6.0, 6.0, 6.0], [9.0, 1.0, 1.0, 1.0, 1.0, 1.0], torch.float32),  # emulated bf16
        # one lucky bf16 run wins over a steadier fp32 (best time), and the warm-up run is never counted
        ([0.0, 5.0, 5.0, 0.5, 5.0, 5.0], [0.0, 1.0, 1.0, 1.0, 1.0, 1.0], torch.bfloat16),
        ([9.0, 2.0, 2.0, 2.0, 2.0, 2.0], [9.0, 2.0, 2.0, 2.0, 2.0, 2.0], torch.float32),  # a tie: fp32
    ],
)
def test_pick_faster_takes_the_best_time_after_warm_up(bf16, fp32, expected):
    dtype, order = choose(bf16, fp32)
    assert dtype == expected
    assert order == ["bf16", "fp32"] * 6  # warm-up, then alternating, so load spikes hit both dtypes alike


def test_fast_matmul_dtype_is_decided_once(monkeypatch):
    fast_matmul_dtype.cache_clear()
    calls = []
    monkeypatch.setattr(matmul_dtype, "pick_faster", lambda *args: calls.append(args) or torch.float32)
    assert fast_matmul_dtype() == fast_matmul_dtype() == torch.float32
    assert len(calls) == 1
    fast_matmul_dtype.cache_clear()
