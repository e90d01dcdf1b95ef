"""Is the τ `dspark train` prints the τ `dspark eval` measures? A short run on the demo target, compared at three points.

    .venv/bin/python benchmarks/train_tau_vs_eval.py [--steps 300] [--work build/tau_vs_eval]

Trains a new draft for the shipped demo target with the `dspark train` command (1 layer reading target layers
1, 3, 6, block 7, Markov rank 128, batch 8 (--batch-size) x 256 tokens, 32 anchors, lr 2e-3, on the first 80 standard-library
sources), writing a checkpoint and measuring τ every steps/3 steps (`--tau-every`, 8 held-out prompts of 64 tokens,
64 new tokens). At each of the three points it then runs:

- `dspark eval` on the checkpoint with the held-out prompts (decoded to text, `--no-chat --max-new-tokens 64`,
  T = 0): the command's own τ (it stops at the end-of-text token and re-tokenizes the prompt text);
- the real loop (`Pair.generate`) on the same prompt tokens without a stop token: what train's τ claims to be;
- `dspark eval` on the demo's own code prompts (eval_code.jsonl), for reference (other prompts).

The checkpoint stores bf16 weights and train measures its fp32 ones, so small differences are expected.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

DSPARK = [sys.executable, "-m", "dspark_cli"]


def dspark(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    subprocess.run([*DSPARK, *args], check=True, env=env, stdout=subprocess.DEVNULL)


def eval_tau(target: Path, draft: Path, prompts: Path, out: Path) -> float:
    dspark("eval", "--target", str(target), "--draft", str(draft), "--data", str(prompts), "--no-chat",
           "--max-new-tokens", "64", "--device", "cpu", "--dtype", "float32", "--json", str(out))
    return json.loads(out.read_text())["statistics"]["all"]["tau"]


def loop_tau(target: Path, draft: Path, prompts) -> float:
    from dspark_cli.runtime.pair import Pair

    pair = Pair.load(target, draft, device="cpu", dtype="float32")
    rounds = [r for p in prompts for r in pair.generate(p.tolist(), max_new_tokens=64, stop_ids=()).stats.rounds]
    return sum(r.emitted for r in rounds) / len(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--work", type=Path, default=REPO / "build" / "tau_vs_eval")
    args = parser.parse_args()
    from dspark_cli.runtime.demo import DEMO_DIR
    from dspark_cli.runtime.train.data import load_token_stream, stdlib_sources
    from dspark_cli.runtime.train.run import hold_out_prompts, load_tokenizer_and_config
    from dspark_cli.runtime.train.tau import TauProbe

    target = DEMO_DIR / "target"
    args.work.mkdir(parents=True, exist_ok=True)
    files = [str(p) for p in stdlib_sources()[:80]]
    every = args.steps // 3
    out, log = args.work / "draft", args.work / "train.jsonl"
    log.unlink(missing_ok=True)
    data = [arg for f in files for arg in ("--data", f)]
    dspark("train", "--target", str(target), *data, "-o", str(out), "--force", "--layers", "1", "--block-size", "7",
           "--target-layers", "1,3,6", "--markov-rank", "128", "--steps", str(args.steps), "--batch-size",
           str(args.batch_size), "--seq-len", "256", "--anchors", "32", "--lr", "2e-3", "--save-every", str(every),
           "--tau-every", str(every), "--tau-prompts", "8", "--log-jsonl", str(log), "--device", "cpu")
    printed = {r["step"]: r["tau"] for r in map(json.loads, log.read_text().splitlines()) if r["tau"] is not None}

    tokenizer, _ = load_tokenizer_and_config(target)
    _, prompts, _ = hold_out_prompts(load_token_stream([Path(f) for f in files], tokenizer, None), TauProbe(every=1))
    held = args.work / "held_out.jsonl"
    held.write_text("".join(json.dumps({"turns": [tokenizer.decode(p.tolist())]}) + "\n" for p in prompts))

    print(f"demo target, new draft, {args.steps} steps; τ at T = 0, 8 held-out prompts x 64 new tokens")
    print(f"{'step':>5} {'train τ':>8} {'eval τ':>7} {'train/eval':>10} {'loop τ':>7} {'eval τ (demo prompts)':>22}")
    for step in sorted(printed):
        draft = out if step == args.steps else out / f"checkpoint-{step}"
        measured = eval_tau(target, draft, held, args.work / f"eval-{step}.json")
        demo = eval_tau(target, draft, DEMO_DIR / "eval_code.jsonl", args.work / f"eval-demo-{step}.json")
        loop = loop_tau(target, draft, prompts)
        print(f"{step:>5} {printed[step]:>8.3f} {measured:>7.3f} {printed[step] / measured:>10.3f} {loop:>7.3f} "
              f"{demo:>22.3f}")


if __name__ == "__main__":
    main()
