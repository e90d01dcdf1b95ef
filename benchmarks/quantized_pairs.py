"""Does the draft still pay after quantization? Draft × target precision in the real llama.cpp (b11434).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quantized_pairs.py [--pairs demo,demo-large] [--grid full|cross|axes|same]
        [--repeats 3] [--prompts 4] [--max-tokens 64] [--out DIR]

For each pair (the demo pair, whose target fits in the CPU's cache; demo-large, the same function made
memory-bound: docs/demo-large.md) the GGUF files are written by `dspark convert`'s library half, unquantized
(the checkpoints' own dtypes: BF16 matrices here) and at Q8_0, Q4_0 (dspark's quantizer) and
Q4_K_M (llama-quantize): runtime/convert/gguf_quant.py. A row is one (draft, target) precision: `full` measures
all 16, `axes` the draft's four against the unquantized target and the target's four with the unquantized draft (7),
`cross` those and both at each type (10), `same` only both at each type (3). Each row is added to DIR/quantized_pairs.json as it is measured.

Each row is one run: a plain llama-server on the row's target and a speculative one on the target and draft (dspark's
flags, `--metrics`), one thread each, up at once; REPEATS passes, each sending the prompts (the demo's eval prompts,
code and prose alternating) one at a time to the plain server, then to the speculative one (the order alternates
between passes). Per pass: decode tokens/s of each (mean over requests of (tokens - 1) / (latency - TTFT), as
speculation_pays.py) and their ratio, the speedup; acceptance (accepted / drafted) and τ (1 + accepted / verify
steps) from llama.cpp's /metrics counters over the row. Printed: median (range) over passes, and the machine's
load average around each row. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "scripts"), str(REPO / "benchmarks")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from llamacpp_server import LARGE_DIR, available, llama_server, pair_gguf  # noqa: E402
from speculation_pays import decode_rate, pair_folders  # noqa: E402

PRECISIONS = ("unquantized", "q8_0", "q4_0", "q4_k_m")


def precision_files(target: Path, draft: Path, work: Path) -> dict[tuple[str, str], Path]:
    """(role, precision) -> GGUF: the unquantized files and each quantization of them (reused when there)."""
    from dspark_cli.runtime.convert.gguf_quant import quantize_file

    files = {("target", "unquantized"): target, ("draft", "unquantized"): draft}
    for role, source in (("target", target), ("draft", draft)):
        for kind in PRECISIONS[1:]:
            path = work / f"{role}-{kind}.gguf"
            if not path.is_file():
                partial = work / f"{role}-{kind}.{os.getpid()}.partial.gguf"
                quantize_file(source, partial, kind)
                partial.replace(path)
            files[role, kind] = path
    return files


def rows_of(grid: str) -> list[tuple[str, str]]:
    """(draft precision, target precision) rows."""
    if grid == "full":
        return [(d, t) for t in PRECISIONS for d in PRECISIONS]
    axes = [(d, "unquantized") for d in PRECISIONS] + [("unquantized", t) for t in PRECISIONS[1:]]
    same = [(kind, kind) for kind in PRECISIONS[1:]]
    return {"axes": axes, "same": same, "cross": axes + same}[grid]


def measure_row(files: dict, draft_kind: str, target_kind: str, prompts: list[str], args) -> dict:
    from dspark_cli.runtime.bench.serve import Level, ServeConfig, probe, run_level, warm_up

    target, draft = files["target", target_kind], files["draft", draft_kind]
    load = [os.getloadavg()[0]]
    passes = []
    with llama_server(target) as plain_url, llama_server(target, draft, extra=["--metrics"]) as spec_url:
        servers = {"plain": probe(plain_url, "baseline", "llamacpp", None),
                   "speculative": probe(spec_url, "speculative", "llamacpp", None)}
        for server in servers.values():
            warm_up(server, prompts[0], 120.0)
        before = servers["speculative"].snapshot()
        for repeat in range(args.repeats):
            rates = {}
            for role in (("plain", "speculative") if repeat % 2 == 0 else ("speculative", "plain")):
                config = ServeConfig(url=servers[role].endpoint.url, prompts=prompts, concurrencies=(1,),
                                     max_tokens=args.max_tokens, timeout_s=600.0, engine="llamacpp")
                level = Level(servers[role].role, "llamacpp", 1)
                run_level(servers[role], prompts, config, level)
                rates[role] = decode_rate(level)
            passes.append(rates)
        counters = servers["speculative"].snapshot().since(before)
    load.append(os.getloadavg()[0])
    speedups = [p["speculative"] / p["plain"] for p in passes if p["plain"] and p["speculative"]]
    return {"draft": draft_kind, "target": target_kind, "draft_mb": draft.stat().st_size / 1e6,
            "target_mb": target.stat().st_size / 1e6, "acceptance": counters.acceptance,
            "tau": counters.accept_length, "plain_tokens_per_s": [p["plain"] for p in passes],
            "speculative_tokens_per_s": [p["speculative"] for p in passes], "speedup": speedups, "load": load}


def demo_prompts(count: int) -> list[str]:
    from dspark_cli.runtime.demo import DEMO_DIR

    sets = [[json.loads(line)["turns"][0] for line in (DEMO_DIR / name).read_text().splitlines() if line.strip()]
            for name in ("eval_code.jsonl", "eval_prose.jsonl")]
    return [sets[i % 2][i // 2] for i in range(count)]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})" if values else "–"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="demo,demo-large")
    parser.add_argument("--grid", choices=("full", "cross", "axes", "same"), default="full")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved passes per row")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--large-dir", type=Path, default=LARGE_DIR)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not available():
        sys.exit("no llama.cpp build: run scripts/build_llamacpp.sh first.")
    prompts = demo_prompts(args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        rows = []
        for name in args.pairs.split(","):
            work = out / name
            work.mkdir(parents=True, exist_ok=True)
            target_dir, draft_dir = pair_folders(name, args.large_dir)
            files = precision_files(*pair_gguf(target_dir, draft_dir, work), work)
            for draft_kind, target_kind in rows_of(args.grid):
                row = {"pair": name, **measure_row(files, draft_kind, target_kind, prompts, args)}
                rows.append(row)
                (out / "quantized_pairs.json").write_text(json.dumps(rows, indent=1))
                print(f"{name} draft {draft_kind} target {target_kind}: speedup {spread(row['speedup'])}, "
                      f"τ {row['tau']:.2f}, load {row['load'][0]:.1f}–{row['load'][1]:.1f}", flush=True)
    print(f"\nmedian (range) of {args.repeats} interleaved passes per row; {args.prompts} prompts x {args.max_tokens} "
          "tokens, one at a time; llama-server -t 1; decode tokens/s")
    print("| pair | draft | target | draft MB | target MB | acceptance | τ | plain tok/s | speculative tok/s | "
          "speedup | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pair']} | {r['draft']} | {r['target']} | {r['draft_mb']:.2f} | {r['target_mb']:.1f} | "
              f"{r['acceptance']:.3f} | {r['tau']:.2f} | {spread(r['plain_tokens_per_s'])} | "
              f"{spread(r['speculative_tokens_per_s'])} | {spread(r['speedup'])} | "
              f"{r['load'][0]:.1f}–{r['load'][1]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
