"""The engine seam: the registry, the one-sentence error for an unknown engine, and refuses as a filter."""

from __future__ import annotations

import pytest

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.rules import ERROR, WARNING, Finding, Report
from dspark_cli.runtime.engines import ENGINE_ONLY_CODES, ENGINES, engine
from dspark_cli.runtime.engines.seam import Engine


def test_the_registry_and_an_unknown_engine():
    assert engine("vllm") is ENGINES["vllm"] and engine("vllm").label == "vLLM"
    listed = ", ".join(ENGINES)
    with pytest.raises(DsparkError, match=rf"^the engine 'nosuch' is not one dspark serves with; use one of {listed}\.$"):
        engine("nosuch")
    assert "llamacpp" in ENGINES and engine("llamacpp").label == "llama.cpp"
    assert ENGINE_ONLY_CODES == {"DSP012", "DSP040", "DSP041", "DSP042", "DSP062"}  # DSP062: llama.cpp's DFlash2 lattice row


def test_an_engine_refuses_broken_drafts_and_its_own_codes_only():
    findings = [Finding("DSP012", ERROR, "gated head", "retrain"), Finding("DSP024", ERROR, "width", "fix"),
                Finding("DSP014", WARNING, "no block_size", "set it")]
    report = Report(source="draft", format="deepspec", findings=findings)
    assert [f.code for f in engine("vllm").refuses(report)] == ["DSP012", "DSP024"]
    other = Engine(name="other", label="Other", source="-", own_codes=frozenset(), plan=engine("vllm").plan)
    assert [f.code for f in other.refuses(report)] == ["DSP024"]  # vLLM's restriction is not a broken draft
