"""`dspark regen` against the real llama.cpp `llama-server` (b11434) on the demo target: the ids it stores decode
with the demo tokenizer to the text it returned, and at temperature 0 they are the target's own greedy continuation
(dspark's `Pair.baseline`) of the prompt ids it stores; a second turn is sent the first regenerated reply, an
interrupted run keeps its records and `--resume` completes the rest, and `dspark train`'s reader takes the ids as
they are. Skipped when the build is absent (scripts/build_llamacpp.sh; CI builds it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from llama_server import demo_ggufs, llama_server, needs_llamacpp  # noqa: F401 (demo_ggufs is a fixture)

from dspark_cli.runtime.demo import DEMO_DIR
from dspark_cli.runtime.pair import Pair, load_tokenizer
from dspark_cli.runtime.train.data import load_token_stream

pytestmark = needs_llamacpp
ROOT = Path(__file__).resolve().parents[2]


def regen(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dspark_cli", "regen", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_regen_on_llama_server(demo_ggufs, tmp_path):
    target, _ = demo_ggufs
    code = [json.loads(line)["turns"][0] for line in (DEMO_DIR / "eval_code.jsonl").read_text().splitlines()][:7]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["def parse(text):", "    return"]}) + "\n"
                       + "".join(json.dumps({"turns": [turn]}) + "\n" for turn in code))
    out = tmp_path / "regen.jsonl"
    with llama_server(target, slots=1) as url:
        args = [str(prompts), "-o", str(out), "--url", url, "--max-tokens", "32", "--concurrency", "1"]
        first = regen(*args)
        deadline = time.monotonic() + 120
        while not (out.is_file() and out.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        first.send_signal(signal.SIGINT)
        _, stderr = first.communicate(timeout=60)
        assert first.returncode == 130, stderr
        kept = out.read_text()
        assert f"{out} keeps {kept.count(chr(10))} conversations regenerated" in " ".join(stderr.split())
        assert "continue with --resume" in stderr
        assert 2 <= kept.count("\n") < 8
        second = regen(*args, "--resume")
        _, stderr = second.communicate(timeout=300)
        assert second.returncode == 0, stderr
        greedy = tmp_path / "greedy.jsonl"
        third = regen(str(prompts), "-o", str(greedy), "--url", url, "--max-tokens", "32", "--temperature", "0")
        _, stderr = third.communicate(timeout=300)
        assert third.returncode == 0, stderr
    assert out.read_text().startswith(kept)  # the finished records stay as they were
    done = records(out)
    assert sorted(r["index"] for r in done) == list(range(8))
    tokenizer = load_tokenizer(str(DEMO_DIR / "target"))
    for record in done:
        assert record["settings"]["api"] == "llamacpp" and record["settings"]["max_tokens"] == 32
        for turn in record["turns"]:
            assert tokenizer.decode(turn["token_ids"], skip_special_tokens=True) == turn["text"]
            assert 1 <= len(turn["token_ids"]) <= 32
            if turn["finish_reason"] == "stop":  # the end-of-text token, returned with the ids
                assert turn["token_ids"][-1] == tokenizer.eos_token_id
            else:
                assert turn["finish_reason"] == "length" and len(turn["token_ids"]) == 32
        assert record["token_ids"] == record["turns"][-1]["prompt_token_ids"] + record["turns"][-1]["token_ids"]
    two_turns = next(r for r in done if r["index"] == 0)
    first_reply, second_prompt = two_turns["turns"][0]["text"], two_turns["turns"][1]["prompt_token_ids"]
    # llama.cpp's ChatML default (the demo GGUF has no template), the regenerated reply inside the next prompt
    assert tokenizer.decode(second_prompt) == ("<|im_start|>user\ndef parse(text):<|im_end|>\n<|im_start|>assistant\n"
                                               f"{first_reply}<|im_end|>\n<|im_start|>user\n    return<|im_end|>\n"
                                               "<|im_start|>assistant\n")
    stream = load_token_stream([out], tokenizer).tokens.tolist()
    assert stream == [i for r in done for i in r["token_ids"] + [tokenizer.eos_token_id]]
    # at temperature 0 the stored ids are the target's own greedy continuation of the stored prompt ids
    pair = Pair.check(str(DEMO_DIR / "target"), str(DEMO_DIR / "draft"), device="cpu", temperature=0.0).load(
        progress=False)
    for record in sorted(records(greedy), key=lambda r: r["index"])[:3]:
        for turn in record["turns"]:
            ours = pair.baseline(turn["prompt_token_ids"], max_new_tokens=32, stop_ids=()).tokens
            assert turn["token_ids"] == list(map(int, ours))
