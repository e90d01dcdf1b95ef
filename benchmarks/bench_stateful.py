"""Benchmark DSpark decoding on a stateful target: a small Qwen3.5-style hybrid (3 Gated DeltaNet layers to 1
attention layer), trained briefly, with a DSpark draft trained briefly for it; speculative vs plain decoding on one
thread, the round's breakdown and the rollback step's share of it, the score pass over 1..8 positions against one
decoding step, and the rollback schemes measured side by side.

    .venv/bin/python benchmarks/bench_stateful.py                      # ~5 min on one CPU thread
    .venv/bin/python benchmarks/bench_stateful.py --target-steps 60 --draft-steps 40 --prompts 2   # a quick look
    .venv/bin/python benchmarks/bench_stateful.py --costs-only          # kernels, score pass, rollback (~1 min)

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
    positions) and re-running the whole target over the kept positions, min of --reps;
  - the Gated DeltaNet kernel options for a score pass (the bench's head shape and Qwen3.5's 16 q/k x 32 value heads
    of 128): transformers' chunked kernel, its recurrent kernel stepped per position keeping every state, one
    unpadded chunk with every state formed, the same with only the final state (dspark), and the rollback's state.
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


def qwen3_5_model(hidden: int, layers: int, vocab: int):
    """A random Qwen3_5ForCausalLM of `layers` layers x `hidden` in the pattern linear, linear, linear, full."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    heads = max(2, hidden // 32)
    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=32,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2), linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config)


