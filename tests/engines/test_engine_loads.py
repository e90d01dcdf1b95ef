"""What each engine loads, decided once in its module (runtime/engines/<engine>.py) and read alike by validate
--engine, serve and convert: the Markov head types each loader builds (SGLang DSP725, TensorRT-LLM DSP726),
llama.cpp's confidence head (DSP724, the converter's own rule), and every serve option an engine would refuse or
ignore (exit 2, one sentence, before anything starts)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from ckpt_factory import DraftSpec, write_draft, write_target_config
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
from dspark_cli.runtime.checkpoint.rules import validate_checkpoint
from dspark_cli.runtime.engines import ENGINES
from dspark_cli.runtime.engines.seam import draft_config

runner = CliRunner()
S = DraftSpec()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("engine_loads")
    write_target_config(root / "target", S)
    write_draft(root / "draft", S)
    write_draft(root / "no-confidence", S.with_(confidence=False))
    write_draft(root / "hidden-confidence", S.with_(confidence_with_markov=False))
    (root / "sts.json").write_text(json.dumps({"temperatures": [1.0, 1.5, 2.0, 2.5]}))
    return root


def refused_codes(draft: Path, target: Path) -> dict[str, list[str]]:
    ckpt = open_checkpoint(str(draft))
    report = validate_checkpoint(ckpt, read_target_config(str(target)))
    config = draft_config(ckpt, report)
    return {name: [f.code for f in e.verdict(report, config).refused] for name, e in ENGINES.items()}


def serve(root: Path, draft: str, engine: str, *args) -> tuple[int, str, list[str]]:
    """exit code, stderr as one line, and the printed argv (empty when refused)."""
    result = runner.invoke(app, ["serve", "--target", str(root / "target"), "--draft", str(root / draft),
                                 "--engine", engine, "--dry-run", *map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    argv = shlex.split(result.stdout.strip()) if result.exit_code == 0 else []
    return result.exit_code, " ".join(result.stderr.split()), argv


@pytest.mark.parametrize("head, edit, expected", [
    ("vanilla", {"markov_head_type": "lstm"}, {"vllm": ["DSP012"], "sglang": ["DSP725"], "trtllm": ["DSP726"],
                                               "llamacpp": ["DSP012"]}),
    ("vanilla", {"markov_head_type": None}, {"vllm": [], "sglang": ["DSP725"], "trtllm": [], "llamacpp": []}),
    ("gated", {"markov_head_type": "GATED"}, {"vllm": ["DSP012"], "sglang": [], "trtllm": [], "llamacpp": ["DSP012"]}),
], ids=["unknown", "missing", "gated-upper-case"])
def test_each_engine_refuses_the_markov_heads_its_loader_does_not_build(root, tmp_path, head, edit, expected):
    """SGLang and TensorRT-LLM build vanilla, gated and rnn heads (both lower-case the key); SGLang raises without
    the key where dspark assumes vanilla. A type neither builds used to read "serves" (validate's DSP012 is vLLM's)."""
    draft = write_draft(tmp_path / "draft", S.with_(markov_head_type=head), edit=edit)
    assert refused_codes(draft, root / "target") == expected


def test_train_picks_engines_by_the_same_head_types():
    assert [e.name for e in ENGINES.values() if not e.refuses_head("rnn")] == ["sglang", "trtllm"]
    assert all(e.refuses_head("lstm") for e in ENGINES.values())


@pytest.mark.parametrize("draft", ["draft", "no-confidence", "hidden-confidence"])
def test_llamacpp_verdict_and_the_gguf_converter_apply_one_confidence_rule(root, tmp_path, draft):
    """validate --engine llamacpp refuses (DSP724) exactly the confidence heads convert --to gguf refuses: one that
    reads the hidden state alone does not fit llama.cpp's conf_proj [hidden + markov_rank, 1]."""
    refused = "DSP724" in refused_codes(root / draft, root / "target")["llamacpp"]
    result = runner.invoke(app, ["convert", str(root / draft), "--to", "gguf", "--target", str(root / "target"),
                                 "-o", str(tmp_path / "draft.gguf")])
    converter_refused = "reads the hidden state alone" in " ".join(result.output.split())
    assert refused == converter_refused == (draft == "hidden-confidence")
    if refused:
        assert result.exit_code == 2 and not (tmp_path / "draft.gguf").exists()
        shown = runner.invoke(app, ["validate", str(root / draft), "--target", str(root / "target"),
                                    "--engine", "llamacpp"])
        assert shown.exit_code == 1 and "DSP724" in shown.output


@pytest.mark.parametrize("attention, refused", [
    ({}, False),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}, True),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4, "is_causal": True}, False),
    ({"dflash_config": {"use_swa": True, "swa_window_size": 4}}, False),
], ids=["dense", "sliding-and-full", "all-causal", "all-sliding"])
def test_llamacpp_verdict_and_the_gguf_converter_apply_one_causality_rule(root, tmp_path, attention, refused):
    """validate --engine llamacpp refuses (DSP727) exactly the drafts convert --to gguf refuses for causality: layers
    that vLLM runs with different causality, where llama.cpp has one flag for the draft."""
    draft = write_draft(tmp_path / "draft", S.with_(extra_config={**S.extra_config, **attention}))
    assert ("DSP727" in refused_codes(draft, root / "target")["llamacpp"]) == refused
    result = runner.invoke(app, ["convert", str(draft), "--to", "gguf", "--target", str(root / "target"),
                                 "-o", str(tmp_path / "draft.gguf")])
    assert ("differ in causality" in " ".join(result.output.split())) == refused


