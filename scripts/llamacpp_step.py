"""The demo and demo-large pairs in the real llama.cpp (b11434): the plain decode step, and what speculation gives.

Four llama-servers at once, each at --threads threads: for each pair (its GGUFs from scripts/llamacpp_server.py:
demo_gguf, large_gguf) the target alone and the target with the draft under dspark's flags. After one warm-up
request each, every demo prompt is sent as token ids (temperature 0, ignore_eos, n_predict) to each server in
turn, --repeats times over (interleaved: load from other processes falls on all four alike). A server's ms per
token is the median of timings.predicted_per_token_ms over its requests, the acceptance draft_n_accepted / draft_n
summed over them. Beside, what a verify pass costs: the plain server's prompt_ms for the first N + 1 tokens of each
prompt from an empty cache (N = dspark's --spec-draft-n-max), one forward over as many tokens as llama.cpp scores
per round. The demo-large pair is read from (or built in) --large, ~/.cache/dspark/demo-large by default
(scripts/build_demo.py --pair demo-large; docs/demo-large.md).

    python scripts/llamacpp_step.py [--prompts 8] [--n-predict 64] [--repeats 3] [--threads 1] [--large DIR]
                                    [--extra-layers K]

Prints a markdown table; exit code 0 when every run emitted the demo target's greedy tokens, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

from llamacpp_check import complete, demo_prompts
from llamacpp_server import LARGE_DIR, demo_gguf, dspark_spec_args, large_gguf, llama_server

KINDS = ("plain", "speculative")  # the target alone, the target with its draft


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n-predict", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="passes over the prompts")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--large", type=Path, default=LARGE_DIR, help="the demo-large pair's folder")
    parser.add_argument("--extra-layers", type=int, help="its inert layers (default: demo_large's)")
    args = parser.parse_args()
    from dspark_cli.runtime.demo import DEMO_DIR
    from dspark_cli.runtime.pair import load_tokenizer

    spec_args = dspark_spec_args()
    verify = int(spec_args[spec_args.index("--spec-draft-n-max") + 1]) + 1  # the tokens a verify pass scores: anchor + drafts
    tokenizer = load_tokenizer(str(DEMO_DIR / "target"))
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in demo_prompts(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        pairs = {"demo": demo_gguf(Path(tmp)), "demo-large": large_gguf(args.large, args.extra_layers)}
        sizes = {name: target.stat().st_size for name, (target, _) in pairs.items()}
        urls = {(name, kind): servers.enter_context(llama_server(target, draft if kind == "speculative" else None,
                                                                 threads=args.threads))
                for name, (target, draft) in pairs.items() for kind in KINDS}
        answers = {run: [] for run in urls}
        passes = {name: [] for name in pairs}  # ms of one forward over a verify block's tokens, from an empty cache
        for url in urls.values():
            complete(url, prompts[0], args.n_predict)  # warm-up: pages the weights in
        for _ in range(args.repeats):  # the runs interleaved, so that other load on the machine hits all alike
            for ids in prompts:
                for run, url in urls.items():
                    answers[run].append(complete(url, ids, args.n_predict))
                for name in pairs:
                    answer = complete(urls[name, "plain"], ids[:verify], 1)
                    passes[name].append(answer["timings"]["prompt_ms"])
    reference = [answer["tokens"] for answer in answers["demo", "plain"]]
    print(f"llama.cpp, {args.threads} thread(s), {len(prompts)} prompts x {args.n_predict} tokens x {args.repeats} "
          "(median of timings.predicted_per_token_ms)\n")
    print(f"| pair | target GGUF | plain ms/token | {verify}-token pass ms | speculative ms/token | speedup | "
          "acceptance | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    same = {run: [answer["tokens"] for answer in runs] == reference for run, runs in answers.items()}
    for name, size in sizes.items():
        plain, spec = (median_ms(answers[name, kind]) for kind in KINDS)
        timings = [answer["timings"] for answer in answers[name, "speculative"]]
        acceptance = sum(t["draft_n_accepted"] for t in timings) / sum(t["draft_n"] for t in timings)
        print(f"| {name} | {size / 1e6:.0f} MB | {plain:.2f} | {statistics.median(passes[name]):.2f} | {spec:.2f} | "
              f"{plain / spec:.2f}x | {acceptance:.3f} | "
              f"{'yes' if all(same[name, kind] for kind in KINDS) else 'NO'} |")
    return 0 if all(same.values()) else 1


def median_ms(answers: list[dict]) -> float:
    return statistics.median(answer["timings"]["predicted_per_token_ms"] for answer in answers)


if __name__ == "__main__":
    sys.exit(main())
