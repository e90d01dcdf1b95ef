"""DFlash2 drafts and the four engines: validate --engine all's verdicts and each engine's own way of being handed one
(vLLM's dflash method, SGLang's DFLASH algorithm, llama.cpp's draft-dflash spec type; TensorRT-LLM refuses:
DSP741), on a random-weight DFlash2 draft for the demo target (tests/fixtures/dflash2_hf.py)."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from dflash2_hf import write_dflash2_draft
from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.demo import DEMO_DIR
from dspark_cli.runtime.engines import engine
from dspark_cli.runtime.engines.seam import DraftRefused, ServeRequest

runner = CliRunner()
TARGET = DEMO_DIR / "target"


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return write_dflash2_draft(tmp_path_factory.mktemp("dflash2") / "draft")  # block 8: the anchor and 7 masks


def validate_all(draft) -> dict:
    result = runner.invoke(app, ["validate", str(draft), "-t", str(TARGET), "--engine", "all", "--json", "-"])
    doc = json.loads(result.stdout)
    assert result.exit_code == doc["exit_code"] == 0, result.output  # some engine serves it
    return doc["engines"]


def test_validate_engine_all_verdicts(draft):
    got = validate_all(draft)
    assert {name: (v["verdict"], v["codes"]) for name, v in got.items()} == {
        "vllm": ("serves", []), "sglang": ("serves with losses", []),
        "trtllm": ("refuses", ["DSP741"]), "llamacpp": ("serves with losses", [])}
    assert any("DFLASH algorithm" in note for note in got["sglang"]["notes"])
    assert any("walks the selector's lattice greedily" in note for note in got["llamacpp"]["notes"])


def test_each_engine_is_handed_the_draft_under_its_own_method(draft):
    request = ServeRequest(target=str(TARGET), draft=str(draft))
    vllm = engine("vllm").plan(request)
    assert vllm.speculative_config["method"] == "dflash" and vllm.draft_tokens == 7
    assert any("V2 GPU model runner" in note for note in vllm.notes)
    sglang = engine("sglang").plan(request)
    assert sglang.argv[sglang.argv.index("--speculative-algorithm") + 1] == "DFLASH"
    assert sglang.argv[sglang.argv.index("--speculative-num-draft-tokens") + 1] == "8"  # the anchor and 7 masks
    assert "--speculative-dspark-block-size" not in sglang.argv and sglang.draft_tokens == 7
    llamacpp = engine("llamacpp").plan(ServeRequest(target=str(TARGET), draft=str(draft), block_size=5,
                                                    confidence_threshold=0.4))
    assert llamacpp.argv[5:] == ["--spec-type", "draft-dflash", "--spec-draft-n-max", "5", "--spec-draft-p-min",
                                 "0.4"]
    with pytest.raises(DraftRefused) as refused:
        engine("trtllm").plan(request)
    assert [f.code for f in refused.value.findings] == ["DSP741"]


def test_serve_dry_run_names_sglangs_dflash_flags(draft):
    result = runner.invoke(app, ["serve", "-t", str(TARGET), "-d", str(draft), "--engine", "sglang", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["argv"] == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(TARGET.resolve()),
        "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft.resolve()),
        "--speculative-num-draft-tokens", "8"]


def test_sglang_takes_no_sts_file_for_a_dflash2_draft(draft, tmp_path):
    sts = tmp_path / "sts.json"
    sts.write_text(json.dumps({"temperatures": [1.0] * 7}))
    with pytest.raises(DsparkError, match="DFLASH algorithm, which serves DFlash2 drafts, reads no STS"):
        engine("sglang").plan(ServeRequest(target=str(TARGET), draft=str(draft), calibration=str(sts)))


def test_a_lattice_wider_than_the_hidden_size_blocks_llamacpp_only(tmp_path):
    """top_k 16 needs 16·17 = 272 > 256 values per lattice row: llama.cpp's start-up refusal (DSP062); vLLM and
    SGLang have no such limit."""
    got = validate_all(write_dflash2_draft(tmp_path / "d", selector_top_k=16))
    assert got["llamacpp"]["verdict"] == "refuses" and got["llamacpp"]["codes"] == ["DSP062"]
    assert got["vllm"]["verdict"] == "serves" and got["sglang"]["verdict"] == "serves with losses"
