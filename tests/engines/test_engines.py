"""SGLang's and TensorRT-LLM's verdicts on the factory's drafts, their --dry-run argv, and validate --engine all.

Mutation checked: making sglang.rules accept speculators configs (dropping the DSP701 check) fails
test_each_engine_verdict[speculators] with SGLang 'serves with losses' instead of 'refuses'."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
from dspark_cli.runtime.checkpoint.rules import validate_checkpoint
from dspark_cli.runtime.engines import ENGINES
from dspark_cli.runtime.engines.seam import draft_config
from ckpt_factory import (
    DraftSpec,
    speculators_config,
    write_draft,
    write_folder,
    draft_tensors,
    write_nvfp4_draft,
    write_target_config,
)

runner = CliRunner()
S = DraftSpec()


def verdicts(draft, target):
    ckpt = open_checkpoint(str(draft))
    report = validate_checkpoint(ckpt, read_target_config(str(target)))
    config = draft_config(ckpt, report)
    return {name: e.verdict(report, config) for name, e in ENGINES.items()}


DRAFTS = {
    "default": (lambda p: write_draft(p, S), {"vllm": "serves", "sglang": "serves with losses",
                                             "trtllm": "serves with losses", "llamacpp": "serves with losses"}),
    "gated": (lambda p: write_draft(p, S.with_(markov_head_type="gated")), {"vllm": "refuses", "sglang":
              "serves with losses", "trtllm": "serves with losses", "llamacpp": "refuses"}),
    "rnn": (lambda p: write_draft(p, S.with_(markov_head_type="rnn")), {"vllm": "refuses", "sglang":
            "serves with losses", "trtllm": "serves with losses", "llamacpp": "refuses"}),
    "speculators": (lambda p: write_folder(p, speculators_config(S), draft_tensors(S)),
                    {"vllm": "serves", "sglang": "refuses", "trtllm": "serves with losses",
                     "llamacpp": "serves with losses"}),
    "nvfp4": (lambda p: write_nvfp4_draft(p, S), {"vllm": "serves", "sglang": "refuses",
                                                "trtllm": "serves with losses", "llamacpp": "refuses"}),
    "gemma4": (lambda p: write_draft(p, S.with_(family="gemma4")), None),
}
CODES = {("gated", "vllm"): ["DSP012"], ("rnn", "vllm"): ["DSP012"],
         ("speculators", "sglang"): ["DSP701"], ("nvfp4", "sglang"): ["DSP702"], ("gated", "llamacpp"): ["DSP012"],
         ("nvfp4", "llamacpp"): ["DSP722"], ("gemma4", "llamacpp"): ["DSP721"]}


@pytest.mark.parametrize("kind", DRAFTS)
def test_each_engine_verdict(tmp_path, kind):
    make, expected = DRAFTS[kind]
    spec = S.with_(family="gemma4") if kind == "gemma4" else S
    got = verdicts(make(tmp_path / "d"), write_target_config(tmp_path / "t", spec))
    if expected is None:  # Gemma-4: SGLang and TensorRT-LLM are unverified, so never a silent "serves"
        assert got["sglang"].status != "serves" and got["trtllm"].status != "serves"
        assert any("not verified" in n for n in got["sglang"].notes + got["trtllm"].notes)
        assert [f.code for f in got["llamacpp"].refused] == CODES["gemma4", "llamacpp"]  # Qwen3 backbones only
        # vLLM serves it, but its Gemma-4 loader skips the confidence head and soft-caps the Markov bias
        assert got["vllm"].status == "serves with losses"
        assert [note.split()[0] for note in got["vllm"].notes] == ["DSP043", "DSP046"]
        return
    assert {name: v.status for name, v in got.items()} == expected
    for (draft, name), codes in CODES.items():
        if draft == kind:
            assert [f.code for f in got[name].refused] == codes


def dry_run(tmp_path, engine, *args):
    draft = write_draft(tmp_path / "d", S)
    target = write_target_config(tmp_path / "t", S)
    result = runner.invoke(app, ["serve", "-t", str(target), "-d", str(draft), "--engine", engine, "--json", "-",
                                 *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), draft, target


def test_sglang_dry_run_argv(tmp_path):
    sts = tmp_path / "sts.json"
    sts.write_text(json.dumps({"temperatures": [1.0] * 4}))
    doc, draft, target = dry_run(tmp_path, "sglang", "--calibration", str(sts), "--port", "30000")
    assert doc["argv"] == [sys.executable, "-m", "sglang.launch_server", "--model-path", str(target.resolve()),
                           "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path",
                           str(draft.resolve()), "--speculative-dspark-block-size", "4",
                           "--speculative-dspark-confidence-sts-path", str(sts.resolve()), "--port", "30000"]


def test_trtllm_dry_run_argv_and_yaml_beside_the_json(tmp_path):
    doc, draft, target = dry_run(tmp_path, "trtllm")
    assert doc["argv"] == ["trtllm-serve", str(target.resolve()), "--extra_llm_api_options", "dspark-trtllm.yaml"]
    assert doc["files"]["dspark-trtllm.yaml"] == (f'speculative_config:\n  decoding_type: "DSpark"\n'
                                                  f'  speculative_model: "{draft.resolve()}"\n  max_draft_len: 4\n')
    out = tmp_path / "o" / "plan.json"
    out.parent.mkdir()
    result = runner.invoke(app, ["serve", "-t", str(target), "-d", str(draft), "--engine", "trtllm", "--json",
                                 str(out)])
    assert result.exit_code == 0, result.output
    assert (out.parent / "dspark-trtllm.yaml").read_text() == doc["files"]["dspark-trtllm.yaml"]
    assert json.loads(out.read_text())["argv"][-1] == str(out.parent / "dspark-trtllm.yaml")


def test_validate_engine_all_json(tmp_path):
    draft = write_draft(tmp_path / "d", S.with_(markov_head_type="gated"))
    target = write_target_config(tmp_path / "t", S)
    result = runner.invoke(app, ["validate", str(draft), "-t", str(target), "--engine", "all", "--json", "-"])
    doc = json.loads(result.stdout)
    assert {k: (v["verdict"], v["codes"]) for k, v in doc["engines"].items()} == {
        "vllm": ("refuses", ["DSP012"]), "sglang": ("serves with losses", []), "trtllm": ("serves with losses", []),
        "llamacpp": ("refuses", ["DSP012"])}
    assert any("not verified that a standalone drafter builds it" in n for n in doc["engines"]["trtllm"]["notes"])
    assert result.exit_code == doc["exit_code"] == 0  # one engine serves it
    single = runner.invoke(app, ["validate", str(draft), "-t", str(target), "--engine", "llamacpp", "--json", "-"])
    assert single.exit_code == 1
    plain = runner.invoke(app, ["validate", str(draft), "-t", str(target), "--json", "-"])
    assert "engines" not in json.loads(plain.stdout) and plain.exit_code == 1  # default: today's vLLM report


def test_llamacpp_dry_run_argv_names_the_gguf_beside_each_folder(tmp_path):
    doc, draft, target = dry_run(tmp_path, "llamacpp")
    assert doc["argv"] == ["llama-server", "-m", str(target.resolve()) + ".gguf", "-md", str(draft.resolve()) + ".gguf",
                           "--spec-type", "draft-dspark", "--spec-draft-n-max", "4"]
    assert any("dspark convert" in note and "--to gguf" in note for note in doc["notes"])


@pytest.mark.parametrize("name, own", [("sglang", "--speculative_algorithm=EAGLE"),
                                       ("trtllm", "--extra_llm_api_options"), ("trtllm", "--config=x.yaml"),
                                       ("llamacpp", "--spec-type")])
def test_extra_arguments_may_not_repeat_what_dspark_sets(name, own):
    """One shared check (seam.refuse_own_flags), before any file is read: the engine's own flags in either -/_
    spelling, and --port when dspark's port is given."""
    from dspark_cli.runtime.engines import engine
    from dspark_cli.runtime.engines.seam import ServeRequest

    chosen = engine(name)
    with pytest.raises(DsparkError, match=f"the extra {chosen.label} arguments contain .*, which dspark sets itself"):
        chosen.plan(ServeRequest("missing-target", "missing-draft", engine_args=(own,)))
    with pytest.raises(DsparkError, match="contain --port, which dspark sets itself"):
        chosen.plan(ServeRequest("missing-target", "missing-draft", port=8000, engine_args=("--port", "9000")))


