"""Does speculation pay in llama.cpp on this CPU? `dspark plan`'s verdict against llama-server measured.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speculation_pays.py [--pairs demo,demo-large] [--repeats 3]
        [--concurrency 1,2,4] [--contexts 32,512] [--prompts 8] [--max-tokens 64] [--out DIR]

For each pair (the shipped demo pair, whose target fits in the CPU's cache, and demo-large, the same function with
inert layers that make it memory-bound: docs/demo-large.md), with llama.cpp b11434 (scripts/build_llamacpp.sh), every
llama-server with one thread (-t 1) and as many slots as the largest concurrency:

1. Prompt sets, one per context: `short` (the demo's eval prompts, code and prose alternating) and `long` (eval
   prompts concatenated to about the long context in tokens), DIR/prompts_<ctx>.jsonl.
2. `dspark eval` on both sets (greedy, CPU, the pair's folders): the rounds plan reads acceptance from, by context.
3. The GGUF files with `dspark convert`'s library half; a plain server and speculative servers drafting 7 and 1
   tokens; `dspark bench engine` on them (DIR/<pair>/profile.json).
4. `dspark plan run.json --costs profile.json --json plan.json`: a verdict and n per (context, concurrency).
5. Measured: per (context, concurrency), the plain server, the n = 7 server and one server per other n plan chose,
   REPEATS interleaved passes (the servers' order rotated each pass), each level the prompt set through
   `dspark bench serve`'s client at that concurrency. Speedup of a server = its decode tokens/s over the plain
   server's in the same pass (decode tokens/s: C × the mean over requests of (tokens - 1) / (latency - TTFT), the
   steady state plan predicts; the wall throughput, prefill included, is printed beside it).

Prints per pair and configuration: plan's verdict, n and predicted speedup [interval] (also its prediction for
n = 7), the measured speedups (median and range over passes) of n = 7 and of plan's n, the measured-best n, and
whether plan's sign and n agree with the measurement. Writes everything to DIR (default: a temporary folder).
Nothing is asserted; figures vary with the machine's load (ratios are taken within one pass). Files already in DIR
are reused (run.json, profile.json, measured.json): plan is run again and judged against the passes measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "scripts")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from llamacpp_server import LARGE_DIR, available, llama_server, pair_gguf  # noqa: E402


def dspark(*args: str) -> None:
    command = [sys.executable, "-c", "from dspark_cli.cli import main; main()", *args]
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    if run.returncode != 0:
        sys.exit(f"dspark {' '.join(args)} failed ({run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    print(run.stdout[-6000:] if args[0] in ("plan", "bench") else "", end="", flush=True)


def pair_folders(name: str, large_dir: Path) -> tuple[Path, Path]:
    from dspark_cli.runtime.demo import DEMO_DIR

    if name == "demo":
        return DEMO_DIR / "target", DEMO_DIR / "draft"
    if (large_dir / "target" / "config.json").is_file():
        return large_dir / "target", large_dir / "draft"
    from dspark_cli.runtime.train.demo_large import build_large_pair

    build_large_pair(large_dir)
    return large_dir / "target", large_dir / "draft"


def write_prompt_sets(out: Path, count: int, contexts: list[int]) -> dict[int, Path]:
    """One prompt set per context: the eval prompts for the shortest, concatenations of about c tokens for the
    others (the demo tokenizer counts)."""
    from tokenizers import Tokenizer

    from dspark_cli.runtime.demo import DEMO_DIR

    tokenizer = Tokenizer.from_file(str(DEMO_DIR / "target" / "tokenizer.json"))
    sets = [[json.loads(line)["turns"][0] for line in (DEMO_DIR / name).read_text().splitlines() if line.strip()]
            for name in ("eval_code.jsonl", "eval_prose.jsonl")]
    pool = [p for pair in zip(*sets) for p in pair]
    files = {}
    for rank, context in enumerate(sorted(contexts)):
        prompts = []
        for i in range(count):
            if rank == 0:
                prompts.append(pool[i % len(pool)])
                continue
            text, j = "", i * 7
            while len(tokenizer.encode(text).ids) < context:
                text += pool[j % len(pool)] + "\n\n"
                j += 1
            ids = tokenizer.encode(text).ids[:context]
            prompts.append(tokenizer.decode(ids))
        path = out / f"prompts_{context}.jsonl"
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        files[context] = path
    return files


def decode_rate(level) -> float | None:
    """C × mean over requests of (tokens - 1) / (latency - TTFT): the level's steady decode tokens/s."""
    rates = [(r.tokens - 1) / (r.latency_s - r.ttft_s) for r in level.done
             if r.ttft_s is not None and r.tokens > 1 and r.latency_s > r.ttft_s]
    return level.concurrency * statistics.fmean(rates) if rates else None


