"""`dspark plan --concurrency`'s prediction against a real llama.cpp server measured with `dspark bench serve`.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/llamacpp_serve_vs_plan.py [--prompts 8] [--max-tokens 64]
        [--concurrency 1,2,4] [--out DIR]

On this machine, with the llama.cpp b11434 build (scripts/build_llamacpp.sh) and the demo pair as GGUF
(scripts/llamacpp_server.py), every llama-server with one thread (-t 1) and 4 slots (-np 4):

1. Prompts: the first N of the demo's eval sets, code and prose alternating (prompts.jsonl), the same text for
   every step below.
2. The eval run: `dspark eval --data prompts.jsonl --no-chat --max-new-tokens N --json run.json` (greedy, CPU).
3. llama.cpp's cost table (llamacpp_costs.json, dspark's batch-table format, labelled as derived from llama.cpp's
   own timings): on the plain target server, θ(M) = the fastest of 11 `timings.prompt_ms` of a fresh M-token
   prompt (no cache: one llama_decode over M tokens, as a verify pass scores them; at context 0, which for the
   demo's 8 layers of width 256 and contexts under 200 tokens changes little), M = R·t for t = 1..block + 1; and
   the decode step at R requests, D(R) = the fastest of 11 medians of `timings.predicted_per_token_ms` of R
   concurrent requests generating 48 tokens each (one llama_decode of R tokens per step); all points sampled in
   rotated rounds, so a change of load hits them alike. A step of R requests
   scoring t tokens each costs θ(R·t) + max(0, D(R) - θ(R)): the tokens' cost plus what R sequences cost beyond
   one sequence of R tokens. (A prompt after a cached prefix, `cache_prompt`, measured 2-4x slower at M = 1 than
   a fresh one: the server's prompt-cache bookkeeping, not the forward.)
4. The prediction: `dspark plan run.json --concurrency C --costs llamacpp_costs.json --scheduler fixed-k`, the row
   "fixed k = block" (llama.cpp verifies every drafted token, `--spec-draft-n-max` = block); the baseline at C is
   C tokens per step of D(C). Also the same replay with each round's draft time set to llama.cpp's own (the
   measured time per round at C = 1 minus θ(block + 1)), to separate the draft-time estimate from the rest.
5. The measurement: `dspark bench serve SPEC --baseline PLAIN --prompts prompts.jsonl --concurrency C
   --max-tokens N --json serveI.json` (SPEC started with `--metrics`), --repeats times: the measured speedup is
   the median of the runs' own speedups (each run measures both servers back to back); tokens/s, τ and acceptance
   are those of the fastest run per server and concurrency.

Prints one table (predicted and measured tokens/s and speedup per concurrency, acceptance of both) and writes
every file to --out (default: a temporary folder, removed). Ratios come from the same run; nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "scripts")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from llamacpp_server import available, demo_gguf, llama_server  # noqa: E402

REPS = 11  # the fastest repetition: the figure least disturbed by other load on a shared machine


def dspark(*args: str) -> None:
    command = [sys.executable, "-c", "from dspark_cli.cli import main; main()", *args]
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    if run.returncode != 0:
        sys.exit(f"dspark {' '.join(args)} failed ({run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")


def write_prompts(path: Path, count: int) -> None:
    from dspark_cli.runtime.demo import DEMO_DIR

    sets = [[json.loads(line)["turns"][0] for line in (DEMO_DIR / name).read_text().splitlines() if line.strip()]
            for name in ("eval_code.jsonl", "eval_prose.jsonl")]
    prompts = [sets[i % 2][i // 2] for i in range(count)]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def theta_sample(url: str, tokens: int, rep: int) -> float:
    """prompt_ms of a fresh prompt of `tokens` tokens (no cache: one llama_decode over them)."""
    prompt = [100 + (rep * 37 + i) % 900 for i in range(tokens)]
    timings = post(url, {"prompt": prompt, "n_predict": 1, "cache_prompt": False, "temperature": 0})["timings"]
    assert timings["prompt_n"] == tokens and timings["cache_n"] == 0, timings
    return timings["prompt_ms"]


def decode_sample(url: str, requests: int, rep: int, generate: int = 48) -> float:
    """The median predicted_per_token_ms of `requests` concurrent requests generating `generate` tokens each (one
    llama_decode of `requests` tokens per step)."""
    results = [0.0] * requests

    def one(i: int) -> None:
        results[i] = post(url, {"prompt": [7 + rep % 50, 11 + i, 13], "n_predict": generate, "ignore_eos": True,
                                "temperature": 0, "cache_prompt": False})["timings"]["predicted_per_token_ms"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statistics.median(results)


def cost_table(url: str, block: int, concurrencies: list[int]) -> tuple[dict, dict[int, float], dict[int, float]]:
    """(table in dspark-verify-costs/2 form, θ by tokens, D by requests) from the plain server's own timings, every
    point sampled REPS times in rotated rounds (a load change hits all alike) and its fastest sample kept."""
    tokens = list(range(1, block + 2))
    jobs = [("theta", m) for m in sorted({r * t for r in concurrencies for t in tokens})]
    jobs += [("decode", r) for r in concurrencies]
    samples: dict[tuple[str, int], list[float]] = {job: [] for job in jobs}
    for rep in range(REPS):
        shift = rep % len(jobs)
        for kind, x in jobs[shift:] + jobs[:shift]:
            sample = theta_sample if kind == "theta" else decode_sample
            samples[kind, x].append(sample(url, x, rep))
    theta = {x: min(v) for (kind, x), v in samples.items() if kind == "theta"}
    decode = {x: min(v) for (kind, x), v in samples.items() if kind == "decode"}
    ms = [[theta[r * t] + max(0.0, decode[r] - theta[r]) for t in tokens] for r in concurrencies]
    table = {"format": "dspark-verify-costs/2",
             "measured_by": "llama.cpp b11434 llama-server's own timings (benchmarks/llamacpp_serve_vs_plan.py): "
                            "theta(R*t), the fastest timings.prompt_ms of a fresh R*t-token prompt, plus "
                            "max(0, D(R) - theta(R)), D(R) the timings.predicted_per_token_ms of R concurrent "
                            "requests; one thread",
             "batches": concurrencies, "tokens": tokens, "ms": ms}
    return table, theta, decode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=3, help="bench serve runs; the fastest level of each is kept")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not available():
        sys.exit("no llama.cpp build: run scripts/build_llamacpp.sh first.")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        return measure(out, args.prompts, args.max_tokens, concurrencies, args.repeats)


def fastest_levels(serves: list[dict]) -> dict[tuple[str, int], dict]:
    """Per (server, concurrency), the level of the bench serve run with the most tokens/s (least disturbed)."""
    levels: dict[tuple[str, int], dict] = {}
    for serve in serves:
        for level in serve["levels"]:
            key = (level["server"], level["concurrency"])
            if key not in levels or level["tokens_per_s"] > levels[key]["tokens_per_s"]:
                levels[key] = {**level, "requests_of_run": [r for r in serve["requests"] if r["server"] == key[0]
                                                            and r["concurrency"] == key[1]]}
    return levels


def measure(out: Path, count: int, max_tokens: int, concurrencies: list[int], repeats: int) -> int:
    from dspark_cli.runtime.measure import schedule
    from dspark_cli.runtime.measure.costs import read_cost_table
    from dspark_cli.runtime.measure.evaluation import EvalRun
    from dspark_cli.runtime.measure.replay import rounds_of_result

    prompts = out / "prompts.jsonl"
    write_prompts(prompts, count)
    target, draft = demo_gguf(out / "gguf")
    dspark("eval", "--data", str(prompts), "--no-chat", "--max-new-tokens", str(max_tokens), "--device", "cpu",
           "--json", str(out / "run.json"))
    run = EvalRun.load(out / "run.json")
    block = run.settings["block_size"]
    slots = max(concurrencies)
    with llama_server(target, slots=slots) as plain:
        table, theta, decode = cost_table(plain, block, concurrencies)
    (out / "llamacpp_costs.json").write_text(json.dumps(table, indent=2))
    dspark("plan", str(out / "run.json"), "--concurrency", ",".join(map(str, concurrencies)), "--costs",
           str(out / "llamacpp_costs.json"), "--scheduler", "fixed-k", "--json", str(out / "plan.json"))
    with llama_server(target, draft, slots=slots, extra=["--metrics"]) as spec, \
            llama_server(target, slots=slots) as base:
        for repeat in range(repeats):
            dspark("bench", "serve", spec, "--baseline", base, "--prompts", str(prompts), "--concurrency",
                   ",".join(map(str, concurrencies)), "--max-tokens", str(max_tokens), "--json",
                   str(out / f"serve{repeat}.json"))
    plan = json.loads((out / "plan.json").read_text())
    serves = [json.loads((out / f"serve{repeat}.json").read_text()) for repeat in range(repeats)]
    cost = read_cost_table(out / "llamacpp_costs.json")
    levels = fastest_levels(serves)
    one = levels["speculative", min(concurrencies)]
    round_ms = sum(r["latency_s"] - r["ttft_s"] for r in one["requests_of_run"]) * 1000 / one["counters"]["drafts"]
    engine_draft_s = max(0.0, round_ms - cost.seconds(1, block + 1) * 1000) / 1000
    prompts_rounds = [rounds_of_result(r) for r in run.results]
    engine_rounds = [[dataclasses.replace(r, overhead_s=engine_draft_s) for r in p] for p in prompts_rounds]
    fixed = [s for s in schedule.schedulers_for(["fixed-k"], block) if s.value == block][0]
    eval_acceptance = (sum(r.accepted for p in prompts_rounds for r in p)
                       / sum(r.verified for p in prompts_rounds for r in p))
    rows = []
    for load in plan["loads"]:
        c = load["concurrency"]
        row = next(r for r in load["rows"] if r["label"] == f"fixed k = {block}")
        base_pred = c / cost.seconds(c, c)
        engine_pred = schedule.simulate(engine_rounds, fixed, c, cost).tokens_per_s
        spec_meas, base_meas = levels["speculative", c], levels["baseline", c]
        rows.append({"concurrency": c, "predicted_tokens_per_s": row["tokens_per_s"],
                     "predicted_baseline_tokens_per_s": base_pred,
                     "predicted_speedup": row["tokens_per_s"] / base_pred,
                     "predicted_tokens_per_s_engine_draft": engine_pred,
                     "predicted_speedup_engine_draft": engine_pred / base_pred, "predicted_tau": row["tau"],
                     "measured_tokens_per_s": spec_meas["tokens_per_s"],
                     "measured_baseline_tokens_per_s": base_meas["tokens_per_s"],
                     "measured_speedup": statistics.median(sv["speedup"][str(c)] for sv in serves),
                     "measured_speedups_per_run": [sv["speedup"][str(c)] for sv in serves],
                     "measured_acceptance": spec_meas["acceptance"],
                     "measured_accept_length": spec_meas["counters"]["accept_length"]})
    summary = {"block": block, "eval_acceptance": eval_acceptance,
               "eval_draft_s_per_round": statistics.fmean(r.overhead_s for p in prompts_rounds for r in p),
               "engine_draft_s_per_round": engine_draft_s, "theta_ms": theta, "decode_ms": decode, "rows": rows}
    (out / "comparison.json").write_text(json.dumps(summary, indent=2))
    print(f"load average {os.getloadavg()[0]:.1f} (2 cores shared)")
    print(f"block {block}; eval acceptance {eval_acceptance:.3f}; draft time per round: eval run "
          f"{summary['eval_draft_s_per_round'] * 1000:.2f} ms, llama.cpp {engine_draft_s * 1000:.2f} ms (its time "
          f"per round at C = {min(concurrencies)}, {round_ms:.2f} ms, minus the table's verify pass "
          f"{cost.seconds(1, block + 1) * 1000:.2f} ms)")
    print("theta ms: " + ", ".join(f"{m}:{v:.2f}" for m, v in theta.items()))
    print("decode ms per step: " + ", ".join(f"R={r}:{v:.2f}" for r, v in decode.items()))
    for r in rows:
        print(f"C={r['concurrency']}: measured speedup per run " + ", ".join(f"{v:.3f}" for v in
                                                                           r["measured_speedups_per_run"]))
    print("| C | plan tok/s | plan base | plan speedup | plan speedup (llama.cpp draft time) | measured tok/s | "
          "measured base | measured speedup (median of runs) | plan τ | measured τ | measured acceptance |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['predicted_tokens_per_s']:.0f} | "
              f"{r['predicted_baseline_tokens_per_s']:.0f} | "
              f"{r['predicted_speedup']:.3f} | {r['predicted_speedup_engine_draft']:.3f} | "
              f"{r['measured_tokens_per_s']:.0f} | {r['measured_baseline_tokens_per_s']:.0f} | "
              f"{r['measured_speedup']:.3f} | {r['predicted_tau']:.2f} | {r['measured_accept_length']:.2f} | "
              f"{r['measured_acceptance']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
