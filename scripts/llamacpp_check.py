"""The demo pair on the real llama.cpp (b11434) and on dspark: same prompts, greedy, same token ids?

Converts the demo pair with `dspark convert --to gguf`'s library half (the target and the draft, the demo's or
`--draft FOLDER` for the demo target, a DFlash2 draft among them; scripts/llamacpp_server.py does both and starts the
server), starts `llama-server` twice (the target alone, then with the draft under the flags of engines/llamacpp.py:
`--spec-type draft-dspark`, or `draft-dflash` for a DFlash2 draft). The target's server tokenizes each
prompt's text (/tokenize, no special tokens), compared with the HF tokenizer's ids; each prompt is then sent as
token ids (temperature 0, ignore_eos, a fixed n_predict, return_tokens) and the completions' token ids are compared
with the target alone in dspark (`Pair.baseline`, what `dspark generate --baseline` runs) and with `Pair.generate`
(greedy, no stop token) on the same ids. Acceptance: llama.cpp's timings.draft_n_accepted / draft_n (tools/server/
server-common.cpp); dspark's accepted / proposed draft tokens over all rounds.

    python scripts/llamacpp_check.py [--bin-dir DIR] [--draft FOLDER] [--prompts 8] [--n-predict 64] [--json F]

Exit code 0 when every prompt tokenized alike and gave identical tokens in all four runs, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

import llamacpp_server
from llamacpp_server import dspark_spec_args, llama_server, pair_gguf


# Texts that tell pre-tokenizers apart (contractions, digit runs, whitespace runs before letters and at the end,
# newlines, accents, CJK, punctuation runs), tokenized besides the prompts.
SPLIT_TEXTS = [
    "I'm sure you've seen it, haven't you? THEY'LL say 'no'.",
    "x = 1234567 + 89;\n\n\tif (a>=b) {return -0.5e10;}",
    "  leading, inner   spaces and trailing   ",
    "naïve café, Ünïcödé — 日本語のテキスト 한국어!!!",
    "line one\r\nline two\n\n\n    indented\n",
]


def demo_prompts(count: int) -> list[str]:
    """The first prompts of the demo's eval sets, code and prose alternating."""
    from dspark_cli.runtime.demo import DEMO_DIR

    sets = [[json.loads(line)["turns"][0] for line in (DEMO_DIR / name).read_text().splitlines() if line.strip()]
            for name in ("eval_code.jsonl", "eval_prose.jsonl")]
    return [sets[i % 2][i // 2] for i in range(count)]


def post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def tokenize(url: str, text: str) -> list[int]:
    return post(url, "/tokenize", {"content": text, "add_special": False})["tokens"]


def complete(url: str, ids: list[int], n_predict: int) -> dict:
    body = {"prompt": ids, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "return_tokens": True, "cache_prompt": False, "seed": 0}
    return post(url, "/completion", body)


def run_llamacpp(server: Path, target: Path, draft: Path | None, prompts: list[list[int]], n_predict: int,
                 log: Path, texts: list[str] = (), spec: list[str] | None = None) -> tuple[list[dict], list[list[int]]]:
    """The completions of the prompts' ids (the draft under `spec`, its speculative flags), and llama.cpp's ids for
    `texts`."""
    with llama_server(target, draft, log=log, server=server, spec=spec) as url:
        return [complete(url, ids, n_predict) for ids in prompts], [tokenize(url, text) for text in texts]


def run_dspark(prompts: list[list[int]], n_predict: int, draft: Path) -> list[dict]:
    from dspark_cli.runtime.demo import DEMO_DIR
    from dspark_cli.runtime.pair import Pair

    pair = Pair.check(str(DEMO_DIR / "target"), str(draft), device="cpu", temperature=0.0).load(progress=False)
    out = []
    for ids in prompts:
        result = pair.generate(ids, max_new_tokens=n_predict, stop_ids=())
        baseline = pair.baseline(ids, max_new_tokens=n_predict, stop_ids=())
        rounds = result.stats.rounds
        out.append({"tokens": list(map(int, result.tokens)), "baseline": list(map(int, baseline.tokens)),
                    "proposed": sum(r.proposed for r in rounds), "accepted": sum(r.accepted for r in rounds),
                    "rounds": len(rounds)})
    return out


def report(prompts, plain, spec, ours, llamacpp_ids, split_ids: list[bool]) -> dict:
    rows = []
    for ids, p, s, d, theirs in zip(prompts, plain, spec, ours, llamacpp_ids):
        timings = s.get("timings", {})
        rows.append({
            "prompt_tokens": len(ids), "llamacpp_prompt_tokens": s.get("tokens_evaluated"),
            "identical_tokenize": theirs == ids,
            "identical_plain_vs_baseline": p["tokens"] == d["baseline"],
            "identical_spec_vs_dspark": s["tokens"] == d["tokens"],
            "identical_plain_vs_spec": p["tokens"] == s["tokens"],
            "identical_plain_vs_dspark": p["tokens"] == d["tokens"],
            "llamacpp_draft_n": timings.get("draft_n", 0),
            "llamacpp_draft_accepted": timings.get("draft_n_accepted", 0),
            "dspark_proposed": d["proposed"], "dspark_accepted": d["accepted"], "dspark_rounds": d["rounds"],
        })

    def rate(accepted: str, proposed: str) -> float | None:
        total = sum(row[proposed] for row in rows)
        return sum(row[accepted] for row in rows) / total if total else None

    return {"prompts": rows, "split_texts_identical": split_ids,
            "all_identical": all(split_ids) and all(r["identical_tokenize"] and r["identical_plain_vs_baseline"]
                                 and r["identical_spec_vs_dspark"] and r["identical_plain_vs_spec"] for r in rows),
            "acceptance_llamacpp": rate("llamacpp_draft_accepted", "llamacpp_draft_n"),
            "acceptance_dspark": rate("dspark_accepted", "dspark_proposed")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", type=Path, default=llamacpp_server.SERVER.parent)
    parser.add_argument("--draft", type=Path, help="a draft folder for the demo target (default: the demo draft)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n-predict", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from dspark_cli.runtime.demo import DEMO_DIR
    from dspark_cli.runtime.pair import load_tokenizer

    tokenizer = load_tokenizer(str(DEMO_DIR / "target"))
    draft_folder = args.draft or DEMO_DIR / "draft"
    spec = dspark_spec_args(str(draft_folder))
    texts = demo_prompts(args.prompts)
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = args.bin_dir / "llama-server"
        target, draft = pair_gguf(DEMO_DIR / "target", draft_folder, work)
        plain, llamacpp_ids = run_llamacpp(server, target, None, prompts, args.n_predict, work / "plain.log",
                                           texts + SPLIT_TEXTS)
        drafted, _ = run_llamacpp(server, target, draft, prompts, args.n_predict, work / "spec.log", spec=spec)
    split_ids = [theirs == tokenizer.encode(text, add_special_tokens=False)
                 for text, theirs in zip(SPLIT_TEXTS, llamacpp_ids[len(texts):])]
    ours = run_dspark(prompts, args.n_predict, draft_folder)
    result = report(prompts, plain, drafted, ours, llamacpp_ids[:len(texts)], split_ids)
    result["spec_args"] = spec
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if result["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
