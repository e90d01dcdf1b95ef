"""A hostile sweep of run files and prompt sets as input (issue 22, item 3): every case through real `dspark`
processes, each command that reads a run file (`eval --resume`, `eval --compare`, `calibrate`, `plan`).

    .venv/bin/python benchmarks/sweep_run_files.py

A case passes when the command exits 2 with exactly one `error:` sentence naming the file, prints no traceback and
leaves the input's bytes unchanged. Ends with "N/N OK" (exit 0) or lists the failures (exit 1).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETS = REPO / "src/dspark_cli/runtime/assets/demo"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "src"), "COLUMNS": "300"}
READERS = (["eval", "--resume"], ["eval", "--compare"], ["calibrate", "-o", "{out}"], ["plan"])


def dspark(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark_cli", *args], env=ENV, capture_output=True, text=True,
                          timeout=300)


def first_round(doc: dict) -> dict:
    return doc["results"][0]["rounds"][0]


def tampered(doc: dict) -> dict[str, str]:
    """name -> file text of each hostile run file."""
    def change(fn) -> str:
        copied = copy.deepcopy(doc)
        fn(copied)
        return json.dumps(copied)

    text = json.dumps(doc)
    return {
        "truncated": text[: len(text) // 2],
        "empty": "",
        "not an object": "[1, 2]",
        "nested 100,000 deep": "[" * 100_000 + "]" * 100_000,
        "5,000-digit integer": '{"format": "dspark-eval/2", "settings": {"seed": ' + "7" * 5000 + "}}",
        "not UTF-8": '{"format": "\xff"}',
        "other format": change(lambda d: d.update(format="dspark-eval/99")),
        "missing settings key": change(lambda d: d["settings"].pop("max_new_tokens")),
        "string seed": change(lambda d: d["settings"].update(seed="0")),
        "negative seed": change(lambda d: d["settings"].update(seed=-1)),
        "seed above 2^64": change(lambda d: d["settings"].update(seed=2**64)),
        "boolean block size": change(lambda d: d["settings"].update(block_size=True)),
        "threshold above 1": change(lambda d: d["settings"].update(confidence_threshold=1.5)),
        "unknown settings key": change(lambda d: d["settings"].update(turbo=True)),
        "calibration with T = 0": change(lambda d: d["settings"].update(calibration={"path": "x",
                                                                                      "temperatures": [0.0]})),
        "sets not a list": change(lambda d: d.update(sets={})),
        "prompt not a string": change(lambda d: d["sets"][0]["prompts"].__setitem__(0, 5)),
        "duplicate set name": change(lambda d: d["sets"].append(copy.deepcopy(d["sets"][0]))),
        "result of an unknown set": change(lambda d: d["results"][0].update(set_name="elsewhere")),
        "result lacks tokens": change(lambda d: d["results"][0].pop("tokens")),
        "negative index": change(lambda d: d["results"][0].update(index=-3)),
        "NaN time": change(lambda d: d["results"][0].update(ttft_s=float("nan"))),
        "baseline a list": change(lambda d: d["results"][0].update(baseline=[1])),
        "unknown round key": change(lambda d: first_round(d).update(retries=2)),
        "round not an object": change(lambda d: d["results"][0]["rounds"].__setitem__(0, 7)),
        "accepted above proposed": change(lambda d: first_round(d).update(accepted=first_round(d)["proposed"] + 1)),
        "proposed above drafted": change(lambda d: first_round(d).update(proposed=first_round(d)["drafted"] + 1)),
        "emitted 0": change(lambda d: first_round(d).update(emitted=0, accepted=0)),
        "logits one short": change(lambda d: first_round(d)["confidence_logits"].pop()),
        "logit a string": change(lambda d: first_round(d)["confidence_logits"].__setitem__(0, "high")),
        "time a string": change(lambda d: first_round(d).update(verify="fast")),
        "token a float": change(lambda d: d["results"][0]["tokens"].__setitem__(0, 3.5)),
    }


def hostile_prompt_sets() -> dict[str, str]:
    return {
        "nested 100,000 deep": '{"prompt": "ok"}\n' + "[" * 100_000 + "]" * 100_000 + "\n",
        "5,000-digit integer": '{"prompt": "ok"}\n{"prompt": ' + "9" * 5000 + "}\n",
        "turns nested 150 deep": '{"turns": ' + "[" * 150 + "]" * 150 + "}\n",
        "not UTF-8": '{"prompt": "\xff"}\n',
        "not JSON": "{prompt: x\n",
        "turns of numbers": '{"turns": [1, 2]}\n',
    }


def check(name: str, args: list[str], path: Path, failures: list[str]) -> None:
    before = path.read_bytes() if path.is_file() else None
    result = dspark(*args)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    problems = []
    if result.returncode != 2:
        problems.append(f"exit {result.returncode}")
    if "Traceback" in result.stderr + result.stdout:
        problems.append("traceback")
    if len(errors) != 1:
        problems.append(f"{len(errors)} error lines")
    elif str(path.name) not in errors[0]:
        problems.append("the sentence does not name the file")
    if before is not None and path.read_bytes() != before:
        problems.append("the input changed")
    if problems:
        failures.append(f"{name} ({' '.join(args[:2])}): {', '.join(problems)}: {result.stderr.strip()[-300:]}")


def main() -> int:
    failures: list[str] = []
    total = 0
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        good = folder / "good.json"
        made = dspark("eval", "--data", str(SETS / "eval_code.jsonl"), "--limit", "2", "--max-new-tokens", "8",
                      "--json", str(good))
        if made.returncode != 0:
            print(made.stderr)
            return 1
        doc = json.loads(good.read_text())
        for index, (name, text) in enumerate(tampered(doc).items()):
            path = folder / f"run{index}.json"
            path.write_bytes(text.encode("utf-8", "surrogateescape") if name != "not UTF-8" else b'{"f": "\xff"}')
            for reader in READERS:
                args = [arg.replace("{out}", str(folder / "sts.json")) for arg in reader] + [str(path)]
                total += 1
                check(f"run file: {name}", args, path, failures)
        for index, (name, text) in enumerate(hostile_prompt_sets().items()):
            path = folder / f"set{index}.jsonl"
            path.write_bytes(text.encode() if name != "not UTF-8" else b'{"prompt": "\xff"}\n')
            total += 1
            check(f"prompt set: {name}", ["eval", "--data", str(path)], path, failures)
    for failure in failures:
        print("FAIL", failure)
    print(f"{total - len(failures)}/{total} OK")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
