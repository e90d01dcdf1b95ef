"""Calibrate the demo pair's confidence head at dataset scale and score STS on held-out prompts, over several splits.

    .venv/bin/python benchmarks/calibrate_demo.py [--prompts 512] [--max-new-tokens 128] [--procs 2] [--seeds 4]
                                                  [--out DIR]      # keep the prompt set and run.json in DIR
    .venv/bin/python benchmarks/calibrate_demo.py --run RUN.json [--seeds 4]     # score an existing run only

The shipped prompt sets hold 32 prompts, too few to fit or score a calibration (docs/eval.md). This builds a prompt
set from the demo corpus's held-out files (the standard-library sources the demo build holds out, every 25th sorted
file, so neither model trained on them): the interpreter's sources cut into blocks of 6 lines, `--prompts` blocks
taken evenly. It runs `dspark eval --json` on them (under torchrun with `--procs` > 1, prompts sharded), then fits
STS with `--seeds` different held-out splits and prints, per split and position, T_j and the held-out survival ECE
before → after with its floor (the ECE a perfectly calibrated head would score on those pairs), and per position
over all splits how often the ECE fell and the mean change. Also prints the in-sample ECE on all prompts at T = 1
and at the best grid temperature (earlier positions at their fitted temperatures): the most any temperature can
remove there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from dspark_cli.runtime.measure import calibration as sts  # noqa: E402
from dspark_cli.runtime.measure.evaluation import EvalRun  # noqa: E402
from dspark_cli.runtime.measure.metrics import expected_calibration_error  # noqa: E402
from dspark_cli.runtime.train.data import split_held_out, stdlib_sources  # noqa: E402
from dspark_cli.runtime.train.demo_build import DemoRecipe  # noqa: E402

LINES_PER_PROMPT = 6
MAX_PROMPT_CHARS = 400


def held_out_prompts(count: int) -> list[str]:
    """`count` blocks of LINES_PER_PROMPT lines taken evenly from the demo's held-out standard-library files."""
    _, held = split_held_out(stdlib_sources(), DemoRecipe().held_out_every)
    blocks = []
    for path in held:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        for start in range(0, len(lines) - LINES_PER_PROMPT, LINES_PER_PROMPT):
            text = "".join(lines[start:start + LINES_PER_PROMPT])
            if text.strip() and len(text) < MAX_PROMPT_CHARS:
                blocks.append(text)
    if count > len(blocks):
        raise SystemExit(f"--prompts {count}: the held-out files give only {len(blocks)} blocks")
    stride = len(blocks) / count
    return [blocks[int(k * stride)] for k in range(count)]


def run_eval(work: Path, args) -> Path:
    data, run = work / "heldout_code.jsonl", work / "run.json"
    data.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in held_out_prompts(args.prompts)))
    eval_args = ["eval", "--data", str(data), "--max-new-tokens", str(args.max_new_tokens), "--json", str(run),
                 "--force"]  # a rerun into the same --out folder replaces its run file
    if args.procs > 1:
        command = [shutil.which("torchrun") or "torchrun", "--nproc-per-node", str(args.procs), "-m", "dspark_cli"]
    else:
        command = [sys.executable, "-m", "dspark_cli"]
    subprocess.run(command + eval_args, check=True, stdout=subprocess.DEVNULL)
    return run


def in_sample(run: EvalRun, block: int) -> None:
    data = sts.rounds_of(run.results, "run")
    fitted = sts.fit_sts(data, block)
    print(f"\nin-sample on all {len(run.results)} prompts ({len(data)} rounds): survival ECE at T = 1 vs the best grid "
          "temperature")
    for j in range(block):
        def error(t):
            predicted, outcomes = sts.survival_pairs(data, fitted[:j] + [t] * (block - j), block)[j]
            return expected_calibration_error(predicted, outcomes)
        print(f"  j={j}: T=1 {error(1.0):.4f}   T={fitted[j]:.3f} {error(fitted[j]):.4f}")


def splits(run: EvalRun, block: int, seeds: int) -> None:
    changes = [[] for _ in range(block)]
    for seed in range(seeds):
        result = sts.fit_runs([run], ["run"], seed=seed)
        print(f"\nsplit seed {seed}: fitted on {result.fit_prompts} prompts ({result.fit_rounds} rounds), held out "
              f"{result.heldout_prompts}")
        for j in range(block):
            before, after, floor = result.before[j], result.after[j], result.floor[j]
            changes[j].append(after.ece - before.ece)
            print(f"  j={j}: T={result.temperatures[j]:.3f}  ECE {before.ece:.4f} -> {after.ece:.4f}  "
                  f"(floor {floor:.4f}, {after.count} pairs)")
    print(f"\nover {seeds} splits, per position: splits where held-out ECE fell, mean change")
    for j, change in enumerate(changes):
        print(f"  j={j}: {sum(c < 0 for c in change)}/{seeds}  {sum(change) / seeds:+.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--procs", type=int, default=2, help="eval processes (torchrun) when > 1")
    parser.add_argument("--seeds", type=int, default=4, help="held-out splits to fit and score")
    parser.add_argument("--run", type=Path, help="score this eval run file instead of running one")
    parser.add_argument("--out", type=Path, help="keep the prompt set and the run file in this new folder")
    args = parser.parse_args()
    if args.out is not None and args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"--out {args.out} exists and is not empty; give a new folder")
    with tempfile.TemporaryDirectory(prefix="dspark-calibrate-") as scratch:
        work = Path(scratch) if args.out is None else args.out
        work.mkdir(parents=True, exist_ok=True)
        path = args.run or run_eval(work, args)
        run = EvalRun.load(path)
        block = run.settings["block_size"]
        print(f"{len(run.results)} prompts, {sum(len(r.rounds) for r in run.results)} rounds, block {block}")
        in_sample(run, block)
        splits(run, block, args.seeds)


if __name__ == "__main__":
    main()