@pytest.mark.parametrize("name", ["sglang", "trtllm"])
@pytest.mark.parametrize("setting", [{"draft_topk": 8}, {"confidence_threshold": 0.5},
                                     {"draft_sample_method": "greedy"}])
def test_settings_only_vllm_takes_are_refused_for_other_engines(name, setting):
    from dspark_cli.runtime.engines import engine
    from dspark_cli.runtime.engines.seam import ServeRequest

    with pytest.raises(DsparkError, match="drop (them|it)"):
        engine(name).plan(ServeRequest("missing-target", "missing-draft", **setting))


def test_trtllm_takes_no_sts_file_from_dspark(tmp_path):
    """llm_args.py: a strict DSparkDecodingConfig with no STS key (@ 00043967), or one that refuses
    confidence_sts_path without confidence scheduling and TensorRT-LLM's own SPS table (@ c319397c): a YAML with the
    STS path alone would fail at start-up, so dspark refuses the calibration for TensorRT-LLM."""
    from dspark_cli.runtime.engines import engine
    from dspark_cli.runtime.engines.seam import ServeRequest

    sts = tmp_path / "sts.json"
    sts.write_text('{"temperatures": [1.0]}')
    with pytest.raises(DsparkError, match="TensorRT-LLM reads an STS file only with enable_confidence_scheduling"):
        engine("trtllm").plan(ServeRequest("missing-target", "missing-draft", calibration=str(sts)))


def test_llamacpp_refuses_a_draft_without_markov_head(tmp_path):
    """A DFlash-style draft (markov_rank 0): llama.cpp's dflash loader needs markov_w1 / markov_w2, so its verdict
    refuses with DSP723 (never "serves with losses"), through validate --engine llamacpp too (exit 1)."""
    spec = S.with_(markov_rank=0, confidence=False)
    draft, target = write_draft(tmp_path / "d", spec), write_target_config(tmp_path / "t", spec)
    got = verdicts(draft, target)["llamacpp"]
    assert got.status == "refuses" and [f.code for f in got.refused] == ["DSP723"]
    result = runner.invoke(app, ["validate", str(draft), "--target", str(target), "--engine", "llamacpp"])
    assert result.exit_code == 1 and "DSP723" in result.output, result.output