def measure_pair(name: str, out: Path, args, contexts: list[int], concurrencies: list[int]) -> list[dict]:
    from dspark_cli.runtime.bench.serve import Level, ServeConfig, probe, run_level, warm_up

    work = out / name
    work.mkdir(parents=True, exist_ok=True)
    target_dir, draft_dir = pair_folders(name, args.large_dir)
    prompt_files = write_prompt_sets(work, args.prompts, contexts)
    run = work / "run.json"
    if not run.is_file():
        data = [a for c in contexts for a in ("--data", str(prompt_files[c]))]
        dspark("eval", "--target", str(target_dir), "--draft", str(draft_dir), *data, "--no-chat",
               "--max-new-tokens", str(args.max_tokens), "--device", "cpu", "--json", str(run))
    target, draft = pair_gguf(target_dir, draft_dir, work / "gguf")
    slots, slot_context = max(concurrencies), max(contexts) + args.max_tokens + 64
    common = dict(slots=slots, slot_context=slot_context)
    profile, plan = work / "profile.json", work / "plan.json"
    if not profile.is_file():
        with ExitStack() as stack:
            plain = stack.enter_context(llama_server(target, **common))
            spec = {n: stack.enter_context(llama_server(target, draft, extra=["--spec-draft-n-max", str(n)],
                                                        **common)) for n in (7, 1)}
            dspark("bench", "engine", plain, *[a for n, url in spec.items() for a in ("--spec", f"{n}={url}")],
                   "--draft-file", str(draft), "--target-file", str(target), "--concurrency",
                   ",".join(map(str, concurrencies)), "--context", ",".join(map(str, contexts)), "--repeats",
                   str(args.profile_repeats), "--engine-version", "b11434 (scripts/build_llamacpp.sh)", "--json",
                   str(profile))
    dspark("plan", str(run), "--costs", str(profile), "--json", str(plan), "--force")
    verdicts = {(v["context"], v["concurrency"]): v for v in json.loads(plan.read_text())["verdicts"]}
    saved = work / "measured.json"
    if saved.is_file():  # measured before: plan's verdicts against those passes
        measured = {(e["context"], e["concurrency"], (e["n"], e["p_min"])): [tuple(x) for x in
                    e["decode_and_wall_tokens_per_s"]] for e in json.loads(saved.read_text())}
        variants = sorted({key for _, _, key in measured}, key=lambda k: (k[0], k[1] or 0))
        missing = {(v["n"], v["threshold"]) for v in verdicts.values() if v["n"]} - set(variants)
        if missing:
            sys.exit(f"{saved} lacks plan's choices {sorted(missing)}: remove it to measure again.")
        return [compare(name, context, c, v, measured, variants, args.repeats) for (context, c), v in
                sorted(verdicts.items())]
    variants = [(n, None) for n in range(0, args.max_n + 1)]  # plain, then every fixed draft length
    variants += sorted({(v["n"], v["threshold"]) for v in verdicts.values() if v["threshold"] is not None and v["n"]})
    serve_prompts = {c: [json.loads(line)["prompt"] for line in prompt_files[c].read_text().splitlines()]
                     [:args.serve_prompts] for c in contexts}
    measured: dict[tuple, list[tuple[float | None, float | None]]] = {}
    with ExitStack() as stack:
        urls = {}
        for n, x in variants:
            extra = [] if n == 0 else ["--spec-draft-n-max", str(n)] + ([] if x is None else
                                                                         ["--spec-draft-p-min", str(x)])
            urls[n, x] = stack.enter_context(llama_server(target, None if n == 0 else draft, extra=extra, **common))
        servers = {key: probe(url, "baseline" if key[0] == 0 else "speculative", "llamacpp", None)
                   for key, url in urls.items()}
        for server in servers.values():
            warm_up(server, "def main():", 120.0)
        for repeat in range(args.repeats):
            for context in contexts:
                for c in concurrencies:
                    order = variants[repeat % len(variants):] + variants[:repeat % len(variants)]
                    for key in order:
                        config = ServeConfig(url=urls[key], prompts=serve_prompts[context], concurrencies=(c,),
                                             max_tokens=args.max_tokens, timeout_s=600.0, engine="llamacpp")
                        level = Level(servers[key].role, "llamacpp", c)
                        run_level(servers[key], serve_prompts[context], config, level)
                        measured.setdefault((context, c, key), []).append((decode_rate(level), level.throughput))
                    print(f"{name} pass {repeat + 1}/{args.repeats} context {context} C={c}: " + ", ".join(
                        f"{label(key)} {measured[context, c, key][-1][0]:.0f}" for key in variants) + " tok/s",
                        flush=True)
    saved.write_text(json.dumps([{"context": k[0], "concurrency": k[1], "n": k[2][0],
                                                     "p_min": k[2][1], "decode_and_wall_tokens_per_s": v}
                                                    for k, v in measured.items()], indent=1))
    return [compare(name, context, c, v, measured, variants, args.repeats) for (context, c), v in
            sorted(verdicts.items())]


def label(key: tuple) -> str:
    n, x = key
    return f"n={n}" + ("" if x is None else f"@{x:g}")


