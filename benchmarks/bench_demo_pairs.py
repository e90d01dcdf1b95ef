"""Benchmark the two shipped demo pairs side by side: speculative decoding against plain decoding and against
transformers' prompt lookup decoding, greedy, on one CPU thread, on prompts from held-out files.

    .venv/bin/python benchmarks/bench_demo_pairs.py                          # ~5 min on one idle CPU thread
    .venv/bin/python benchmarks/bench_demo_pairs.py --prompts 4 --new-tokens 64   # a quick look
    .venv/bin/python benchmarks/bench_demo_pairs.py --markdown build/demo-hybrid/speed.md   # also for the card

Pairs: "demo" (a Qwen3 target, attention only) and "demo-hybrid" (a Qwen3.5-style target, 3 Gated DeltaNet
layers to 1 attention layer), both from src/dspark_cli/runtime/assets/, same tokenizer. Prompts: --prompts windows
of --prompt-tokens tokens taken evenly from the held-out files of the demo build (standard-library files the
targets and drafts never saw; the model cards' evaluation prompts when the defaults are kept). Each prompt is
continued by --new-tokens tokens with no stop token, by four decoders, each warmed up once, timed by the wall
clock around the call (prefill included), all in one run:
  - dspark speculative (Pair.generate) and dspark plain (Pair.baseline): the speedup is their ratio;
  - transformers' generate, greedy, plain and with prompt lookup decoding (prompt_lookup_num_tokens =
    --lookup-tokens, n-grams of the prompt and output as the draft), on a separate copy of the target.
    transformers refuses assisted generation on stateful targets such as the hybrid's; the table says so.
Then, for the speculative decoder, τ and the mean milliseconds per round of each step (GenerationStats.sections:
draft, Markov, verify = score + accept, rollback = snapshot + restore + replay, other). Every output is compared
with dspark's plain decoding and a mismatch is printed loudly. --markdown PATH also writes the tables to PATH, where
`scripts/build_demo.py --pair demo-hybrid --card-only` puts them in the hybrid pair's model card (build/demo-hybrid/
speed.md is where it looks).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from dspark_cli.errors import DsparkError  # noqa: E402
from dspark_cli.runtime.demo import DEMO_PAIRS, demo_pair  # noqa: E402
from dspark_cli.runtime.io.outputs import atomic_write_text  # noqa: E402
from dspark_cli.runtime.measure.metrics import summarize  # noqa: E402
from dspark_cli.runtime.pair import Pair  # noqa: E402
from dspark_cli.runtime.train.data import TokenStream, split_held_out, stdlib_sources, tokenize_stream  # noqa: E402
from dspark_cli.runtime.train.demo_build import DemoRecipe, eval_prompts  # noqa: E402


@dataclass
class Timed:
    """One decoder over all prompts: new tokens, seconds, and its outputs (None: the decoder refused)."""

    tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] | None = None
    refused: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def held_out_prompts(tokenizer, count: int, length: int) -> list[torch.Tensor]:
    """`count` windows of `length` tokens taken evenly from the demo build's held-out files."""
    recipe = replace(DemoRecipe(), eval_prompts=count, eval_prompt_tokens=length)
    _, held = split_held_out(stdlib_sources(), recipe.held_out_every)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in held]
    stream = TokenStream(tokenize_stream(texts, tokenizer, tokenizer.eos_token_id))
    return eval_prompts(stream, recipe)


def timed(run, prompts: list[torch.Tensor]) -> Timed:
    """Call run(prompt) -> new token ids on each prompt, timing each call."""
    result = Timed(outputs=[])
    for prompt in prompts:
        started = time.perf_counter()
        tokens = run(prompt)
        result.seconds += time.perf_counter() - started
        result.tokens += len(tokens)
        result.outputs.append(tokens)
    return result


