"""engines/llamacpp.py without a binary: the llama-server argv as llama.cpp b11434's common/arg.cpp names it, and
what it refuses."""

from __future__ import annotations

import json
import shutil

import pytest

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.demo import DEMO_DIR
from dspark_cli.runtime.engines import ENGINE_ONLY_CODES, engine
from dspark_cli.runtime.engines.seam import DraftRefused, ServeRequest

DRAFT, TARGET = DEMO_DIR / "draft", DEMO_DIR / "target"


def test_argv():
    plan = engine("llamacpp").plan(ServeRequest(target=str(TARGET), draft=str(DRAFT), block_size=5,
                                                confidence_threshold=0.4, port=8081, engine_args=("-fa", "on")))
    assert plan.argv == ["llama-server", "-m", str(TARGET.resolve()) + ".gguf", "-md", str(DRAFT.resolve()) + ".gguf",
                         "--spec-type", "draft-dspark", "--spec-draft-n-max", "5", "--spec-draft-p-min", "0.4",
                         "--port", "8081", "-fa", "on"]
    assert "dspark convert" in plan.notes[0] and "the to option gguf" in plan.notes[0]


def test_default_block_size_is_the_trained_one():
    plan = engine("llamacpp").plan(ServeRequest(target=str(TARGET), draft=str(DRAFT)))
    assert plan.argv[plan.argv.index("--spec-draft-n-max") + 1] == "7"


def test_reserved_flags_are_refused():
    with pytest.raises(DsparkError, match="dspark sets itself"):
        engine("llamacpp").plan(ServeRequest(target=str(TARGET), draft=str(DRAFT), engine_args=("-md", "x.gguf")))


def test_gated_head_is_refused_by_llamacpp(tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(DRAFT, draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "markov_head_type": "gated"}))
    with pytest.raises(DraftRefused) as refused:
        engine("llamacpp").plan(ServeRequest(target=str(TARGET), draft=str(draft)))
    assert "DSP012" in {f.code for f in refused.value.findings}
    assert "DSP012" in ENGINE_ONLY_CODES
