"""DFlash2 proposals from dspark, as a reference side for parity with an engine (float32, greedy).

    python scripts/dflash2_parity.py --target T --draft D --json dspark.json             # dspark's side
    python scripts/dflash2_parity.py --target T --draft D --json bad.json --perturb selector   # a negative control
    python scripts/dflash2_parity.py --compare dspark.json other.json                    # exit 1 unless identical

Which reference: vLLM's DFlash2 drafting function (`vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py`,
`_selector_walk_kernel`) is readable but vLLM is not installed here, so it cannot be run. llama.cpp b11434 runs the
same weights (convert --to gguf, llama-server) but reports no per-round drafts, only each request's drafted and
accepted counts, which scripts/llamacpp_check.py compares with dspark's.

The JSON: {"prompts": [{"prompt": [ids], "tokens": [ids], "rounds": [{"drafted": [ids], "accepted": m}]}], ...}:
each round's drafted tokens d_1..d_N (every position drafted, no confidence cut), the accepted count, and the
committed output, all at T = 0. Two sides agree when every prompt's output and every round's drafts are equal.
--perturb adds noise (0.5 std) to one weight group (the selector's successor codebook, or the first layer's
attention-path base kernel) before drafting: the comparison against the unperturbed side must then fail, which
shows that it can.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from dspark_cli.runtime.decode import speculative  # noqa: E402
from dspark_cli.runtime.demo import DEMO_DIR  # noqa: E402

PERTURBATIONS = ("none", "selector", "conv")


def perturb(draft, what: str, scale: float = 0.5) -> None:
    """Add scale * std * N(0, 1) (seed 0) to one weight group of a loaded DFlash2 draft."""
    if what == "none":
        return
    weight = (draft.candidate_selector.successor_codebook if what == "selector"
              else draft.layers[0].attention_conv.base_kernel)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        weight.add_(scale * weight.std() * torch.randn(weight.shape, generator=generator))


def dspark_side(target_dir: Path, draft_dir: Path, prompts: list[list[int]], max_new: int, what: str) -> dict:
    from dspark_cli.runtime.pair import Pair

    pair = Pair.load(target_dir, draft_dir, device="cpu", dtype="float32")
    perturb(pair.draft, what)
    drafted: list[list[int]] = []
    stage = speculative.markov_stage

    def recording(*args, **kwargs):
        proposal = stage(*args, **kwargs)
        drafted.append(proposal.tokens.tolist())
        return proposal

    speculative.markov_stage = recording  # this script's own record of each round's drafts
    out = []
    try:
        for prompt in prompts:
            drafted.clear()
            result = pair.generate(prompt, max_new_tokens=max_new, stop_ids=())
            rounds = [{"drafted": d, "accepted": r.accepted} for d, r in zip(drafted, result.stats.rounds)]
            out.append({"prompt": prompt, "tokens": result.tokens, "rounds": rounds})
    finally:
        speculative.markov_stage = stage
    return {"side": "dspark", "perturb": what, "block_size": pair.block_size, "prompts": out}


def compare(a: dict, b: dict) -> tuple[bool, str]:
    """Whether two sides' outputs and per-round drafts are identical; a sentence saying where they first differ."""
    if len(a["prompts"]) != len(b["prompts"]):
        return False, f"{len(a['prompts'])} prompts against {len(b['prompts'])}"
    for i, (x, y) in enumerate(zip(a["prompts"], b["prompts"])):
        if x["prompt"] != y["prompt"]:
            return False, f"prompt {i} differs"
        for j, (rx, ry) in enumerate(zip(x["rounds"], y["rounds"])):
            if rx["drafted"] != ry["drafted"]:
                return False, f"prompt {i} round {j}: drafts {rx['drafted']} against {ry['drafted']}"
        if len(x["rounds"]) != len(y["rounds"]) or x["tokens"] != y["tokens"]:
            return False, f"prompt {i}: outputs or round counts differ"
    rounds = sum(len(p["rounds"]) for p in a["prompts"])
    return True, f"identical: {len(a['prompts'])} prompts, {rounds} rounds of drafts"


def held_out_prompts(count: int, length: int) -> list[list[int]]:
    """Prompts from the demo pair's held-out prose and code files (its eval sets), encoded by its tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_DIR / "target"))
    texts = [json.loads(line)["turns"][0] for name in ("eval_code.jsonl", "eval_prose.jsonl")
             for line in (DEMO_DIR / name).read_text().splitlines()]
    return [tokenizer.encode(text)[:length] for text in texts[:count]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=DEMO_DIR / "target")
    parser.add_argument("--draft", type=Path, default=REPO / "build" / "dflash2-demo" / "draft")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--perturb", choices=PERTURBATIONS, default="none")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        same, words = compare(*(json.loads(p.read_text()) for p in args.compare))
        print(words)
        return 0 if same else 1
    torch.set_num_threads(2)
    side = dspark_side(args.target, args.draft, held_out_prompts(args.prompts, args.prompt_tokens), args.max_new,
                       args.perturb)
    text = json.dumps(side, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
