"""Benchmark: does a second torch thread pay off? Random Qwen3 targets of growing size, one decode step and one
verify of 8 tokens on a 300-token cache, 1 vs 2 threads, all interleaved (the (size, part, threads) calls rotate
every round). Prints min and median ms and the 2-thread / 1-thread ratio of the medians; the crossover is what
`dspark generate`'s default thread count (runtime/threads.py) is based on.

    .venv/bin/python benchmarks/bench_threads.py [--reps 20] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from dspark_cli.runtime.model.target import TargetModel  # noqa: E402

# (hidden, layers, intermediate, heads, kv heads, vocab): the demo target's shape, then larger ones
SHAPES = [(192, 3, 576, 6, 2, 1024), (512, 6, 1536, 8, 2, 8192), (1024, 4, 3072, 16, 8, 32768),
          (2048, 2, 6144, 16, 8, 32768)]
CONTEXT = 300


def random_target(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, vocab: int) -> TargetModel:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                         vocab_size=vocab, max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    return TargetModel(Qwen3ForCausalLM(config).float(), capture_indices=[1])  # verify captures, as in generation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]
    calls = {}
    sizes = {}
    for shape in SHAPES:
        target = random_target(*shape)
        sizes[shape] = sum(p.numel() for p in target.model.parameters())
        ids = torch.randint(1, shape[-1], (CONTEXT + 8,), generator=torch.Generator().manual_seed(0))
        target.prefill(ids[:CONTEXT])

        def step(target=target, ids=ids):
            target.decode_one(int(ids[CONTEXT]))
            target.crop(CONTEXT)

        def verify(target=target, ids=ids):
            target.score(ids[CONTEXT : CONTEXT + 8])
            target.crop(CONTEXT)

        for threads in thread_counts:
            calls[(shape, "decode step", threads)] = step
            calls[(shape, "verify 8", threads)] = verify
    keys = list(calls)
    samples = {key: [] for key in keys}
    for number in range(args.reps + 1):
        start = number % len(keys)
        for key in keys[start:] + keys[:start]:
            torch.set_num_threads(key[2])
            began = time.perf_counter()
            calls[key]()
            if number:  # round 0 warms up
                samples[key].append((time.perf_counter() - began) * 1e3)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, {args.reps} interleaved reps, cache {CONTEXT}")
    print(f"{'hidden x layers':>16} {'params':>8} {'part':>12} {'threads':>7} {'min ms':>8} {'median ms':>10} "
          f"{'vs 1st threads (median)':>24}")
    for shape, part, threads in keys:
        times = samples[(shape, part, threads)]
        first = statistics.median(samples[(shape, part, thread_counts[0])])
        print(f"{f'{shape[0]} x {shape[1]}':>16} {sizes[shape] / 1e6:>7.1f}M {part:>12} {threads:>7} "
              f"{min(times):>8.2f} {statistics.median(times):>10.2f} {statistics.median(times) / first:>23.2f}x")


if __name__ == "__main__":
    main()
