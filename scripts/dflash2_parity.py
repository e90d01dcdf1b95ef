"""DFlash2 per-round parity between dspark (float32) and the real llama.cpp b11434 `llama-server`, greedy.

    python scripts/dflash2_parity.py --json dspark.json                        # dspark's side
    python scripts/dflash2_parity.py --llama --json llama.json                 # llama-server's side
    python scripts/dflash2_parity.py --llama --perturb selector --json bad.json   # a negative control
    python scripts/dflash2_parity.py --compare dspark.json llama.json          # exit 1 unless identical

Both sides run the same prompts (the demo pair's held-out prose and code, as token ids) one at a time, T = 0, the
draft's trained number of mask slots N (`dspark serve --engine llamacpp`'s flags: --spec-type draft-dflash
--spec-draft-n-max N, no p_min, n_min 0). Which reference: vLLM's drafting function is not installed here; llama.cpp
runs the same weights (dspark convert --to gguf) but its API reports no per-round drafts, so the llama side reads
them from the server's debug log (-lv 5): per round, `add accepted tokens: ... ids.size=A+1, n_draft=P`
(tools/server/server-context.cpp), checked against the request's own draft_n / draft_n_accepted. It has the counts of
each round, not the drafted ids.

The JSON: {"side", "draft", "perturb", "prompts": [{"prompt": [ids], "tokens": [ids], "rounds": [{"proposed": P,
"accepted": A, ...}]}]}; dspark's rounds add the drafted ids d_1..d_N and each slot's walk margin (the top-2 gap of
the selector row the walk read). dspark's (P, A) follow llama-server's length rule (get_n_draft_max): a round
verifies at most n_remaining - 1 drafts (the last drafts truncated, common_speculative_draft), a round that could
verify none is decoded without a draft, while dspark's loop drafts N every round and counts drafts accepted past the
limit; the drafts themselves do not depend on it (llama.cpp drafts N and truncates).

--compare says, per prompt, whether the rounds are identical or the first round where they differ, and the walk
margin at the first slot where the two drafts must differ (the one after the shorter accepted prefix): below TIE a
near tie, which llama.cpp's arithmetic can flip (its CPU matmuls round activations to BF16 against BF16 weights).
--perturb adds noise (0.5 std, seed 0) to one weight group of the draft checkpoint (the selector's successor codebook,
or the first layer's attention-path base kernel) before either side runs it: against the unperturbed other side
the comparison must then fail away from near ties, which shows that it can; perturbed alike, the two sides agree.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from dspark_cli.runtime.decode import speculative  # noqa: E402
from dspark_cli.runtime.demo import DEMO_DIR  # noqa: E402

PERTURBED = {"selector": "candidate_selector.successor_codebook", "conv": "layers.0.attention_conv.base_kernel"}
TIE = 0.01  # a walk margin below this is a near tie
ROUND = re.compile(r"\| task (\d+) \| add accepted tokens: sampled=\d+, ids\.size=(\d+), n_draft=(\d+)")


def perturbed_draft(draft_dir: Path, what: str, out_dir: Path, scale: float = 0.5) -> Path:
    """A copy of the draft checkpoint in out_dir with scale * std * N(0, 1) (seed 0, in float32, stored back in the
    tensor's dtype) added to one weight group."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(draft_dir / "config.json", out_dir / "config.json")
    tensors = load_file(str(draft_dir / "model.safetensors"))
    weight = tensors[PERTURBED[what]].float()
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
    tensors[PERTURBED[what]] = (weight + scale * weight.std() * noise).to(tensors[PERTURBED[what]].dtype)
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


def engine_rounds(rounds: list[dict], max_new: int) -> list[dict]:
    """dspark's rounds (drafted ids, accepted) under llama-server's length rule: proposed = min(N, n_remaining - 1)
    with n_remaining = max_new - tokens so far (the first token included), accepted capped by it, rounds with nothing
    to verify dropped."""
    out, committed = [], 1
    for row in rounds:
        proposed = min(len(row["drafted"]), max_new - committed - 1)
        if proposed > 0:
            out.append({**row, "proposed": proposed, "accepted": min(row["accepted"], proposed)})
        committed += row["accepted"] + 1
    return out


@torch.inference_mode()
def walk_margins(drafter, hidden: torch.Tensor, base: torch.Tensor, anchor: int, drafted: torch.Tensor) -> list[float]:
    """Each slot's top-2 gap in the selector row the greedy walk read (hidden [N, H], base [N, V], drafted [N])."""
    selector = drafter.draft.candidate_selector
    ids, unary = selector.candidates(base)  # [N, k]
    scores = selector(hidden, ids, unary, torch.tensor(anchor))  # [N, k, k]
    picked = (ids == drafted[:, None]).long().argmax(-1)  # [N] the index of each drafted id among its candidates
    previous = torch.cat([picked.new_zeros(1), picked[:-1]])  # [N]
    top2 = scores[torch.arange(len(ids)), previous].topk(2, dim=-1).values  # [N, 2]
    return (top2[:, 0] - top2[:, 1]).tolist()


def dspark_side(target_dir: Path, draft_dir: Path, prompts: list[list[int]], max_new: int) -> list[dict]:
    from dspark_cli.runtime.pair import Pair

    pair = Pair.load(target_dir, draft_dir, device="cpu", dtype="float32")
    recorded: list[dict] = []
    stage = speculative.markov_stage

    def recording(drafter, hidden, base, anchor, *args, **kwargs):
        proposal = stage(drafter, hidden, base, anchor, *args, **kwargs)
        recorded.append({"drafted": proposal.tokens.tolist(),
                         "margins": walk_margins(drafter, hidden, base, anchor, proposal.tokens)})
        return proposal

    speculative.markov_stage = recording  # this script's own record of each round's drafts
    out = []
    try:
        for prompt in prompts:
            recorded.clear()
            result = pair.generate(prompt, max_new_tokens=max_new, stop_ids=())
            rounds = [{**row, "accepted": r.accepted} for row, r in zip(recorded, result.stats.rounds)]
            out.append({"prompt": prompt, "tokens": result.tokens, "rounds": engine_rounds(rounds, max_new)})
    finally:
        speculative.markov_stage = stage
    return out


def log_rounds(log: str) -> list[list[dict]]:
    """Each request's rounds [{"proposed", "accepted"}] from llama-server's debug log, requests in task order."""
    tasks: dict[int, list[dict]] = {}
    for task, size, proposed in ROUND.findall(log):
        tasks.setdefault(int(task), []).append({"proposed": int(proposed), "accepted": int(size) - 1})
    return [tasks[task] for task in sorted(tasks)]


def llama_side(target_dir: Path, draft_dir: Path, prompts: list[list[int]], max_new: int, work: Path) -> list[dict]:
    """Convert the pair to GGUF in work, run each prompt through llama-server under dspark's flags with the debug
    log, read the rounds from it; raises when they do not sum to the server's own draft counts."""
    from llamacpp_check import complete
    from llamacpp_server import dspark_spec_args, llama_server, pair_gguf

    target, draft = pair_gguf(target_dir, draft_dir, work)
    log = work / "llama-server.log"
    with llama_server(target, draft, spec=dspark_spec_args(str(draft_dir)), extra=["-lv", "5"], log=log) as url:
        completions = [complete(url, prompt, max_new) for prompt in prompts]
    rounds = log_rounds(log.read_text())
    counts = [(c["timings"]["draft_n"], c["timings"]["draft_n_accepted"]) for c in completions]
    if [(sum(r["proposed"] for r in rs), sum(r["accepted"] for r in rs)) for rs in rounds] != counts:
        raise RuntimeError(f"the debug log's rounds do not sum to the requests' draft counts {counts}; see {log}")
    return [{"prompt": prompt, "tokens": c["tokens"], "rounds": rs}
            for prompt, c, rs in zip(prompts, completions, rounds)]


def first_difference(x: dict, y: dict) -> str | None:
    """Where two sides' runs of one prompt first differ (None: identical), with the walk margin there."""
    for j, (rx, ry) in enumerate(zip(x["rounds"], y["rounds"])):
        if "drafted" in rx and "drafted" in ry and rx["drafted"] != ry["drafted"]:
            return f"round {j}: drafts {rx['drafted']} against {ry['drafted']}"
        counts = (rx["proposed"], rx["accepted"]), (ry["proposed"], ry["accepted"])
        if counts[0] != counts[1]:
            return f"round {j}: (proposed, accepted) {counts[0]} against {counts[1]}" + margin_note(rx, ry)
    if len(x["rounds"]) != len(y["rounds"]) or x["tokens"] != y["tokens"]:
        return f"outputs or round counts ({len(x['rounds'])}, {len(y['rounds'])}) differ"
    return None


def margin_note(rx: dict, ry: dict) -> str:
    """The walk margin of the first slot where two drafts of equal length must differ (the one after the shorter
    accepted prefix), from the side that recorded margins."""
    margins = rx.get("margins") or ry.get("margins")
    slot = min(rx["accepted"], ry["accepted"])  # 0-based: slots before it were accepted on both sides
    if margins is None or rx["proposed"] != ry["proposed"] or slot >= rx["proposed"]:
        return ""
    return f"; walk margin at slot {slot + 1}: {margins[slot]:.4f}" + (" (a near tie)" if margins[slot] < TIE else "")


def compare(a: dict, b: dict) -> tuple[bool, list[str]]:
    """Whether two sides agree on every prompt's output and rounds; a line per prompt."""
    if [p["prompt"] for p in a["prompts"]] != [p["prompt"] for p in b["prompts"]]:
        return False, ["the two sides ran different prompts"]
    found = [first_difference(x, y) for x, y in zip(a["prompts"], b["prompts"])]
    lines = [f"prompt {i}: " + (where or f"identical, {len(x['rounds'])} rounds")
             for i, (where, x) in enumerate(zip(found, a["prompts"]))]
    return all(where is None for where in found), lines


def held_out_prompts(count: int, length: int) -> list[list[int]]:
    """Prompts from the demo pair's held-out prose and code files (its eval sets), encoded by its tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_DIR / "target"))
    texts = [json.loads(line)["turns"][0] for name in ("eval_code.jsonl", "eval_prose.jsonl")
             for line in (DEMO_DIR / name).read_text().splitlines()]
    return [tokenizer.encode(text)[:length] for text in texts[:count]]


def run_side(args: argparse.Namespace) -> dict:
    prompts = held_out_prompts(args.prompts, args.prompt_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        draft = args.draft if args.perturb == "none" else perturbed_draft(args.draft, args.perturb, Path(tmp) / "d")
        if args.llama:
            runs = llama_side(args.target, draft, prompts, args.max_new, Path(tmp) / "gguf")
        else:
            runs = dspark_side(args.target, draft, prompts, args.max_new)
    return {"side": "llama.cpp" if args.llama else "dspark", "draft": str(args.draft), "perturb": args.perturb,
            "max_new": args.max_new, "prompts": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=DEMO_DIR / "target")
    parser.add_argument("--draft", type=Path, default=REPO / "build" / "dflash2-demo" / "draft")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--perturb", choices=("none", *PERTURBED), default="none")
    parser.add_argument("--llama", action="store_true", help="llama-server's side (the llama.cpp b11434 build)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        same, lines = compare(*(json.loads(p.read_text()) for p in args.compare))
        print("\n".join(lines))
        return 0 if same else 1
    torch.set_num_threads(2)
    text = json.dumps(run_side(args), indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
