"""Benchmark speculative generation: τ (incl. bonus), tokens/s and speedup over plain decoding, per block size.

    .venv/bin/python benchmarks/bench_generate.py                        # the demo pair, else a fixture pair
    .venv/bin/python benchmarks/bench_generate.py --target T --draft D --block-sizes 1,4,7 --temperature 1

Both decoders run on the same prompts in the same process, after one warm-up run each; the baseline is the
same target decoding one token per forward (runtime.speculative.autoregressive_generate). Without the demo
pair (scripts/build_demo.py) the pair is the bigram fixture of tests/fixtures/pair_factory.py: a tiny random Qwen3
target whose next token depends mostly on the current one, and a DSpark draft whose Markov head holds that
bigram (so τ is high by construction, and the figures measure the loop's overheads, not a trained draft).
Prompts: held-out-style text for a pair with a tokenizer, random token ids otherwise.

Per thread count (--threads, default 1 and 2; torch.set_num_threads) it prints three tables:
  - round costs: one target decode step, one verify of block+1 tokens and one draft block (backbone + Markov), each
    on a ~300-token cache, timed interleaved (step, verify, draft, step, ...), min and median in ms and as
    multiples of a decode step: a round costs about verify + draft, and pays off when τ exceeds that sum;
  - peers, on the same prompts, greedy, each method interleaved prompt by prompt: plain decoding (dspark's loop
    and transformers' `generate`), dspark speculative decoding at the trained block size, transformers'
    prompt-lookup decoding (`generate(prompt_lookup_num_tokens=7)`) and transformers' assisted generation with
    a 1-layer cut of the target as assistant (its embedding, first layer, norm and head copied: an UNTRAINED cut,
    the cheapest assistant one can get for free). Tokens/s over all prompts and the ratio to dspark's plain
    loop; every output is compared with plain greedy decoding and a mismatch is printed loudly;
  - the block-size table (τ, tokens/s, speedup, ms per round part) as before (--no-blocks skips it).
"""

from __future__ import annotations

import argparse
import copy
import os
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

from dspark_cli.errors import DsparkError  # noqa: E402
from dspark_cli.runtime.demo import DEMO_PROMPTS, demo_pair  # noqa: E402
from dspark_cli.runtime.model.draft import DraftContext  # noqa: E402
from dspark_cli.runtime.measure.metrics import summarize  # noqa: E402
from dspark_cli.runtime.pair import Pair  # noqa: E402
from dspark_cli.runtime.settings import MarkovHead, SamplingParams, resolve_markov  # noqa: E402
from dspark_cli.runtime.decode.speculative import Drafter, draft_block  # noqa: E402

TEXT_PROMPTS = [
    *DEMO_PROMPTS,
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    \"\"\"A last-in first-out container.\"\"\"\n\n    def __init__(self):\n",
    "The quick brown fox",
]


def fixture_pair(root: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(REPO / "tests" / "fixtures"))
    from ckpt_factory import DraftSpec
    from pair_factory import bigram_draft, bigram_target, write_byte_tokenizer

    spec = DraftSpec(block_size=8, markov_rank=64)
    target = bigram_target(root / "target", spec)
    write_byte_tokenizer(target)
    return target, bigram_draft(root / "draft", spec, target)


