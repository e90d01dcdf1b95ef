"""Benchmark DSpark decoding on a stateful target: a small Qwen3.5-style hybrid (3 Gated DeltaNet layers to 1
attention layer), trained briefly, with a DSpark draft trained briefly for it; speculative vs plain decoding on one
thread, the round's breakdown and the rollback step's share of it, the score pass over 1..8 positions against one
decoding step, and the rollback schemes measured side by side.

    .venv/bin/python benchmarks/bench_stateful.py                      # ~5 min on one CPU thread
    .venv/bin/python benchmarks/bench_stateful.py --target-steps 60 --draft-steps 40 --prompts 2   # a quick look

What it builds (in a temporary folder, deleted at the end): the demo tokenizer (1024 ids); a Qwen3_5ForCausalLM of
--hidden width and --layers layers in the pattern linear, linear, linear, full, trained --target-steps next-token
steps on Python standard-library files; a 1-layer DSpark draft trained --draft-steps by `dspark train`. Then, on
held-out files' opening lines, greedy, one torch thread, each decoder warmed up once:
  - plain decoding (Pair.baseline) and speculative decoding (Pair.generate): tokens/s, the ratio, τ, and the mean
    ms per round of each step (the report's breakdown), with rollback = snapshot + rollback sections;
  - the score pass over k = 1..8 positions after a cached prompt (min of --reps): dspark's Gated DeltaNet score pass
    (model/gdn_scoring.py) and transformers' own forward (its chunked kernel, padded to 64 positions), each as a
    multiple of one plain decoding step;
  - rollback schemes on the same target, kept positions 1, half and all of a scored block: dspark's (the state at
    the kept position copied in), the previous scheme (restore a snapshot, re-run the stateful mixers over the kept
    positions) and re-running the whole target over the kept positions, min of --reps.
Every speculative output is compared with plain decoding and a mismatch is printed loudly.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from dspark_cli.runtime.measure.metrics import summarize  # noqa: E402
from dspark_cli.runtime.demo import demo_pair  # noqa: E402
from dspark_cli.runtime.model.target_state import (MixerReplay, StateSnapshot, crop_attention,  # noqa: E402
                                                   stateful_mixers)
from dspark_cli.runtime.pair import Pair  # noqa: E402


def corpus_files(count: int, skip: int = 0) -> list[Path]:
    """Standard-library .py files of 2-40 KB, sorted by name (the demo build's corpus, smaller)."""
    root = Path(os.__file__).parent
    files = sorted(p for p in root.glob("*.py") if 2_000 < p.stat().st_size < 40_000)
    return files[skip : skip + count]


def build_target(folder: Path, hidden: int, layers: int, steps: int, files: list[Path]) -> None:
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from dspark_cli.runtime.train.data import load_token_stream
    from dspark_cli.runtime.train.tiny_target import train_causal_lm

    demo_target, _ = demo_pair()
    tokenizer = AutoTokenizer.from_pretrained(demo_target)
    heads = max(2, hidden // 32)
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=32,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2), linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config)
    stream = load_token_stream(files, tokenizer)
    started = time.perf_counter()
    last = {}
    train_causal_lm(model, stream, steps=steps, batch_size=8, seq_len=128, lr=3e-3, seed=0,
                    on_step=lambda s: last.update(loss=s.loss))
    print(f"target: Qwen3.5-style {layers} layers x {hidden} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M"
          f" parameters), {steps} steps in {time.perf_counter() - started:.0f} s, last loss {last.get('loss', 0):.2f}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def train_draft(target: Path, out: Path, steps: int, files: list[Path], block_size: int) -> None:
    from dspark_cli.cli import app

    started = time.perf_counter()
    args = ["train", "--target", str(target), "-o", str(out), "--steps", str(steps), "--batch-size", "8",
            "--seq-len", "128", "--lr", "3e-3", "--seed", "0", "--device", "cpu", "--block-size", str(block_size),
            "--layers", "1"]
    for file in files:
        args += ["--data", str(file)]
    try:
        app(args, standalone_mode=False)
    except SystemExit as done:
        if done.code:
            raise
    print(f"draft: 1 DSpark layer, block {block_size}, {steps} steps in {time.perf_counter() - started:.0f} s")


def prompts_from(files: list[Path], count: int) -> list[str]:
    return [file.read_text(errors="replace")[:400] for file in files[:count]]


def decoding(pair: Pair, prompts: list[str], tokens: int) -> None:
    pair.warm_up(prompts[0], max_new_tokens=tokens, baseline=True)
    spec, plain = [], []
    for prompt in prompts:
        base = pair.baseline(prompt, max_new_tokens=tokens, stop_ids=[])
        result = pair.generate(prompt, max_new_tokens=tokens, stop_ids=[])
        if result.tokens != base.tokens:
            print("!!! speculative output differs from plain decoding on a prompt: NOT LOSSLESS")
        spec.append(result.stats)
        plain.append(base.stats)
    summary = summarize(spec, plain, pair.block_size)
    b = summary.round_breakdown
    print(f"\ndecoding, greedy, 1 thread, {len(prompts)} prompts x {tokens} new tokens, block {pair.block_size}")
    print(f"  plain        {summary.baseline.tokens_per_s:8.1f} tokens/s")
    print(f"  speculative  {summary.tokens_per_s:8.1f} tokens/s   {summary.baseline.speedup:.2f}x plain   "
          f"tau {summary.tau:.2f} (incl. bonus)   accepted {summary.draft_acceptance_rate:.0%} of scored")
    print(f"  ms per round: draft {b.draft_backbone_ms:.2f}  markov {b.markov_ms:.2f}  verify {b.verify_ms:.2f}  "
          f"rollback {b.rollback_ms:.2f}  other {b.other_ms:.2f}  total {b.total_ms:.2f}")
    print(f"  rollback share of a round: {b.rollback_share:.1%}")
    rounds = [r for s in spec for r in s.rounds]
    sections = [t for s in spec for t in s.sections]
    full = [t.get("rollback", 0.0) for t, r in zip(sections, rounds) if r.accepted == r.proposed and "rollback" in t]
    part = [t.get("rollback", 0.0) for t, r in zip(sections, rounds) if r.accepted < r.proposed and "rollback" in t]
    snap = [t.get("snapshot", 0.0) for t in sections]
    def median(values: list[float], scale: float, unit: str) -> str:
        return f"{statistics.median(values) * scale:.2f} {unit}" if values else "-"

    print(f"  snapshot (every round) median {median(snap, 1000, 'us')}; restore + replay median: "
          f"{median(part, 1, 'ms')} in {len(part)} rounds with a rejection, {median(full, 1000, 'us')} in "
          f"{len(full)} fully accepted rounds")


def timed(run, reps: int, before=None) -> float:
    """Min over reps of the seconds `run` takes, `before` (untimed) run ahead of each."""
    best = float("inf")
    for _ in range(reps):
        if before is not None:
            before()
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


@torch.inference_mode()
def score_pass_costs(pair: Pair, prompt: str, reps: int, most: int = 8) -> None:
    """A score pass over k = 1..most positions after a cached prompt, against one plain decoding step: dspark's
    Gated DeltaNet score pass (model/gdn_scoring.py) and transformers' own forward (chunked kernel padded to 64)."""
    target = pair.target
    ids = torch.tensor(pair.encode(prompt)[:200])
    tokens = torch.tensor(pair.encode(prompt)[200 : 200 + most])
    target.prefill_plain(ids)
    step = timed(lambda: target.decode_one(int(tokens[0])), reps * 4)
    print(f"\nscore pass over k positions after a {len(ids)}-token prompt, min of {reps}, against one decoding step "
          f"({step * 1000:.2f} ms)")
    print(f"  {'k':>2} {'dspark (ms)':>12} {'x step':>7} {'transformers forward (ms)':>26} {'x step':>7}")
    for k in range(1, most + 1):
        block = tokens[:k]

        def fresh() -> None:
            target.prefill(ids)

        ours = timed(lambda: target.score(block), reps, fresh)
        theirs = timed(lambda: target.model(input_ids=block[None], use_cache=True, position_ids=torch.arange(
            len(ids), len(ids) + k)[None], **{target.cache_kwarg: target.cache}), reps, fresh)
        print(f"  {k:>2} {ours * 1000:>12.2f} {ours / step:>7.2f} {theirs * 1000:>26.2f} {theirs / step:>7.2f}")


@torch.inference_mode()
def rollback_schemes(pair: Pair, prompt: str, reps: int) -> None:
    """Keeping 1, half and all of a scored block: dspark's copy of the kept position's state, the previous scheme
    (restore a snapshot, re-run the stateful mixers over the kept positions) and re-running the whole target."""
    target = pair.target
    ids = torch.tensor(pair.encode(prompt)[:200])
    block = torch.tensor(pair.encode(prompt)[200 : 200 + pair.block_size + 1])
    n = len(block)
    replay = MixerReplay.install(stateful_mixers(target.model, target.family))  # records only when started

    def transformers_score() -> StateSnapshot:
        target.prefill_plain(ids)
        snapshot = StateSnapshot.take(target.cache)
        replay.start()
        target.model(input_ids=block[None], use_cache=True, position_ids=torch.arange(len(ids), len(ids) + n)[None],
                      **{target.cache_kwarg: target.cache})
        replay.stop()
        return snapshot

    print(f"\nrollback of a scored block of {n} positions after a {len(ids)}-token prompt, min of {reps} (ms)")
    print(f"  {'kept':>4} {'copy (dspark)':>14} {'restore + mixer replay':>23} {'whole target re-run':>20}")
    for keep in sorted({1, n // 2, n}):
        copy, mixers, whole = [], [], []
        for _ in range(reps):
            target.prefill(ids)
            target.score(block)
            started = time.perf_counter()
            target.crop(len(ids) + keep)
            copy.append(time.perf_counter() - started)

            snapshot = transformers_score()
            started = time.perf_counter()
            if keep < n:
                snapshot.restore()
                replay.run(keep, n)
                crop_attention(target.cache, len(ids) + keep)
            mixers.append(time.perf_counter() - started)
            replay.calls = []

            snapshot = transformers_score()
            started = time.perf_counter()
            if keep < n:
                snapshot.restore()
                crop_attention(target.cache, len(ids))
                target.model(input_ids=block[None, :keep], use_cache=True, logits_to_keep=1,
                             position_ids=torch.arange(len(ids), len(ids) + keep)[None],
                             **{target.cache_kwarg: target.cache})
            whole.append(time.perf_counter() - started)
        print(f"  {keep:>4} {min(copy) * 1000:>14.3f} {min(mixers) * 1000:>23.2f} {min(whole) * 1000:>20.2f}")
    target.prefill_plain(ids)
    print(f"  recurrent + conv state of the target: {StateSnapshot.take(target.cache).nbytes / 1024:.0f} KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--target-steps", type=int, default=300)
    parser.add_argument("--draft-steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    files, held_out = corpus_files(24), corpus_files(args.prompts, skip=24)
    work = Path(tempfile.mkdtemp(prefix="bench_stateful_"))
    try:
        build_target(work / "target", args.hidden, args.layers, args.target_steps, files)
        train_draft(work / "target", work / "draft", args.draft_steps, files, args.block_size)
        pair = Pair.load(str(work / "target"), str(work / "draft"), device="cpu", dtype="float32")
        decoding(pair, prompts_from(held_out, args.prompts), args.max_new_tokens)
        text = held_out[0].read_text(errors="replace")[:4000]
        score_pass_costs(pair, text, args.reps)
        rollback_schemes(pair, text, args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