def build_target(folder: Path, hidden: int, layers: int, steps: int, files: list[Path]) -> None:
    from transformers import AutoTokenizer

    from dspark_cli.runtime.train.data import load_token_stream
    from dspark_cli.runtime.train.tiny_target import train_causal_lm

    tokenizer = AutoTokenizer.from_pretrained(demo_pair()[0])
    model = qwen3_5_model(hidden, layers, len(tokenizer))
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

    print(f"  snapshot (every round) median {median(snap, 1000, 'us')}; rollback median: "
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
def score_pass_costs(target, encoded: list[int], reps: int, most: int = 8) -> None:
    """A score pass over k = 1..most positions after a cached prompt, against one plain decoding step: dspark's
    Gated DeltaNet score pass (model/gdn_scoring.py) and transformers' own forward (chunked kernel padded to 64).
    The three are timed in turn within each repetition (min over reps), so a busy machine slows them alike."""
    ids, tokens = torch.tensor(encoded[:200]), torch.tensor(encoded[200 : 200 + most])
    positions = torch.arange(len(ids), len(ids) + most)[None]  # [1, most]
    step, ours, theirs = [], [[] for _ in range(most)], [[] for _ in range(most)]
    for _ in range(reps):
        target.prefill_plain(ids)
        step.append(timed(lambda: target.decode_one(int(tokens[0])), 1))
        for k in range(1, most + 1):
            target.prefill(ids)
            ours[k - 1].append(timed(lambda: target.score(tokens[:k]), 1))
            target.prefill(ids)
            theirs[k - 1].append(timed(lambda: target.model(input_ids=tokens[None, :k], use_cache=True,
                                                            position_ids=positions[:, :k],
                                                            **{target.cache_kwarg: target.cache}), 1))
    one = min(step)
    target.prefill_plain(ids)
    step_ops = aten_ops(lambda: target.decode_one(int(tokens[0])))
    print(f"\nscore pass over k positions after a {len(ids)}-token prompt, min of {reps}, against one decoding step "
          f"({one * 1000:.2f} ms, {step_ops} aten ops)")
    print(f"  {'k':>2} {'dspark ms':>10} {'x step':>7} {'aten ops':>9} {'transformers ms':>16} {'x step':>7} "
          f"{'aten ops':>9}")
    for k in range(1, most + 1):
        a, b = min(ours[k - 1]), min(theirs[k - 1])
        target.prefill(ids)
        ours_ops = aten_ops(lambda: target.score(tokens[:k]))
        target.prefill(ids)
        theirs_ops = aten_ops(lambda: target.model(input_ids=tokens[None, :k], use_cache=True,
                                                   position_ids=positions[:, :k], **{target.cache_kwarg: target.cache}))
        print(f"  {k:>2} {a * 1000:>10.2f} {a / one:>7.2f} {ours_ops:>9} {b * 1000:>16.2f} {b / one:>7.2f} "
              f"{theirs_ops:>9}")


def aten_ops(run) -> int:
    """The aten ops (nested ones included) one call of run() dispatches: a cost that a busy machine does not move."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        run()
    return sum(event.name.startswith("aten::") for event in profiled.events())


@torch.inference_mode()
def kernel_options(reps: int) -> None:
    """The Gated DeltaNet kernel options for a score pass over T positions continuing a state (ms, min of reps):
    transformers' chunked kernel (padded to 64), its one-token recurrent kernel run T times keeping every state (the
    per-position states of vLLM's scheme, by transformers' kernels), dspark's one unpadded chunk with every state
    formed, the same with only the final state (what dspark runs), and forming the state at a kept position."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                              torch_recurrent_gated_delta_rule)

    from dspark_cli.runtime.model.gdn_scoring import delta_rule_block

    for key_heads, heads, dim in ((2, 4, 32), (16, 32, 128)):
        print(f"\nGated DeltaNet kernels, {key_heads} q/k heads, {heads} value heads, head dim {dim}, ms, min of {reps}")
        print(f"  {'T':>2} {'chunked, pad 64':>16} {'recurrent x T, states':>22} {'1 chunk, all states':>20} "
              f"{'1 chunk (dspark)':>17} {'state at T-1':>13}")
        for length in (1, 2, 4, 8):
            generator = torch.Generator().manual_seed(0)
            query, key = (torch.randn(length, key_heads, dim, generator=generator) for _ in range(2))
            value = torch.randn(length, heads, dim, generator=generator)
            g, beta = -torch.rand(length, heads, generator=generator), torch.rand(length, heads, generator=generator)
            start = torch.randn(heads, dim, dim, generator=generator) * 0.1
            wide_q, wide_k = (x.repeat_interleave(heads // key_heads, dim=1)[None] for x in (query, key))

            def chunked() -> None:
                torch_chunk_gated_delta_rule(wide_q, wide_k, value[None], g=g[None], beta=beta[None],
                                             initial_state=start[None], output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)

            def recurrent() -> None:
                state, states = start[None], []
                for t in range(length):
                    _, state = torch_recurrent_gated_delta_rule(
                        wide_q[:, t : t + 1], wide_k[:, t : t + 1], value[None, t : t + 1], g=g[None, t : t + 1],
                        beta=beta[None, t : t + 1], initial_state=state, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
                    states.append(state)

            def every_state() -> None:
                block = delta_rule_block(query, key, value, g, beta, start)[1]
                [block.state_after(n) for n in range(1, length + 1)]

            def ours() -> None:
                delta_rule_block(query, key, value, g, beta, start)[1].state_after(length)

            block = delta_rule_block(query, key, value, g, beta, start)[1]
            figures = [timed(run, reps) * 1000 for run in (chunked, recurrent, every_state, ours,
                                                           lambda: block.state_after(max(length - 1, 1)))]
            print(f"  {length:>2} {figures[0]:>16.3f} {figures[1]:>22.3f} {figures[2]:>20.3f} {figures[3]:>17.3f} "
                  f"{figures[4]:>13.3f}")


@torch.inference_mode()
def rollback_schemes(target, encoded: list[int], block_size: int, reps: int) -> None:
    """Keeping 1, half and all of a scored block: dspark's copy of the kept position's state, the previous scheme
    (restore a snapshot, re-run the stateful mixers over the kept positions) and re-running the whole target."""
    ids, block = torch.tensor(encoded[:200]), torch.tensor(encoded[200 : 200 + block_size + 1])
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


def costs_only(args) -> None:
    """The costs that do not depend on the weights, on an untrained target of the same shape (about a minute)."""
    from transformers import AutoTokenizer

    from dspark_cli.runtime.model.target import TargetModel

    tokenizer = AutoTokenizer.from_pretrained(demo_pair()[0])
    target = TargetModel(qwen3_5_model(args.hidden, args.layers, len(tokenizer)), (args.layers // 2,))
    encoded = tokenizer(corpus_files(1, skip=24)[0].read_text(errors="replace")[:4000])["input_ids"]
    score_pass_costs(target, encoded, args.reps)
    rollback_schemes(target, encoded, args.block_size, args.reps)
    kernel_options(args.reps)


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
    parser.add_argument("--costs-only", action="store_true",
                        help="skip training and decoding: the kernel, score-pass and rollback costs on a random target")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.costs_only:
        costs_only(args)
        return
    files, held_out = corpus_files(24), corpus_files(args.prompts, skip=24)
    work = Path(tempfile.mkdtemp(prefix="bench_stateful_"))
    try:
        build_target(work / "target", args.hidden, args.layers, args.target_steps, files)
        train_draft(work / "target", work / "draft", args.draft_steps, files, args.block_size)
        pair = Pair.load(str(work / "target"), str(work / "draft"), device="cpu", dtype="float32")
        decoding(pair, prompts_from(held_out, args.prompts), args.max_new_tokens)
        encoded = pair.encode(held_out[0].read_text(errors="replace")[:4000])
        score_pass_costs(pair.target, encoded, args.reps)
        rollback_schemes(pair.target, encoded, pair.block_size, args.reps)
        kernel_options(args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
