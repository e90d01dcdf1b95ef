"""Build a demo pair shipped in src/dspark_cli/runtime/assets/ (offline, deterministic, CPU).

    python scripts/build_demo.py                       # the attention pair: writes assets/demo/ and MODEL_CARD.md
    python scripts/build_demo.py --pair demo-hybrid    # the hybrid pair: assets/demo-hybrid/ (needs assets/demo/)
    python scripts/build_demo.py --out /tmp/demo --work /tmp/demo-work
    python scripts/build_demo.py --card-only           # re-render MODEL_CARD.md from build/demo/build_report.json
    python scripts/build_demo.py --pair demo-hybrid --card-only   # ... with build/demo-hybrid/speed.md's figures
    python scripts/build_demo.py --pair demo-large     # the demo pair, inert MLP units: ~/.cache/dspark/demo-large
    python scripts/build_demo.py --pair demo-large --mlp-width 768 --extra-layers 64 --out /tmp/demo-large

Trains a byte-level BPE tokenizer (the hybrid pair reuses the attention pair's), a small target (a Qwen3, or a
Qwen3.5-style Gated DeltaNet / attention hybrid), a DSpark draft and a DFlash draft (same budget) on the running
interpreter's standard-library sources, evaluates both drafts with the speculative loop on held-out files at
T = 0 and T = 1, and writes the target, the DSpark draft, the tokenizer and the model card. The target and the
drafts are cached in the work folder: a build run again with the same recipe resumes after its last whole stage.

The demo-large pair trains nothing: the shipped demo target grown by inert weights (the same function, the
cost of a target far beyond the CPU's cache) and the demo draft, with both as llama.cpp GGUFs in OUT/gguf/
(runtime/train/demo_large.py, docs/demo-large.md); too large for the wheel, it is written outside the checkout and
replaced when built again.
"""

from __future__ import annotations

import os

# Two cores shared with other processes: spinning OpenMP workers slow training down by an order of magnitude.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
if str(REPO / "scripts") not in sys.path:  # llamacpp_server, when this file is loaded from elsewhere
    sys.path.append(str(REPO / "scripts"))

import torch  # noqa: E402

from dspark_cli.runtime.demo import DEMO_DIR, demo_folder  # noqa: E402
from dspark_cli.runtime.io.outputs import replace_path  # noqa: E402
from dspark_cli.runtime.train.demo_build import (HYBRID_RECIPE, DemoRecipe, build_demo, model_card,  # noqa: E402
                                              report_from_json, report_json)
from dspark_cli.runtime.train.demo_large import DEFAULT_RECIPE, LargeRecipe, build_large_pair  # noqa: E402
from llamacpp_server import LARGE_DIR, large_gguf  # noqa: E402