def prompts_for(target_dir: Path, vocab: int, count: int) -> tuple[list[list[int]], str]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        prompts = [tokenizer(text)["input_ids"] for text in (TEXT_PROMPTS * count)[:count]]
    except (OSError, ValueError, TypeError):
        prompts = []
    if prompts and all(prompts):
        return prompts, "text"
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab, (16,), generator=generator).tolist() for _ in range(count)], "random-id"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--block-sizes", default=None, help="comma-separated (default: 1, 2, 4 and the trained)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--markov", default="auto")
    parser.add_argument("--draft-topk", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts, one set of tables each")
    parser.add_argument("--no-blocks", action="store_true", help="skip the block-size table")
    parser.add_argument("--cost-reps", type=int, default=30, help="repetitions of each round-cost measurement")
    parser.add_argument("--peer-rounds", type=int, default=1, help="passes over the prompts in the peer table")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.target and args.draft:
            target_dir, draft_dir, label = Path(args.target), Path(args.draft), "given pair"
        else:
            try:
                (target_dir, draft_dir), label = demo_pair(), "demo pair"
            except DsparkError:
                (target_dir, draft_dir), label = fixture_pair(Path(tmp)), "bigram fixture pair (demo not built)"
        run(args, target_dir, draft_dir, label)


def run(args, target_dir: Path, draft_dir: Path, label: str) -> None:
    pair = Pair.load(target_dir, draft_dir, device=args.device, dtype=args.dtype or "auto", markov=args.markov,
                     draft_topk=args.draft_topk)
    target, draft, device, dtype = pair.target, pair.draft, pair.device, pair.checked.dtype
    trained = pair.settings.trained_block_size or 7
    block_sizes = [int(b) for b in args.block_sizes.split(",")] if args.block_sizes else sorted({1, 2, 4, trained})
    prompts, prompt_kind = prompts_for(target_dir, target.vocab_size, args.prompts)
    params = SamplingParams(temperature=args.temperature)
    stop_ids: list[int] = []  # fixed lengths: every run decodes exactly max_new_tokens per prompt
    settings = {b: pair.checked.resolve(block_size=b, temperature=args.temperature) for b in block_sizes}

    def speculative(prompt, block_size, tokens):
        return pair.generate(prompt, settings=settings[block_size], max_new_tokens=tokens, stop_ids=stop_ids)

    def baseline(prompt, tokens):
        return pair.baseline(prompt, settings=settings[block_sizes[-1]], max_new_tokens=tokens, stop_ids=stop_ids)

    thread_counts = [int(t) for t in args.threads.split(",")]
    speculative(prompts[0], block_sizes[-1], 16), baseline(prompts[0], 16)  # warm-up
    print(f"pair: {label}\n  target {target_dir}\n  draft  {draft_dir}")
    print(f"device {device}, {str(dtype).removeprefix('torch.')}, {args.prompts} {prompt_kind} prompts x "
          f"{args.max_new_tokens} new tokens, T={args.temperature}, markov {args.markov}, threads {args.threads} "
          f"(of {os.cpu_count()} CPUs, interleaved), target {parameters(target.model):,} parameters, "
          f"draft {parameters(draft):,}; load average {os.getloadavg()[0]:.1f}")
    round_costs(target, draft, prompts[0], trained, params, args, thread_counts)
    if params.greedy:
        peers(target, {"plain (dspark loop)": lambda p: baseline(p, args.max_new_tokens).tokens,
                       f"dspark speculative (block {trained})": lambda p: speculative(p, trained,
                                                                                    args.max_new_tokens).tokens},
              prompts, args.max_new_tokens, thread_counts, args.peer_rounds)
    if args.no_blocks:
        return
    torch.set_num_threads(thread_counts[0])
    print(f"block sizes, {thread_counts[0]} thread(s):")
    baseline_stats = [baseline(p, args.max_new_tokens).stats for p in prompts]
    header = (f"{'block':>5} {'tau':>6} {'tok/s':>8} {'base tok/s':>10} {'speedup':>8} {'backbone':>9} "
              f"{'markov':>8} {'verify':>8} {'rollback':>8} {'other':>8}  (ms per round)")
    print(header)
    for block_size in block_sizes:
        stats = [speculative(p, block_size, args.max_new_tokens).stats for p in prompts]
        s = summarize(stats, baseline_stats, block_size)
        b = s.round_breakdown
        print(f"{block_size:>5} {s.tau:>6.2f} {s.tokens_per_s:>8.1f} {s.baseline.tokens_per_s:>10.1f} "
              f"{s.baseline.speedup:>7.2f}x {b.draft_backbone_ms:>9.2f} {b.markov_ms:>8.2f} {b.verify_ms:>8.2f} "
              f"{b.rollback_ms:>8.2f} {b.other_ms:>8.2f}")


# --- round costs and peers ----------------------------------------------------------------------------------------


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def rotated(items: list, round_number: int) -> list:
    """`items` starting at position round_number (mod len): rotating the start each round interleaves them fairly."""
    start = round_number % len(items)
    return items[start:] + items[:start]


def interleaved_ms(calls: dict[tuple[str, int], callable], reps: int) -> dict[tuple[str, int], list[float]]:
    """Each (name, threads) call `reps` times in rotated rounds, torch set to its thread count before each call,
    after one warm-up round: samples in ms."""
    keys = list(calls)
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    for round_number in range(reps + 1):
        for key in rotated(keys, round_number):
            torch.set_num_threads(key[1])
            started = time.perf_counter()
            calls[key]()
            if round_number:  # round 0 warms up
                samples[key].append((time.perf_counter() - started) * 1e3)
    return samples


def round_costs(
    target, draft, prompt: list[int], block: int, params, args, thread_counts: list[int], context_length: int = 300
) -> None:
    """One decode step, one verify of block+1 tokens and one draft block, on a ~300-token cache, interleaved
    over the parts and the thread counts."""
    prompt_ids = torch.tensor((prompt * (context_length // len(prompt) + 1))[:context_length], device=target.device)
    _, features = target.prefill(prompt_ids)  # [P, V], [P, n*Ht]
    context = DraftContext(draft, context_length + block + 2)
    context.append(draft, features)
    resolved = resolve_markov(args.markov, MarkovHead.of_config(draft.config, draft.w2_nvfp4 is not None),
                              args.draft_topk, params, False)
    drafter = Drafter(draft, resolved, params, target.vocab_size, args.draft_topk)
    block_ids = prompt_ids[: block + 1]

    def step():
        target.decode_one(int(prompt_ids[0]))
        target.crop(context_length)

    def verify():
        target.score(block_ids)
        target.crop(context_length)

    def draft_round():
        draft_block(drafter, context, int(prompt_ids[-1]), block, None)

    parts = {"decode step": step, f"verify {block + 1} tokens": verify, f"draft block ({block})": draft_round}
    calls = {(name, threads): call for threads in thread_counts for name, call in parts.items()}
    samples = interleaved_ms(calls, args.cost_reps)
    print(f"\nround costs, cache {context_length} tokens, {args.cost_reps} interleaved reps (strategy {resolved}):")
    print(f"  {'':<22} {'threads':>7} {'min ms':>8} {'median ms':>10} {'x step (min)':>13} {'x step (median)':>16}"
          f" {'median vs 1st threads':>22}")
    for (name, threads), times in samples.items():
        step = samples[("decode step", threads)]
        low, mid = min(times), statistics.median(times)
        first = statistics.median(samples[(name, thread_counts[0])])
        print(f"  {name:<22} {threads:>7} {low:>8.3f} {mid:>10.3f} {low / min(step):>13.2f} "
              f"{mid / statistics.median(step):>16.2f} {mid / first:>21.2f}x")


def one_layer_cut(model: torch.nn.Module) -> torch.nn.Module:
    """An untrained assistant: the target's architecture with 1 layer, its embedding, first layer, norm and head."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    cut = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    missing, unexpected = cut.load_state_dict(model.state_dict(), strict=False)
    assert not missing, f"the 1-layer cut lacks {missing}"  # the unexpected ones are layers 1.. of the target
    return cut.to(model.device).eval()


def hf_generate(model: torch.nn.Module, max_new_tokens: int, **extra):
    """Greedy `model.generate` for exactly max_new_tokens (no EOS stop, like the dspark runs) -> ids after the prompt."""
    from transformers import GenerationConfig

    model_args = {key: extra.pop(key) for key in ("assistant_model",) if key in extra}
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                              **extra)

    def generate(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt], device=model.device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **model_args)
        return out[0, len(prompt):].tolist()

    return generate


def peers(
    target, ours: dict[str, callable], prompts: list[list[int]], max_new_tokens: int, thread_counts: list[int],
    rounds: int,
) -> None:
    """Tokens/s of every method and thread count on the same prompts ((method, threads) pairs rotated per prompt),
    `rounds` passes over the prompts (median and best pass reported), outputs checked against plain greedy decoding."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # assisted generation's own deprecation notice, not ours to fix
    model = target.model
    methods = dict(ours)
    methods["transformers plain generate"] = hf_generate(model, max_new_tokens)
    methods["transformers prompt lookup (7)"] = hf_generate(model, max_new_tokens, prompt_lookup_num_tokens=7)
    methods["transformers assisted, 1-layer cut (untrained)"] = hf_generate(model, max_new_tokens,
                                                                            assistant_model=one_layer_cut(model))
    keys = [(name, threads) for threads in thread_counts for name in methods]
    for name, threads in keys:
        torch.set_num_threads(threads)
        methods[name](prompts[0][:8])  # warm-up
    passes: dict[tuple[str, int], list[float]] = {key: [0.0] * rounds for key in keys}  # seconds per pass
    fastest: dict[tuple[str, int], list[float]] = {key: [float("inf")] * len(prompts) for key in keys}  # per prompt
    outputs: dict[tuple[str, int], list[list[int]]] = {key: [] for key in keys}
    for number in range(rounds * len(prompts)):
        for key in rotated(keys, number):
            torch.set_num_threads(key[1])
            started = time.perf_counter()
            output = methods[key[0]](prompts[number % len(prompts)])[:max_new_tokens]
            elapsed = time.perf_counter() - started
            passes[key][number // len(prompts)] += elapsed
            fastest[key][number % len(prompts)] = min(fastest[key][number % len(prompts)], elapsed)
            if number < len(prompts):
                outputs[key].append(output)
    seconds = {key: statistics.median(times) for key, times in passes.items()}
    plain, hf_plain = list(methods)[:3:2]  # dspark's plain loop, transformers' plain generate
    reference = outputs[(plain, thread_counts[0])]
    tokens = sum(len(out) for out in reference)
    print(f"\npeers: {len(prompts)} prompts x {max_new_tokens} new tokens, greedy, (method, threads) rotated per "
          f"prompt, {rounds} pass(es); tok/s of the median pass, and 'best' from each prompt's fastest pass; ratios "
          f"against the plain rows of the same thread count, of medians and (in brackets) of bests")
    print(f"  {'method':<48} {'threads':>7} {'tok/s':>8} {'best':>8} {'vs plain':>16} {'vs HF plain':>16}  output")
    for name, threads in keys:
        same = outputs[(name, threads)] == reference
        verdict = "identical to plain" if same else "!!! MISMATCH: differs from plain greedy decoding !!!"
        mine = seconds[(name, threads)]
        best = sum(fastest[(name, threads)])
        plain_best, hf_best = sum(fastest[(plain, threads)]), sum(fastest[(hf_plain, threads)])
        print(f"  {name:<48} {threads:>7} {tokens / mine:>8.1f} {tokens / best:>8.1f} "
              f"{seconds[(plain, threads)] / mine:>6.2f}x ({plain_best / best:.2f}x) "
              f"{seconds[(hf_plain, threads)] / mine:>6.2f}x ({hf_best / best:.2f}x)  {verdict}")


if __name__ == "__main__":
    main()
