"""DSpark or DFlash2 on the demo target: the comparison of docs/formats-other.md §7.6, from one run.

    python benchmarks/dflash2_vs_dspark.py [--dflash2 build/dflash2-demo/draft --runs build/dflash2-demo/eval] [--support]

1. Acceptance: reads the four `dspark eval` run files in RUNS (dspark_T0.json, dspark_T1.json, dflash2_T0.json,
   dflash2_T1.json: the demo's two held-out prompt sets, 128 new tokens each, block 7) and prints τ with its 95%
   interval and the acceptance at each position j (share of rounds accepting more than j drafts), per temperature.
2. Draft cost per round, measured here for both drafts in the same process, interleaved: the draft's parallel pass
   (DFlash2's includes its convolutions) plus its sequential stage (DSpark's Markov walk, DFlash2's selector and its
   walk), the median over ROUNDS rounds at contexts of 100-199 tokens of the standard library's json.decoder source,
   T = 0, float32, and the ratio DFlash2 / DSpark. The target's verify pass is the same for both and left out.
3. What caps acceptance at T = 1 (`--support`): decoding 12 held-out prompts at T = 1 with each draft, every scored
   position's acceptance probability sum_x min(p(x), q(x)) next to the target's mass on q's support (DFlash2's q is
   its selector row, -inf outside the k candidates; DSpark's spans the draft vocabulary), observed around
   decode/speculative.accept_block (decoding unchanged).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from dspark_cli.runtime.decode.speculative import Drafter, draft_backbone, markov_stage  # noqa: E402
from dspark_cli.runtime.demo import DEMO_DIR  # noqa: E402
from dspark_cli.runtime.model.draft import DraftContext  # noqa: E402


def acceptance(runs: Path) -> None:
    print("| draft | T | τ | 95% CI | rounds | acceptance at j = 0..6 |")
    print("|---|---|---|---|---|---|")
    for temperature in (0, 1):
        for name in ("dspark", "dflash2"):
            run = json.loads((runs / f"{name}_T{temperature}.json").read_text())["statistics"]["all"]
            summary = run["summary"]
            ci = " – ".join(f"{x:.2f}" for x in run["tau_ci"])
            accept = " ".join(f"{x:.2f}" for x in summary["acceptance_unconditional"])
            print(f"| {name} | {temperature} | {run['tau']:.2f} | {ci} | {summary['rounds']} | {accept} |")


def draft_cost(dflash2: Path, rounds: int) -> None:
    from dspark_cli.runtime.pair import Pair

    pairs = {"dspark": Pair.load(DEMO_DIR / "target", DEMO_DIR / "draft", device="cpu", dtype="float32"),
             "dflash2": Pair.load(DEMO_DIR / "target", dflash2, device="cpu", dtype="float32")}
    text = Path(json.__file__).with_name("decoder.py").read_text()  # a standard-library file: the demo's kind of text
    prompt = torch.tensor(pairs["dspark"].encode(text, chat=False)[:201])
    drafters, contexts = {}, {}
    for name, pair in pairs.items():
        drafters[name] = Drafter.of(pair.draft, pair.settings, pair.target.vocab_size)
        _, features = pair.target.prefill(prompt)  # [P, n*Ht]
        contexts[name] = (pair.draft, features)
    times = {name: [] for name in pairs}
    for i in range(rounds):
        length = 100 + i % 100  # the context before the anchor
        for name in pairs:  # interleaved: both drafts see the same load
            draft, features = contexts[name]
            context = DraftContext(draft, length + 16)
            context.append(draft, features[:length])
            started = time.perf_counter()
            hidden, base = draft_backbone(drafters[name], context, int(prompt[length]), 7)
            markov_stage(drafters[name], hidden, base, int(prompt[length]), None)
            times[name].append(1000 * (time.perf_counter() - started))
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, ms in medians.items():
        print(f"{name}: draft pass + sequential stage {ms:.2f} ms per round (median of {rounds})")
    print(f"DFlash2 / DSpark draft cost per round: {medians['dflash2'] / medians['dspark']:.2f}x")


def support_bound(dflash2: Path, tokens: int = 64) -> None:
    from dspark_cli.runtime.decode import sampling, speculative
    from dspark_cli.runtime.measure.evaluation import read_prompt_set
    from dspark_cli.runtime.pair import Pair

    seen: dict[str, list[float]] = {"first": [], "first_cap": [], "all": [], "all_cap": []}
    accept_block = speculative.accept_block

    def observed(proposal, drafted, logits, params, generator):
        n_scored = logits.shape[0] - 1
        q = proposal.draft_probs[:n_scored]  # [n, V]
        p = sampling.target_probs(logits, params)[:n_scored]  # [n, V]
        accept, cap = torch.minimum(p, q).sum(-1), (p * (q > 0)).sum(-1)  # [n], [n]
        seen["first"].append(float(accept[0]))
        seen["first_cap"].append(float(cap[0]))
        seen["all"] += accept.tolist()
        seen["all_cap"] += cap.tolist()
        return accept_block(proposal, drafted, logits, params, generator)

    sets = [read_prompt_set(DEMO_DIR / f"eval_{name}.jsonl").prompts[:6] for name in ("prose", "code")]
    speculative.accept_block = observed
    try:
        for name, draft in (("dspark", DEMO_DIR / "draft"), ("dflash2", dflash2)):
            for values in seen.values():
                values.clear()
            pair = Pair.load(DEMO_DIR / "target", draft, device="cpu", dtype="float32", temperature=1.0)
            for i, prompt in enumerate(sets[0] + sets[1]):
                pair.generate(prompt, max_new_tokens=tokens, seed=i)
            mean = {key: statistics.fmean(values) for key, values in seen.items()}
            print(f"{name} at T = 1: first drafted position: acceptance probability {mean['first']:.3f}, target mass "
                  f"on q's support {mean['first_cap']:.3f} ({len(seen['first'])} rounds); every scored position: "
                  f"{mean['all']:.3f} / {mean['all_cap']:.3f}")
    finally:
        speculative.accept_block = accept_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dflash2", type=Path, default=ROOT / "build" / "dflash2-demo" / "draft")
    parser.add_argument("--runs", type=Path, default=ROOT / "build" / "dflash2-demo" / "eval")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--support", action="store_true", help="also part 3: what caps acceptance at T = 1")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    acceptance(args.runs)
    draft_cost(args.dflash2, args.rounds)
    if args.support:
        support_bound(args.dflash2)


if __name__ == "__main__":
    main()
