"""Benchmark data-parallel `dspark train` on CPU: training tokens/s per process with 1 and with 2 processes.

    .venv/bin/python benchmarks/bench_train_dist.py [--steps 30] [--batch-size 8] [--seq-len 128] [--hidden 128]

Builds a small random Qwen3 target (byte-level BPE tokenizer trained on the interpreter's standard-library
sources, which are also the training text), then runs the same `dspark train` (same global batch, seed and steps)
as one process and under `torchrun --nproc-per-node 2` (gloo), each process with one thread
(OMP_NUM_THREADS=1). The rate is the one `dspark train` reports at its last step (all processes' tokens since
the first step, which includes warm-up); per process = that / processes. Ratio = per-process rate with 2 processes
over the 1-process rate: 1.0 means perfect scaling (twice the throughput), below 1 is the cost of the gradient
all-reduce, of the per-step collectives and of cores shared with other work. Start-up (loading the target, joining
the process group) is not counted. Speed is for the reader to judge; no threshold is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def build_target(root: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    """(target folder with tokenizer, data folder) for the run."""
    from dspark_cli.runtime.train.tiny_target import TargetGeometry, build_tokenizer
    from dspark_cli.runtime.train.data import stdlib_sources

    data = root / "data"
    data.mkdir()
    for index, source in enumerate(stdlib_sources()[:40]):
        (data / f"{index:03d}.py").write_text(source.read_text(encoding="utf-8", errors="replace"))
    files = sorted(data.iterdir())
    tokenizer = build_tokenizer(files, vocab_size=1024)
    geometry = TargetGeometry(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 3,
                              num_hidden_layers=layers, num_attention_heads=max(1, hidden // 32),
                              num_key_value_heads=max(1, hidden // 64), head_dim=32)
    geometry.build(tokenizer.eos_token_id, 0).save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return root / "target", data


def run(processes: int, target: Path, data: Path, root: Path, args: argparse.Namespace) -> float:
    """Tokens/s of all processes together at the last step."""
    log = root / f"log{processes}.jsonl"
    command = [sys.executable, *(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                  str(processes)] if processes > 1 else []),
               "-m", "dspark_cli", "train", "--target", str(target), "--data", str(data), "-o",
               str(root / f"out{processes}"), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--seq-len", str(args.seq_len), "--layers", "1", "--block-size", "7", "--markov-rank", "64",
               "--device", "cpu", "--log-jsonl", str(log)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(log.read_text().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4, help="target layers")
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        target, data = build_target(root, args.hidden, args.layers)
        one = run(1, target, data, root, args)
        two = run(2, target, data, root, args)
    print(f"target hidden {args.hidden} x {args.layers} layers, global batch {args.batch_size} x {args.seq_len} "
          f"tokens, {args.steps} steps, 1 thread per process, {os.cpu_count()} CPU cores")
    print(f"{'processes':>9}  {'tokens/s (all)':>14}  {'tokens/s per process':>20}")
    print(f"{1:>9}  {one:>14,.0f}  {one:>20,.0f}")
    print(f"{2:>9}  {two:>14,.0f}  {two / 2:>20,.0f}")
    print(f"per-process ratio (2 processes / 1): {two / 2 / one:.2f}; speed-up of the job: {two / one:.2f}x")


if __name__ == "__main__":
    main()