def test_llamacpp_serve_refuses_what_llama_server_would_drop_or_fail_on(root, tmp_path):
    """A threshold for a draft without a confidence head (llama-server cannot start speculation and serves
    without the draft), an STS file, a draft top-k and a draft sample method it has no setting for."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": "dspark-plan/1", "speculative_config": {
        "num_speculative_tokens": 3, "dspark_confidence_threshold": 0.4}}))
    code, err, _ = serve(root, "no-confidence", "llamacpp", "--from-plan", plan)
    assert code == 2 and "has none" in err and "llama.cpp would start without the draft" in err
    code, _, argv = serve(root, "draft", "llamacpp", "--from-plan", plan)
    assert code == 0 and argv[argv.index("--spec-draft-p-min") + 1] == "0.4"
    for args, needle in ((["--calibration", root / "sts.json"], "reads no STS calibration file"),
                         (["--draft-topk", "4"], "takes no draft top-k"),
                         (["--draft-sample-method", "probabilistic"], "has no probabilistic draft sampling")):
        code, err, _ = serve(root, "draft", "llamacpp", *args)
        assert code == 2 and needle in err, (args, err)
    code, _, argv = serve(root, "draft", "llamacpp", "--draft-sample-method", "greedy")
    assert code == 0 and argv[0] == "llama-server"


def test_sglang_takes_only_an_sts_file_it_reads_for_a_head_that_uses_it(root, tmp_path):
    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps({"format": "dspark-eval/1", "results": []}))
    trt_only = tmp_path / "trt.json"
    trt_only.write_text(json.dumps({"sts_temperatures": [1.0, 1.0, 1.0, 1.0]}))
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"temperatures": [1.0, 1.0]}))
    code, _, argv = serve(root, "draft", "sglang", "--calibration", root / "sts.json")
    assert code == 0 and argv[argv.index("--speculative-dspark-confidence-sts-path") + 1] == str(root / "sts.json")
    for draft, path, needle in (("draft", tmp_path / "missing.json", "missing.json"),
                                ("draft", run_file, "needs a 'temperatures' list"),
                                ("draft", trt_only, "reads the temperatures key"),
                                ("draft", short, "has 2 temperatures but the block has 4 positions"),
                                ("no-confidence", root / "sts.json", "has no confidence head")):
        code, err, _ = serve(root, draft, "sglang", "--calibration", path)
        assert code == 2 and needle in err and err.count("error:") == 1, (path, err)


def test_engines_without_a_draft_sample_method_refuse_one_given_explicitly(root):
    for engine in ("sglang", "trtllm"):
        code, err, _ = serve(root, "draft", engine, "--draft-sample-method", "probabilistic")
        assert code == 2 and "vLLM setting" in err
    code, _, argv = serve(root, "draft", "vllm")
    assert code == 0 and json.loads(argv[4])["draft_sample_method"] == "probabilistic"


def test_a_plan_that_says_do_not_speculate_refuses_the_options_of_the_draft(root, tmp_path):
    """n = 0 serves the target alone (the engine's plain command): a draft option would be silently dropped."""
    plan = tmp_path / "verdict.json"
    plan.write_text(json.dumps({"format": "dspark-plan-verdict/1", "speculative_config": {"num_speculative_tokens": 0},
                                "engine": "vllm", "verdicts": [{"reason": "speculation does not pay here"}]}))
    code, _, argv = serve(root, "draft", "vllm", "--from-plan", plan)
    assert code == 0 and argv == ["vllm", "serve", str(root / "target")]
    for args in (["--draft-topk", "4"], ["--draft-sample-method", "greedy"], ["--calibration", root / "sts.json"]):
        code, err, _ = serve(root, "draft", "vllm", "--from-plan", plan, *args)
        assert code == 2 and f"{args[0]} would be dropped" in err, (args, err)


def test_vllm_refuses_a_threshold_its_gemma4_loader_could_not_apply(tmp_path):
    """vLLM's Gemma-4 DSpark loader skips the confidence head (DSP043): a plan's threshold would cut nothing."""
    gemma = S.with_(family="gemma4")
    write_target_config(tmp_path / "target", gemma)
    write_draft(tmp_path / "draft", gemma)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": "dspark-plan/1", "speculative_config": {
        "num_speculative_tokens": 3, "dspark_confidence_threshold": 0.4}}))
    assert serve(tmp_path, "draft", "vllm")[0] == 0
    code, err, _ = serve(tmp_path, "draft", "vllm", "--from-plan", plan)
    assert code == 2 and "skips the confidence head (validate's DSP043)" in err


def test_llamacpp_verdict_and_the_gguf_converter_refuse_the_same_markov_heads(root, tmp_path):
    """The converter reads llama.cpp's Engine.markov_heads: a head the verdict refuses (DSP012) is not converted."""
    for head in ("vanilla", "gated", "rnn"):
        draft = write_draft(tmp_path / head, S.with_(markov_head_type=head))
        refused = "DSP012" in refused_codes(draft, root / "target")["llamacpp"]
        result = runner.invoke(app, ["convert", str(draft), "--to", "gguf", "--target", str(root / "target"),
                                     "-o", str(tmp_path / f"{head}.gguf")])
        assert refused == (f"its Markov head is '{head}'" in " ".join(result.output.split())) == (head != "vanilla")
