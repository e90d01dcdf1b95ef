"""Benchmark one `dspark train` step: the feature contract against the earlier full-logits step, on CPU.

    .venv/bin/python benchmarks/bench_train_features.py [--steps 4] [--batch-size 2] [--seq-len 256] [--hidden 128]

A random Qwen3 target with a real vocabulary (151,936 rows, Qwen3's) and a small width, and a 1-layer draft (block 7,
Markov rank 64) reading 3 of its layers. Each variant runs in its own process (one torch thread) on the same batches
and anchors (same seed):

- before: the step as it was, `output_hidden_states=True` and the target's logits at every position [B, T, V],
  gathered at the anchor blocks' slots (tests/train/test_features.py keeps the same reference step);
- after: `DraftTrainer.run_step`: forward hooks on the draft's target layers and the decoder's post-norm output (the
  target's lm_head never runs there), then the frozen lm_head on the valid anchor-block slots only.

Peak memory = the process's peak resident set (ru_maxrss) minus its resident set once the target, the draft and the
data are built: what the steps add. Step time = the mean over the steps after the first. Printed for the default
anchors (seq-len / 8, DeepSpec's ratio) and for seq-len / 32; ratios are after / before, in the same run. The
machine's other load moves the times; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

VOCAB = 151_936


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def build_trainer(args: argparse.Namespace):
    import torch

    from dspark_cli.runtime.train.data import TokenStream
    from dspark_cli.runtime.train.new_draft import DraftShape, build_draft, new_draft_config
    from dspark_cli.runtime.train.options import TrainOptions
    from dspark_cli.runtime.train.tiny_target import TargetGeometry
    from dspark_cli.runtime.train.trainer import DraftTrainer

    torch.manual_seed(0)
    target = TargetGeometry(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                            num_hidden_layers=6, num_attention_heads=args.hidden // 32, num_key_value_heads=1,
                            head_dim=32).build(0, 0).eval()
    options = TrainOptions(steps=args.steps + 1, batch_size=args.batch_size, seq_len=args.seq_len, anchors=args.anchors,
                           lr=1e-3, seed=0)
    shape = DraftShape(layers=1, block_size=7, markov_rank=64, target_layers=(1, 2, 3), mask_token_id=VOCAB - 1)
    config, _ = new_draft_config(target.config.to_dict(), None, shape, args.anchors)
    stream = TokenStream(torch.randint(0, VOCAB - 1, (50_000,), generator=torch.Generator().manual_seed(0)))
    return DraftTrainer(target, build_draft(config, target), stream, options)


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO / "tests" / "fixtures"))
    from full_logits_step import full_logits_step  # the step before the feature contract

    trainer = build_trainer(args)
    step = trainer.run_step if args.variant == "after" else lambda: full_logits_step(trainer)
    base = resident_bytes()
    times, losses = [], []
    for _ in range(args.steps + 1):
        started = time.perf_counter()
        losses.append(step().value)
        times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print(json.dumps({"peak_bytes": peak, "step_s": sum(times[1:]) / len(times[1:]), "losses": losses}))


def measure(variant: str, anchors: int, args: argparse.Namespace) -> dict:
    argv = [sys.executable, __file__, "--variant", variant, "--anchors", str(anchors), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--hidden", str(args.hidden)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--anchors", type=int, default=None)
    parser.add_argument("--variant", choices=("before", "after"), default=None)
    args = parser.parse_args()
    if args.variant is not None:
        return child(args)
    print(f"target: Qwen3, vocab {VOCAB:,}, hidden {args.hidden}, 6 layers; draft: 1 layer, block 7, reads 3 layers; "
          f"batch {args.batch_size} x {args.seq_len} tokens, {args.steps} timed steps (+1 warm-up), CPU, 1 thread")
    print(f"{'anchors':>8} {'variant':>8} {'peak MiB':>9} {'step s':>7}   max |loss diff|")
    for anchors in (args.seq_len // 8, args.seq_len // 32):
        before, after = measure("before", anchors, args), measure("after", anchors, args)
        diff = max(abs(a - b) for a, b in zip(before["losses"], after["losses"]))
        for name, run in (("before", before), ("after", after)):
            print(f"{anchors:>8} {name:>8} {run['peak_bytes'] / 2**20:>9.0f} {run['step_s']:>7.2f}   "
                  f"{diff if name == 'after' else '':}")
        print(f"{anchors:>8} {'ratio':>8} {after['peak_bytes'] / before['peak_bytes']:>9.2f} "
              f"{after['step_s'] / before['step_s']:>7.2f}   (after / before)")


if __name__ == "__main__":
    main()
