"""Benchmark the cost of `dspark eval`'s bookkeeping over plain speculative generation on the same prompts.

    .venv/bin/python benchmarks/bench_eval.py [--limit 8] [--max-new-tokens 128] [--repeats 3]

Both sides run the shipped demo pair (float32, CPU unless CUDA is there) on the same prompts of the two shipped
prompt sets with the same seeds (seed + prompt index) and DeepSpec's length rule, so they do identical decoding
work. "generate" is the bare loop (runtime.speculative.speculative_generate per prompt). "eval" is what
`dspark eval --json` adds around it: a PromptResult per prompt, the run file saved atomically after every prompt,
and the statistics (bootstrap intervals, calibration) at the end. Prints wall-clock seconds (best of --repeats),
the ratio eval / generate, and eval's own bookkeeping time (measured inside the eval loop, so other load on the
machine affects it less than the ratio of two separate loops).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from dspark_cli.runtime.measure import evaluation as ev  # noqa: E402
from dspark_cli.runtime.pair import Pair  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=8, help="prompts per shipped set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    pair = Pair.load(dtype="float32")  # the demo pair, on CUDA when there is one
    device = pair.device
    sets = [ev.read_prompt_set(path, args.limit) for path in ev.SHIPPED_SETS]

    settings = pair.checked.resolve(block_size=7, length_rule="deepspec")
    inside = [0.0]  # seconds spent in generate() itself during the eval loop

    def generate(prompt: str, seed: int):
        start = time.perf_counter()
        ids = pair.encode(prompt, chat=False)
        result = pair.generate(ids, max_new_tokens=args.max_new_tokens, settings=settings, seed=seed)
        inside[0] += time.perf_counter() - start
        return result

    def plain_loop() -> None:
        for prompt_set in sets:
            for index, prompt in enumerate(prompt_set.prompts):
                generate(prompt, index)

    def eval_loop(folder: Path) -> None:
        run = ev.EvalRun({"block_size": 7}, sets)
        path = folder / "run.json"
        for prompt_set in sets:
            ev.run_set(run, prompt_set, lambda i, text, name=prompt_set.name: ev.prompt_result(
                name, i, text, generate(text, i)), lambda _: run.save(path))
        rows = {s.name: ev.set_statistics(run.results_of(s), 7, args.max_new_tokens) for s in sets}
        rows["all"] = ev.set_statistics(run.results, 7, args.max_new_tokens)
        run.save(path, rows)

    generate(sets[0].prompts[0], 0)  # warm-up
    with tempfile.TemporaryDirectory() as tmp:
        timings = {"generate": [], "eval": [], "bookkeeping": []}
        for _ in range(args.repeats):
            for name, body in (("generate", plain_loop), ("eval", lambda: eval_loop(Path(tmp)))):
                inside[0] = 0.0
                start = time.perf_counter()
                body()
                timings[name].append(time.perf_counter() - start)
            timings["bookkeeping"].append(timings["eval"][-1] - inside[0])
    best = {name: min(values) for name, values in timings.items()}
    prompts = sum(len(s.prompts) for s in sets)
    print(f"demo pair, {device}, {prompts} prompts x {args.max_new_tokens} new tokens, best of {args.repeats}")
    print(f"  generate loop  {best['generate']:.2f} s")
    print(f"  eval (records, run file after each prompt, statistics)  {best['eval']:.2f} s")
    print(f"  eval / generate = {best['eval'] / best['generate']:.3f}  (both loops share a noisy machine)")
    print(f"  eval's own bookkeeping (eval time outside generate)  {best['bookkeeping']:.3f} s = "
          f"{best['bookkeeping'] / best['generate']:.3f} of the generate loop")


if __name__ == "__main__":
    main()
