"""Distil a DFlash2 draft for the shipped demo target with the shipped DSpark demo draft's budget (offline, CPU).

    python scripts/build_dflash2_demo.py                      # -> build/dflash2-demo/draft
    python scripts/build_dflash2_demo.py --out /tmp/d2 --steps 20   # a quick run

The recipe is the demo build's (runtime/train/demo_build.py, DemoRecipe): the same self-distillation sequences of
the shipped target (rebuilt from the same seed), the same draft options (2000 steps of 8 windows of 256 tokens, 32
anchors, AdamW lr 2e-3, seed 0, so the same batches and anchors as the shipped DSpark draft), one decoder layer
reading target layers [1, 3, 6]; the draft is DFlash2 (`--draft-arch dflash2`: the 1+N query layout with 7
proposals per round, the grouped dynamic convolution and the path selector of checkpoint/families/dflash2.py's
defaults). Compare it with the shipped draft by `dspark eval` (docs/formats-other.md §7.5 has the table).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # two shared cores: no spinning OpenMP workers
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from dspark_cli.runtime.demo import DEMO_DIR  # noqa: E402
from dspark_cli.runtime.train.data import SequenceBank, split_held_out, stdlib_sources  # noqa: E402
from dspark_cli.runtime.train.demo_build import DemoRecipe, _stream, self_distillation_data  # noqa: E402
from dspark_cli.runtime.train.new_draft import new_draft  # noqa: E402
from dspark_cli.runtime.train.trainer import DraftTrainer, save_final  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "build" / "dflash2-demo" / "draft")
    parser.add_argument("--steps", type=int, help="draft steps (default: the recipe's 2000)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=250, help="also write the draft every N steps (0: at the "
                        "end only), so an interrupted run leaves its latest draft")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    recipe = DemoRecipe()
    options = replace(recipe.draft_options, seed=recipe.seed, steps=args.steps or recipe.draft_options.steps)
    shape = replace(recipe.draft, markov_rank=0, confidence=False, confidence_with_markov=False, arch="dflash2")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_DIR / "target"))
    target = AutoModelForCausalLM.from_pretrained(str(DEMO_DIR / "target"), dtype=torch.float32).eval()
    cache = args.out.parent / "distill_rows.pt"  # the sequences depend only on the shipped target and the recipe
    if cache.is_file():
        data = SequenceBank(torch.load(cache))
    else:
        train_files, _ = split_held_out(stdlib_sources(), recipe.held_out_every)
        data = self_distillation_data(target, _stream(train_files, tokenizer), recipe)
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data.rows, cache)
    print(f"self-distillation data: {data.rows.shape[0]} x {data.rows.shape[1]} tokens "
          f"({time.perf_counter() - started:.0f} s)", flush=True)

    torch.manual_seed(recipe.seed)
    draft, _ = new_draft(target, tokenizer, shape, options.anchors_per_sequence(options.seq_len))
    trainer = DraftTrainer(target, draft, data, options)
    started = time.perf_counter()
    while trainer.step < options.steps:
        terms = trainer.run_step()
        if trainer.step % 50 == 0 or trainer.step == options.steps:
            print(f"step {trainer.step}/{options.steps}: loss {terms.value:.3f} ce {terms.ce:.3f} l1 {terms.l1:.3f} "
                  f"expected length {terms.expected_length:.2f} ({time.perf_counter() - started:.0f} s)", flush=True)
        if args.save_every and trainer.step % args.save_every == 0:
            save_final(draft, args.out)
    save_final(draft, args.out)
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s of training)")


if __name__ == "__main__":
    main()