def hf_decoders(target: Path, new_tokens: int, lookup: int, prompts: list[torch.Tensor]) -> tuple[Timed, Timed]:
    """transformers' greedy generate on the target: plain, then with prompt lookup decoding."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    greedy = dict(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    configs = GenerationConfig(**greedy), GenerationConfig(**greedy, prompt_lookup_num_tokens=lookup)

    def run(prompt: torch.Tensor, config) -> list[int]:
        with torch.inference_mode():
            out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], generation_config=config)
        return out[0, prompt.shape[0]:].tolist()  # [1, P + N] -> the N new ids

    run(prompts[0], configs[0])  # warm-up
    plain = timed(lambda p: run(p, configs[0]), prompts)
    try:
        run(prompts[0], configs[1])
    except ValueError as error:  # transformers: "assisted generation is not supported with stateful models"
        return plain, Timed(refused=str(error).split(",")[0])
    return plain, timed(lambda p: run(p, configs[1]), prompts)


def bench_pair(name: str, args) -> dict | None:
    try:
        target, draft = demo_pair(name)
    except DsparkError as error:
        print(f"{name}: skipped ({error})")
        return None
    pair = Pair.load(target, draft, device="cpu", dtype="float32")
    prompts = held_out_prompts(pair.tokenizer, args.prompts, args.prompt_tokens)
    n = args.new_tokens
    pair.warm_up(prompts[0], max_new_tokens=n, baseline=True)
    spec_stats, plain_stats = [], []

    def speculative(prompt):
        result = pair.generate(prompt, max_new_tokens=n, stop_ids=())
        spec_stats.append(result.stats)
        return result.tokens

    def plain(prompt):
        result = pair.baseline(prompt, max_new_tokens=n, stop_ids=())
        plain_stats.append(result.stats)
        return result.tokens

    spec, base = timed(speculative, prompts), timed(plain, prompts)
    hf_plain, pld = hf_decoders(target, n, args.lookup_tokens, prompts)
    for label, other in (("speculative", spec), ("transformers plain", hf_plain), ("prompt lookup", pld)):
        if other.outputs is not None and other.outputs != base.outputs:
            print(f"!!! {name}: {label} output differs from dspark's plain decoding: NOT LOSSLESS")
    summary = summarize(spec_stats, plain_stats, pair.block_size)
    model = pair.target.model
    return {"name": name, "target": type(model).__name__, "layers": model.config.num_hidden_layers,
            "block": pair.block_size, "tau": summary.tau, "spec": spec, "plain": base, "hf_plain": hf_plain,
            "pld": pld, "breakdown": summary.round_breakdown, "rounds": summary.rounds}


def ratio(a: Timed, b: Timed) -> str:
    return f"{a.tokens_per_s / b.tokens_per_s:.2f}x" if a.seconds and b.seconds else "n/a"


def tokens_per_s(t: Timed) -> str:
    return f"{t.tokens_per_s:.0f}" if t.seconds else "n/a"


def report(rows: list[dict], args) -> str:
    """The run's figures as Markdown: the decoders' tokens/s and ratios, then the speculative rounds' breakdown."""
    lines = [f"Greedy, 1 torch thread, {args.prompts} held-out prompts of {args.prompt_tokens} tokens x "
             f"{args.new_tokens} new tokens; tokens/s by the wall clock, prefill included.", "",
             "| pair | target | τ | dspark plain tok/s | speculative tok/s | speculative / plain | transformers plain "
             "tok/s | prompt lookup tok/s | prompt lookup / transformers plain | speculative / prompt lookup |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['target']}, {r['layers']} layers | {r['tau']:.2f} | "
                     f"{tokens_per_s(r['plain'])} | {tokens_per_s(r['spec'])} | {ratio(r['spec'], r['plain'])} | "
                     f"{tokens_per_s(r['hf_plain'])} | {tokens_per_s(r['pld'])} | {ratio(r['pld'], r['hf_plain'])} | "
                     f"{ratio(r['spec'], r['pld'])} |")
    for r in rows:
        if r["pld"].refused:
            lines += ["", f"{r['name']}: prompt lookup decoding refused by transformers ({r['pld'].refused})."]
    lines += ["", "Speculative rounds, mean ms per round (share of the round):", "",
              "| pair | rounds | draft | Markov | verify | rollback | other | total |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["breakdown"]
        cells = [(b.draft_backbone_ms, b.draft_backbone_share), (b.markov_ms, b.markov_share),
                 (b.verify_ms, b.verify_share), (b.rollback_ms, b.rollback_share), (b.other_ms, b.other_share)]
        shown = " | ".join(f"{ms:.2f} ({share or 0:.0%})" for ms, share in cells)
        lines.append(f"| {r['name']} (block {r['block']}) | {r['rounds']} | {shown} | {b.total_ms:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12, help="held-out prompts per pair")
    parser.add_argument("--prompt-tokens", type=int, default=48, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens of transformers")
    parser.add_argument("--pairs", nargs="+", default=list(DEMO_PAIRS), choices=list(DEMO_PAIRS))
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = [row for name in args.pairs if (row := bench_pair(name, args)) is not None]
    if not rows:
        return
    text = report(rows, args)
    print(f"\n{text}\n(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"{time.perf_counter() - started:.0f} s)")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.markdown, text)


if __name__ == "__main__":
    main()