RECIPES = {"demo": DemoRecipe(), "demo-hybrid": HYBRID_RECIPE}
TOKENIZERS = {"demo": None, "demo-hybrid": DEMO_DIR / "target"}  # the hybrid pair reuses the attention pair's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=sorted([*RECIPES, "demo-large"]), default="demo",
                        help="which pair: demo (attention, the default), demo-hybrid (Qwen3.5-style target) or "
                        "demo-large (the demo pair, its target grown by inert weights)")
    parser.add_argument("--extra-layers", type=int, help="demo-large: the inert layers appended to the demo "
                        f"target (default {DEFAULT_RECIPE.extra_layers})")
    parser.add_argument("--mlp-width", type=int, help="demo-large: the MLP units of every layer, the new ones inert "
                        f"(default {DEFAULT_RECIPE.mlp_width}; 768 keeps the demo target's)")
    parser.add_argument("--out", type=Path, help="where target/, draft/ and MODEL_CARD.md go (default: the pair's "
                        "folder in src/dspark_cli/runtime/assets/; demo-large: ~/.cache/dspark/demo-large)")
    parser.add_argument("--work", type=Path, help="cached target and draft stages, DFlash draft and build_report.json "
                        "(default: build/PAIR)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--card-only", action="store_true",
                        help="only rewrite OUT/MODEL_CARD.md from WORK/build_report.json (same recipe)")
    args = parser.parse_args()
    if args.pair == "demo-large":
        if args.work or args.card_only:
            parser.error("the demo-large pair has no work folder and no card to re-render; pass --out at most")
        recipe = LargeRecipe(DEFAULT_RECIPE.extra_layers if args.extra_layers is None else args.extra_layers,
                             DEFAULT_RECIPE.mlp_width if args.mlp_width is None else args.mlp_width)
        build_large(args.out or LARGE_DIR, recipe)
        return
    if args.extra_layers is not None or args.mlp_width is not None:
        parser.error("--extra-layers and --mlp-width are for --pair demo-large")
    recipe = RECIPES[args.pair]
    args.out = args.out or demo_folder(args.pair)
    args.work = args.work or REPO / "build" / args.pair
    command = "python scripts/build_demo.py" + ("" if args.pair == "demo" else f" --pair {args.pair}")
    if args.card_only:
        try:
            report = report_from_json((args.work / "build_report.json").read_text(), recipe)
        except (OSError, ValueError) as error:
            print(f"error: cannot re-render the model card from {args.work / 'build_report.json'}: {error}",
                  file=sys.stderr)
            sys.exit(2)
        (args.out / "MODEL_CARD.md").write_text(model_card(report, recipe, command, speed_tables(args.work)))
        print(f"{args.out / 'MODEL_CARD.md'} rewritten from {args.work / 'build_report.json'}")
        return

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    staging = args.out.with_name(f".{args.out.name}.building")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer = TOKENIZERS[args.pair]
    if tokenizer is not None and not (tokenizer / "tokenizer.json").is_file():
        print(f"error: the {args.pair} pair reuses the tokenizer in {tokenizer}, which is missing; build the demo pair "
              "first (python scripts/build_demo.py)", file=sys.stderr)
        sys.exit(2)
    report = build_demo(staging, args.work, recipe, tokenizer_dir=tokenizer,
                        log=lambda line: print(f"[{time.perf_counter() - started:6.0f}s] {line}", flush=True))
    (staging / "MODEL_CARD.md").write_text(model_card(report, recipe, command, speed_tables(args.work)))
    (args.work / "build_report.json").write_text(report_json(report))
    for path in [staging, *staging.rglob("*")]:  # plain readable files and folders for packaging
        path.chmod(0o755 if path.is_dir() else 0o644)
    publish(staging, args.out)
    print(f"{args.pair} pair written to {args.out}; this run took {(time.perf_counter() - started) / 60:.1f} min, "
          f"all stages {sum(report.seconds.values()) / 60:.1f} min")


def build_large(out: Path, recipe: LargeRecipe) -> None:
    """OUT/target, OUT/draft, OUT/MODEL_CARD.md (replacing an earlier OUT) and OUT/gguf/{target,draft}.gguf."""
    started = time.perf_counter()
    build_large_pair(out, recipe, force=True)
    target, draft = large_gguf(out, recipe)
    print(f"demo-large pair ({recipe}) written to {out}; GGUFs {target} "
          f"({target.stat().st_size / 1e6:.0f} MB) and {draft}; took {time.perf_counter() - started:.0f} s")


def speed_tables(work: Path) -> str:
    """WORK/speed.md, the tables `benchmarks/bench_demo_pairs.py --markdown` wrote for the card ("" if absent)."""
    path = work / "speed.md"
    return path.read_text() if path.is_file() else ""


def publish(staging: Path, out: Path) -> None:
    """Move what the build wrote (target/, draft/, MODEL_CARD.md) from `staging` into `out`, one entry at a time,
    each old one moved aside first and deleted last; anything else in `out` (the eval prompt sets) is kept."""
    out.mkdir(parents=True, exist_ok=True)
    for entry in sorted(staging.iterdir()):
        replace_path(entry, out / entry.name)
    staging.rmdir()


if __name__ == "__main__":
    main()
