"""What each engine does with a draft whose Linear layers are ModelOpt-quantized (`dspark quantize --scope draft`),
from its source (docs/engines.md): vLLM refuses quantized q/k/v (DSP731, its context-K/V precompute multiplies
qkv_proj.weight densely) and a quantized lm_head (DSP732), SGLang quantized q/k/v (DSP705), TensorRT-LLM quantized
q/k/v or fc (DSP712); llama.cpp serves the GGUF dspark convert writes dequantized (a note). validate's default view
(vLLM) and serve refuse the same way; every engine code is documented in docs/engines.md.

Mutations checked: vllm.quantized_layer_findings without the DSP731 branch fails test_verdicts_on_the_quantized_demo;
LinearQuantization.covers answering True for every layer fails test_a_quantized_fc_alone (vLLM would refuse DSP731,
SGLang DSP705); llamacpp.quantized_layer_notes without the FP8 input-scale clause fails
test_verdicts_on_the_quantized_demo."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_factory import DraftSpec, write_fp8_draft, write_target_config
from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
from dspark_cli.runtime.checkpoint.rules import validate_checkpoint
from dspark_cli.runtime.checkpoint.rules.codes import ENGINE_CODES
from dspark_cli.runtime.engines import ENGINES, engine
from dspark_cli.runtime.engines.seam import DraftRefused, ServeRequest, draft_config
from quantized_demo import TARGET, quantized_demo  # noqa: F401 (a fixture)

runner = CliRunner()
DOCS = Path(__file__).resolve().parents[2] / "docs" / "engines.md"


def verdicts(draft, target=TARGET):
    ckpt = open_checkpoint(str(draft))
    report = validate_checkpoint(ckpt, read_target_config(str(target)))
    assert report.errors == []  # the engines' rules alone decide
    config = draft_config(ckpt, report)
    return {name: e.verdict(report, config) for name, e in ENGINES.items()}


EXPECTED = {
    "nvfp4": {"vllm": ["DSP731"], "sglang": ["DSP705"], "trtllm": ["DSP712"], "llamacpp": []},
    "nvfp4_head": {"vllm": ["DSP731", "DSP732"], "sglang": ["DSP705"], "trtllm": ["DSP712"], "llamacpp": []},
    "fp8": {"vllm": ["DSP731"], "sglang": ["DSP705"], "trtllm": ["DSP712"], "llamacpp": []},
    "nvfp4_vllm": {"vllm": [], "sglang": [], "trtllm": ["DSP712"], "llamacpp": []},  # quantize's default
}


@pytest.mark.parametrize("kind", EXPECTED)
def test_verdicts_on_the_quantized_demo(quantized_demo, kind):
    got = verdicts(quantized_demo[kind])
    assert {name: [f.code for f in v.refused] for name, v in got.items()} == EXPECTED[kind]
    assert got["llamacpp"].status == "serves with losses"
    note = next(n for n in got["llamacpp"].notes if "dequantized" in n)
    assert ("input scales are dropped" in note) == (kind == "fp8")
    assert all("qwen3_dflash.py" in f.message for f in got["vllm"].refused)  # the file that says why


def test_a_quantized_fc_alone(tmp_path):
    """fc in FP8, every other layer bf16: vLLM builds fc with the draft's quant_config (serves), SGLang's versions
    differ for fc (a note, not verified), TensorRT-LLM rebuilds fc as a plain nn.Linear (DSP712)."""
    spec = DraftSpec(markov_rank=64)
    got = verdicts(write_fp8_draft(tmp_path / "d", spec), write_target_config(tmp_path / "t", spec))
    assert {name: [f.code for f in v.refused] for name, v in got.items()} == {
        "vllm": [], "sglang": [], "trtllm": ["DSP712"], "llamacpp": []}
    assert got["vllm"].status == "serves"
    assert any("not verified" in n and "not q/k/v" in n for n in got["sglang"].notes)


def test_a_config_that_names_no_layers_counts_every_layer(tmp_path):
    """hf_quant_config.json alone (no quantization_config in config.json): vLLM's loader claims every layer it does
    not exclude, so q/k/v count as quantized."""
    spec = DraftSpec(markov_rank=64)
    draft = write_fp8_draft(tmp_path / "d", spec)
    config = json.loads((draft / "config.json").read_text())
    del config["quantization_config"]
    (draft / "config.json").write_text(json.dumps(config))
    ckpt = open_checkpoint(str(draft))
    report = validate_checkpoint(ckpt, read_target_config(str(write_target_config(tmp_path / "t", spec))))
    got = engine("vllm").verdict(report, draft_config(ckpt, report))
    assert "DSP731" in [f.code for f in got.refused]


def test_validate_and_serve_refuse_for_vllm(quantized_demo):
    draft = quantized_demo["fp8"]
    plain = runner.invoke(app, ["validate", str(draft), "-t", str(TARGET), "--json", "-"])
    doc = json.loads(plain.stdout)
    assert plain.exit_code == doc["exit_code"] == 1 and doc["engines"]["vllm"]["codes"] == ["DSP731"]
    every = runner.invoke(app, ["validate", str(draft), "-t", str(TARGET), "--engine", "all"])
    assert every.exit_code == 0 and "served by llama.cpp" in every.output  # llama.cpp serves the GGUF
    with pytest.raises(DraftRefused):
        engine("vllm").plan(ServeRequest(str(TARGET), str(draft)))
    served = runner.invoke(app, ["serve", "-t", str(TARGET), "-d", str(draft), "--engine", "sglang", "--dry-run"])
    assert served.exit_code == 1 and "DSP705" in served.output
    plan = engine("llamacpp").plan(ServeRequest(str(TARGET), str(draft)))
    assert plan.draft_quantization == "FP8 in the folder, dequantized in the GGUF"


def test_the_unquantized_demo_gets_no_quantization_codes(quantized_demo):
    from quantized_demo import DRAFT

    got = verdicts(DRAFT)
    assert not [f.code for v in got.values() for f in v.refused]
    plain = runner.invoke(app, ["validate", str(DRAFT), "-t", str(TARGET), "--json", "-"])
    assert plain.exit_code == 0 and "engines" not in json.loads(plain.stdout)


def test_every_engine_code_is_documented_with_its_engine():
    rows = dict(re.findall(r"^\| `(DSP7\d\d)` \| ([^|]+?) \|", DOCS.read_text(), flags=re.M))
    assert rows == {code: label for code, (label, _, _) in ENGINE_CODES.items()}
    assert all(ENGINE_CODES[code][0] in {e.label for e in ENGINES.values()} for code in ENGINE_CODES)


def test_a_refusal_is_one_sentence_with_the_registry_hint(quantized_demo):
    got = verdicts(quantized_demo["nvfp4_head"])
    for finding in (f for v in got.values() for f in v.refused):
        assert finding.message.endswith(".") and "\n" not in finding.message
        assert finding.hint == ENGINE_CODES[finding.code][2]
    with pytest.raises(DsparkError):  # DraftRefused is a DsparkError: exit code 1, one sentence
        engine("trtllm").plan(ServeRequest(str(TARGET), str(quantized_demo["nvfp4_head"])))