def compare(name: str, context: int, c: int, verdict: dict, measured: dict, variants: list, repeats: int) -> dict:
    """Plan's verdict against the passes: each variant's decode speedup over plain decoding within each pass, the
    median and range; the measured-best fixed n; whether plan's sign (for n = 7 and for its choice) and n agree."""
    def speedups(key: tuple, index: int) -> list[float]:
        return [measured[context, c, key][i][index] / measured[context, c, (0, None)][i][index]
                for i in range(repeats)]

    decode = {key: speedups(key, 0) for key in variants if key[0]}
    wall = {key: speedups(key, 1) for key in variants if key[0]}
    fixed = {0: [1.0] * repeats, **{n: decode[n, x] for n, x in decode if x is None}}
    best_n = max(fixed, key=lambda n: statistics.median(fixed[n]))
    chosen = (verdict["n"], verdict["threshold"] if verdict["n"] else None)
    chosen_measured = fixed[0] if chosen[0] == 0 else decode[chosen]
    predictions = {(p["n"], p["threshold"]): p for p in verdict["predictions"]}
    seven = predictions.get((7, None))

    def sign(low: float, high: float) -> str:
        return "gain" if low > 1 else "loss" if high < 1 else "undecided"

    best = verdict["best"]
    return {"pair": name, "context": context, "concurrency": c, "verdict": verdict["verdict"],
            "plan_n": verdict["n"], "plan_threshold": verdict["threshold"],
            "plan_best": None if best is None else best["label"],
            "plan_speedup": None if best is None else best["speedup"],
            "plan_interval": None if best is None else best["speedup_interval"],
            "plan_speedup_n7": None if seven is None else seven["speedup"],
            "plan_interval_n7": None if seven is None else seven["speedup_interval"],
            "measured_fixed": {str(n): v for n, v in fixed.items()}, "measured_n7_wall": wall[7, None],
            "measured_plan_choice": chosen_measured, "measured_best_n": best_n,
            "sign_plan_n7": None if seven is None else sign(*seven["speedup_interval"]),
            "sign_measured_n7": sign(min(fixed[7]), max(fixed[7])),
            "sign_plan_choice": None if best is None else sign(*best["speedup_interval"]),
            "sign_measured_choice": sign(min(chosen_measured), max(chosen_measured)),
            # within noise: plan's choice reached, in some pass, the best n's lowest pass
            "n_within_noise": max(chosen_measured) >= min(fixed[best_n])}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="demo,demo-large")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved measurement passes")
    parser.add_argument("--profile-repeats", type=int, default=5, help="bench engine's repeats")
    parser.add_argument("--concurrency", default="1,2,4")
    parser.add_argument("--max-n", type=int, default=7, help="fixed draft lengths measured: 1..MAX_N")
    parser.add_argument("--contexts", default="32,512")
    parser.add_argument("--prompts", type=int, default=12, help="prompts per context evaluated by dspark eval")
    parser.add_argument("--serve-prompts", type=int, default=4, help="of them, sent per level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--large-dir", type=Path, default=LARGE_DIR, help="the demo-large pair's folder (built "
                        "there when absent)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not available():
        sys.exit("no llama.cpp build: run scripts/build_llamacpp.sh first.")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        rows = [row for name in args.pairs.split(",") for row in measure_pair(name, out, args, contexts,
                                                                                 concurrencies)]
        (out / "comparison.json").write_text(json.dumps(rows, indent=1))
    print(f"\nload average {os.getloadavg()[0]:.1f} (2 cores shared); decode speedups over plain decoding, median "
          f"(range) of {args.repeats} interleaved passes")
    print("| pair | context | C | plan verdict | plan's choice | plan speedup [interval] | plan n = 7 [interval] | "
          "measured plan's choice | measured n = 7 | measured n = 7, wall | measured best n (its speedup) | "
          "sign n = 7 plan / measured | n within noise |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        interval = r["plan_interval"] or [0, 0]
        interval7 = r["plan_interval_n7"] or [0, 0]
        choice = str(r["plan_n"]) + ("" if r["plan_threshold"] is None or not r["plan_n"] else
                                     f" (p-min {r['plan_threshold']:g})")
        best = r["measured_best_n"]
        print(f"| {r['pair']} | {r['context']} | {r['concurrency']} | {r['verdict']} | {choice} | "
              f"{(r['plan_speedup'] or 0):.2f} [{interval[0]:.2f}, {interval[1]:.2f}] | "
              f"{(r['plan_speedup_n7'] or 0):.2f} [{interval7[0]:.2f}, {interval7[1]:.2f}] | "
              f"{spread(r['measured_plan_choice'])} | {spread(r['measured_fixed']['7'])} | "
              f"{spread(r['measured_n7_wall'])} | {best} ({spread(r['measured_fixed'][str(best)])}) | "
              f"{r['sign_plan_n7']} / {r['sign_measured_n7']} | {'yes' if r['n_within_noise'] else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
