"""The demo pair on the real llama.cpp (b11434) and on dspark: same prompts, greedy, same token ids?

Converts the demo pair (the draft with `dspark convert --to gguf`'s library half, the target with
scripts/convert_target_llamacpp.py), starts `llama-server` twice (the target alone, then with the draft under
`--spec-type draft-dspark`, the argv of engines/llamacpp.py), sends each prompt as token ids (temperature 0,
ignore_eos, a fixed n_predict, return_tokens) and compares the completions' token ids with `Pair.generate` (greedy,
no stop token) on the same ids. Acceptance: llama.cpp's timings.draft_n_accepted / draft_n (tools/server/
server-common.cpp); dspark's accepted / proposed draft tokens over all rounds.

    python scripts/llamacpp_check.py [--bin-dir DIR] [--prompts 8] [--n-predict 64] [--json report.json]

Exit code 0 when every prompt gave identical tokens in all three runs, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
CACHE = Path(os.environ.get("DSPARK_LLAMACPP_CACHE", Path.home() / ".cache/dspark/llama.cpp-b11434"))


def demo_prompts(count: int) -> list[str]:
    """The first prompts of the demo's eval sets, code and prose alternating."""
    from dspark_cli.runtime.demo import DEMO_DIR

    sets = [[json.loads(line)["turns"][0] for line in (DEMO_DIR / name).read_text().splitlines() if line.strip()]
            for name in ("eval_code.jsonl", "eval_prose.jsonl")]
    return [sets[i % 2][i // 2] for i in range(count)]


def convert_pair(work: Path) -> tuple[Path, Path]:
    from dspark_cli.runtime.convert.gguf import convert_to_gguf
    from dspark_cli.runtime.demo import DEMO_DIR

    target, draft = work / "target.gguf", work / "draft.gguf"
    subprocess.run([sys.executable, str(ROOT / "scripts/convert_target_llamacpp.py"), str(DEMO_DIR / "target"),
                    str(target), "--llamacpp-src", str(CACHE / "src")], check=True, capture_output=True)
    convert_to_gguf(str(DEMO_DIR / "draft"), draft, target=str(DEMO_DIR / "target"))
    return target, draft


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def llama_server(argv: list[str], log: Path):
    """Start llama-server on a free port, wait for /health, yield its URL, stop it."""
    port = free_port()
    with open(log, "w") as handle:
        process = subprocess.Popen(argv + ["--port", str(port), "--host", "127.0.0.1", "-t", "2", "-c", "2048",
                                           "-np", "1"], stdout=handle, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, log)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"llama-server did not become healthy in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def complete(url: str, ids: list[int], n_predict: int) -> dict:
    body = {"prompt": ids, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "return_tokens": True, "cache_prompt": False, "seed": 0}
    request = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def run_llamacpp(argv: list[str], prompts: list[list[int]], n_predict: int, log: Path) -> list[dict]:
    with llama_server(argv, log) as url:
        return [complete(url, ids, n_predict) for ids in prompts]


def run_dspark(prompts: list[list[int]], n_predict: int) -> list[dict]:
    from dspark_cli.runtime.demo import DEMO_DIR
    from dspark_cli.runtime.pair import Pair

    pair = Pair.check(str(DEMO_DIR / "target"), str(DEMO_DIR / "draft"), device="cpu", temperature=0.0).load(
        progress=False)
    out = []
    for ids in prompts:
        result = pair.generate(ids, max_new_tokens=n_predict, stop_ids=())
        rounds = result.stats.rounds
        out.append({"tokens": list(map(int, result.tokens)), "proposed": sum(r.proposed for r in rounds),
                    "accepted": sum(r.accepted for r in rounds), "rounds": len(rounds)})
    return out


def report(prompts, plain, spec, ours) -> dict:
    rows = []
    for ids, p, s, d in zip(prompts, plain, spec, ours):
        timings = s.get("timings", {})
        rows.append({
            "prompt_tokens": len(ids), "llamacpp_prompt_tokens": s.get("tokens_evaluated"),
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

    return {"prompts": rows,
            "all_identical": all(r["identical_spec_vs_dspark"] and r["identical_plain_vs_spec"] for r in rows),
            "acceptance_llamacpp": rate("llamacpp_draft_accepted", "llamacpp_draft_n"),
            "acceptance_dspark": rate("dspark_accepted", "dspark_proposed")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", type=Path, default=CACHE / "build" / "bin")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n-predict", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from dspark_cli.runtime.demo import DEMO_DIR
    from dspark_cli.runtime.engines import engine
    from dspark_cli.runtime.engines.seam import ServeRequest
    from dspark_cli.runtime.pair import load_tokenizer

    tokenizer = load_tokenizer(str(DEMO_DIR / "target"))
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in demo_prompts(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        target, draft = convert_pair(work)
        plan = engine("llamacpp").plan(ServeRequest(target=str(DEMO_DIR / "target"), draft=str(DEMO_DIR / "draft")))
        server = str(args.bin_dir / "llama-server")
        spec_argv = [server, "-m", str(target), "-md", str(draft)] + plan.argv[5:]  # dspark's flags, these files
        plain = run_llamacpp([server, "-m", str(target)], prompts, args.n_predict, work / "plain.log")
        spec = run_llamacpp(spec_argv, prompts, args.n_predict, work / "spec.log")
    result = report(prompts, plain, spec, run_dspark(prompts, args.n_predict))
    result["spec_argv"] = spec_argv
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if result["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
