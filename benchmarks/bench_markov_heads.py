"""Benchmark the Markov stage per head type (vanilla, gated, rnn) on the same random inputs.

    .venv/bin/python benchmarks/bench_markov_heads.py [--vocab 32768] [--rank 256] [--hidden 1024] [--block 7]
                                                      [--topk 8] [--repeats 30] [--device cpu|cuda]

One walk of `runtime.decode.markov.markov_walk` (what `dspark generate` runs each round) over B = 1 block of N
positions, dense and top-k strategies, in float32 (bf16 on CUDA). The gated head adds a [H + r] x [r] GEMV per
position and the RNN head a [2r + H] x [3r] one, next to the [r] x [Vd] (dense) or [r] x [k] (top-k) bias.
Prints the median ms per walk (interleaved rounds, after a warm-up) and the ratio against vanilla in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dspark_cli.runtime.decode.markov import MarkovWeights, markov_walk  # noqa: E402
from dspark_cli.runtime.settings import SamplingParams  # noqa: E402
from dspark_cli.runtime.model.heads import HEADS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--block", type=int, default=7)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    weights = {}
    for name, cls in HEADS.items():
        head = cls(args.vocab, args.vocab, args.rank, args.hidden).to(device=device, dtype=dtype).eval()
        for param in head.parameters():
            torch.nn.init.normal_(param, std=0.05)
        weights[name] = MarkovWeights(head.markov_w1.weight, head.markov_w2.weight, None, 1.0, None,
                                      head if head.uses_hidden else None)
    base = torch.randn(1, args.block, args.vocab, device=device)
    hidden = torch.randn(1, args.block, args.hidden, device=device, dtype=dtype)
    first = torch.tensor([3], device=device)
    greedy = SamplingParams()
    runs = [(name, strategy) for strategy in ("dense", "topk") for name in HEADS]

    def walk(name: str, strategy: str) -> None:
        k = args.topk if strategy == "topk" else None
        markov_walk(strategy, weights[name], base, first, greedy, draft_topk=k, hidden=hidden)

    times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    with torch.inference_mode():
        for run in runs:  # warm-up
            walk(*run)
        for i in range(args.repeats):
            for run in runs[i % len(runs):] + runs[: i % len(runs)]:  # rotated order every round
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                walk(*run)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[run].append((time.perf_counter() - start) * 1e3)
    print(f"Markov walk, B=1, N={args.block}, Vd={args.vocab}, r={args.rank}, H={args.hidden}, {device} {dtype}, "
          f"median of {args.repeats}")
    print(f"{'strategy':10} {'head':8} {'ms/walk':>9} {'x vanilla':>10}")
    for strategy in ("dense", "topk"):
        vanilla = statistics.median(times[("vanilla", strategy)])
        for name in HEADS:
            ms = statistics.median(times[(name, strategy)])
            label = strategy if strategy == "dense" else f"topk-{args.topk}"
            print(f"{label:10} {name:8} {ms:9.3f} {ms / vanilla:10.2f}")


if __name__ == "__main__":
    main()
