"""The demo pair on a real llama.cpp b11434 build (scripts/build_llamacpp.sh), both GGUF files written by dspark
convert: llama-server tokenizes as the HF tokenizer, its target alone emits `Pair.baseline`'s greedy tokens, and
with --spec-type draft-dspark the same tokens as the target alone and as `Pair.generate`
(scripts/llamacpp_check.py). Skipped when the build is not there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("DSPARK_LLAMACPP_CACHE", Path.home() / ".cache/dspark/llama.cpp-b11434"))
SERVER = CACHE / "build" / "bin" / "llama-server"

pytestmark = pytest.mark.skipif(not SERVER.is_file(), reason=f"no llama.cpp build at {SERVER}: run "
                                "scripts/build_llamacpp.sh (or set DSPARK_LLAMACPP_CACHE to where it built)")


def test_llamacpp_matches_dspark(tmp_path):
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts/llamacpp_check.py"), "--prompts", "8",
                          "--n-predict", "48", "--json", str(out)], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.is_file(), run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert all(report["split_texts_identical"])  # a wrong tokenizer.ggml.pre (qwen2, llama-bpe, default) fails here
    for row in report["prompts"]:
        assert row["llamacpp_prompt_tokens"] == row["prompt_tokens"] and row["identical_tokenize"], row
        assert row["identical_plain_vs_baseline"], row
        assert row["identical_plain_vs_spec"] and row["identical_spec_vs_dspark"], row
    # Measured at b11434 with dspark's target GGUF (48 tokens): llama.cpp 241/890 = 0.271, dspark 261/945 = 0.276,
    # as with llama.cpp's converter before. Target layers written without the +1 (DeepSpec ids as llama.cpp's)
    # still give identical tokens (verification is lossless) but 0.250 in llama.cpp.
    assert abs(report["acceptance_llamacpp"] - report["acceptance_dspark"]) < 0.015
    assert run.returncode == 0


def _split(regex: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}


@pytest.mark.parametrize(("regex", "ignore_merges", "pre"), [("QWEN2_REGEX", False, "qwen2"),
                                                             ("LLAMA3_REGEX", True, "llama-bpe")])
def test_pre_tokenizer_named_by_regex_tokenizes_as_hf(tmp_path, regex, ignore_merges, pre):
    """The demo target with its tokenizer.json re-split by a real Qwen3's (Llama 3's) regex: dspark names it qwen2
    (llama-bpe), and llama-server's /tokenize equals the HF tokenizer's ids on texts that tell them apart."""
    import shutil

    from tokenizers import Tokenizer

    from dspark_cli.runtime.convert import gguf_vocab
    from dspark_cli.runtime.convert.target_gguf import convert_target_to_gguf
    from dspark_cli.runtime.demo import DEMO_DIR

    sys.path.insert(0, str(ROOT / "scripts"))
    from llamacpp_check import SPLIT_TEXTS, demo_prompts, tokenize
    from llamacpp_server import llama_server

    target = tmp_path / "target"
    shutil.copytree(DEMO_DIR / "target", target)
    data = json.loads((target / "tokenizer.json").read_text())
    data["pre_tokenizer"] = _split(getattr(gguf_vocab, regex))
    data["model"]["ignore_merges"] = ignore_merges
    (target / "tokenizer.json").write_text(json.dumps(data))
    summary = convert_target_to_gguf(str(target), tmp_path / "t.gguf")
    assert summary["pre_tokenizer"] == pre
    hf = Tokenizer.from_file(str(target / "tokenizer.json"))
    texts = SPLIT_TEXTS + demo_prompts(4)
    with llama_server(tmp_path / "t.gguf", server=SERVER) as url:
        for text in texts:
            assert tokenize(url, text) == hf.encode(text, add_special_tokens=False).ids, text


def test_qwen2_target_greedy_equals_transformers(tmp_path):
    """A tiny random Qwen2 (float32, Q/K/V biases, untied head, the demo tokenizer) as dspark's qwen2 GGUF:
    llama-server's greedy tokens equal transformers' on the demo prompts. llama.cpp runs with an F32 KV cache and
    without flash attention (its CPU flash attention rounds to F16): with the defaults, one prompt of eight flips
    a 0.006-logit near-tie."""
    import torch

    from dspark_cli.runtime.convert.target_gguf import convert_target_to_gguf
    from dspark_cli.runtime.pair import load_tokenizer

    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    sys.path.insert(0, str(ROOT / "scripts"))
    from llamacpp_check import complete, demo_prompts
    from llamacpp_server import llama_server
    from target_factory import tiny_qwen2

    model, folder = tiny_qwen2(tmp_path / "qwen2")
    assert convert_target_to_gguf(str(folder), tmp_path / "t.gguf")["architecture"] == "qwen2"
    tokenizer = load_tokenizer(str(folder))
    with llama_server(tmp_path / "t.gguf", server=SERVER, extra=["-ctk", "f32", "-ctv", "f32", "-fa", "off"]) as url:
        for text in demo_prompts(8):
            ids = tokenizer.encode(text, add_special_tokens=False)
            with torch.no_grad():
                ours = model.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
            assert complete(url, ids, 24)["tokens"] == ours[0, len(ids):].tolist(), text


def test_dflash2_draft_in_llamacpp_matches_dspark(tmp_path):
    """A DFlash2 draft for the demo target (random weights, tests/fixtures/dflash2_hf.py) as dspark's GGUF under
    llama.cpp's draft-dflash (scripts/llamacpp_check.py --draft): llama-server drafts with it and its tokens equal the
    target alone, dspark's baseline and dspark's DFlash2 drafting; the acceptance rates agree within 0.03."""
    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    from dflash2_hf import write_dflash2_draft

    draft, out = write_dflash2_draft(tmp_path / "dflash2"), tmp_path / "report.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts/llamacpp_check.py"), "--draft", str(draft), "--prompts",
                          "2", "--n-predict", "16", "--json", str(out)], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.is_file(), run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["spec_args"] == ["--spec-type", "draft-dflash", "--spec-draft-n-max", "7"]
    for row in report["prompts"]:
        assert row["identical_plain_vs_spec"] and row["identical_spec_vs_dspark"], row
        assert row["llamacpp_draft_n"] > 0 and row["dspark_proposed"] > 0, row
    assert abs(report["acceptance_llamacpp"] - report["acceptance_dspark"]) < 0.03
    assert run.returncode == 0
