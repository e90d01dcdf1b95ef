"""`dspark serve`: the `vllm serve` argv and speculative config per kind of draft, refusals, and the exec hand-off.

No real vLLM runs here: the exec path is exercised with a stand-in `vllm` script that records what it received."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_factory import DraftSpec, write_draft, write_nvfp4_draft, write_target_config
from typer.testing import CliRunner

from dspark_cli.cli import app

runner = CliRunner()


@pytest.fixture
def target_dir(tmp_path, spec) -> Path:
    return write_target_config(tmp_path / "target", spec)


def invoke(target: Path, draft: Path, *args: str):
    result = runner.invoke(app, ["serve", "--target", str(target), "--draft", str(draft), *map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def dry_run(target: Path, draft: Path, *args: str) -> tuple[list[str], dict]:
    """The printed command split back into its argv, and the speculative config it carries."""
    result = invoke(target, draft, "--dry-run", *args)
    assert result.exit_code == 0, result.stderr
    argv = shlex.split(result.stdout.strip())  # exactly one line on stdout: the copy-pasteable command
    assert argv[:2] == ["vllm", "serve"] and argv[3] == "--speculative-config"
    return argv, json.loads(argv[4])


def one_sentence(stderr: str) -> str:
    text = " ".join(stderr.split())
    assert text.count("error:") == 1 and text.endswith(".") and "Traceback" not in stderr
    return text


# --- the command and the config, per kind of draft ------------------------------------------------------------------


def test_plain_draft(target_dir, draft_dir):
    argv, config = dry_run(target_dir, draft_dir, "--port", "8123", "--", "--tensor-parallel-size", "2")
    assert config == {"method": "dspark", "model": str(draft_dir.resolve()), "num_speculative_tokens": 4,
                      "draft_sample_method": "probabilistic"}
    assert argv == ["vllm", "serve", str(target_dir.resolve()), "--speculative-config", json.dumps(config),
                    "--port", "8123", "--tensor-parallel-size", "2"]


def test_relative_paths_become_absolute_so_the_command_works_anywhere(target_dir, draft_dir, monkeypatch):
    monkeypatch.chdir(draft_dir.parent)
    argv, config = dry_run(Path("target"), Path("draft"))
    assert argv[2] == str(target_dir.resolve()) and config["model"] == str(draft_dir.resolve())


def test_block_size_defaults_to_the_trained_block_and_may_only_shrink(tmp_path, target_dir, draft_dir):
    assert dry_run(target_dir, draft_dir, "--block-size", "2")[1]["num_speculative_tokens"] == 2
    result = invoke(target_dir, draft_dir, "--block-size", "5", "--dry-run")
    assert result.exit_code == 2 and one_sentence(result.stderr).endswith(
        "--block-size 5 is larger than the 4 draft tokens per round the draft was trained for; use 4 or less.")
    # DFlash layout (the anchor's slot predicts nothing): block_size 4 query slots draft 3 tokens
    dflash_layout = write_draft(tmp_path / "dflash-layout", DraftSpec(sample_from_anchor=False),
                                edit={"dspark_bonus_anchor": True})  # the key vLLM's speculator reads (DSP033)
    assert dry_run(target_dir, dflash_layout)[1]["num_speculative_tokens"] == 3
    no_block = write_draft(tmp_path / "no-block", edit={"block_size": None})
    result = invoke(target_dir, no_block, "--dry-run")
    assert result.exit_code == 2 and "--block-size is not in the draft's config.json" in one_sentence(
        result.stderr)
    assert dry_run(target_dir, no_block, "--block-size", "6")[1]["num_speculative_tokens"] == 6


def test_dflash_draft_uses_the_dflash_method(tmp_path, target_dir):
    spec = DraftSpec(markov_rank=0, confidence=False, own_embed=False, own_lm_head=False)
    draft = write_draft(tmp_path / "dflash", spec)
    _, config = dry_run(target_dir, draft)
    assert (config["method"], config["num_speculative_tokens"]) == ("dflash", 3)  # block_size - 1
    result = invoke(target_dir, draft, "--draft-topk", "4", "--dry-run")
    assert result.exit_code == 2 and "has none" in one_sentence(result.stderr)


def test_topk_from_the_flag_or_the_draft_config(tmp_path, target_dir, draft_dir):
    assert dry_run(target_dir, draft_dir, "--draft-topk", "16")[1]["dspark_draft_topk"] == 16
    configured = write_draft(tmp_path / "topk", edit={"dspark_draft_topk": 8})
    assert dry_run(target_dir, configured)[1]["dspark_draft_topk"] == 8
    assert dry_run(target_dir, configured, "--draft-topk", "32")[1]["dspark_draft_topk"] == 32
    result = invoke(target_dir, draft_dir, "--draft-topk", "257", "--dry-run")
    assert result.exit_code == 2 and "between 1 and the draft vocabulary size 256" in one_sentence(result.stderr)


def test_greedy_draft_sampling(target_dir, draft_dir):
    assert dry_run(target_dir, draft_dir, "--draft-sample-method", "greedy")[1]["draft_sample_method"] == "greedy"
    result = invoke(target_dir, draft_dir, "--draft-sample-method", "gumbel", "--dry-run")
    assert result.exit_code == 2 and "probabilistic, greedy" in one_sentence(result.stderr)


def test_nvfp4_draft_leaves_quantization_to_the_draft_config(tmp_path):
    spec = DraftSpec(markov_rank=64)
    target = write_target_config(tmp_path / "target", spec)
    draft = write_nvfp4_draft(tmp_path / "nvfp4", spec)
    _, config = dry_run(target, draft, "--draft-topk", "16")
    assert config == {"method": "dspark", "model": str(draft.resolve()), "num_speculative_tokens": 4,
                      "draft_sample_method": "probabilistic", "dspark_draft_topk": 16}  # no 'quantization' key
    document = json.loads(invoke(target, draft, "--json", "-").stdout)
    assert document["draft_quantization"].startswith("markov_w2 nvfp4 (W4A16, MIXED_PRECISION)")
    assert "quantization" not in document["speculative_config"]


def test_draft_from_dspark_quantize(tmp_path):
    spec = DraftSpec(markov_rank=64)
    target = write_target_config(tmp_path / "target", spec)
    source = write_draft(tmp_path / "bf16", spec)
    out = tmp_path / "nvfp4"
    quantized = runner.invoke(app, ["quantize", str(source), "-o", str(out), "--engine", "torch"])
    assert quantized.exit_code == 0, quantized.stderr
    _, config = dry_run(target, out)
    assert config == {"method": "dspark", "model": str(out.resolve()), "num_speculative_tokens": 4,
                      "draft_sample_method": "probabilistic"}
    assert "nvfp4" in json.loads(invoke(target, out, "--json", "-").stdout)["draft_quantization"]


def test_reduced_vocabulary_draft(tmp_path, target_dir):
    draft = write_draft(tmp_path / "reduced", DraftSpec(draft_vocab_size=128))
    _, config = dry_run(target_dir, draft, "--draft-topk", "128")
    assert config == {"method": "dspark", "model": str(draft.resolve()), "num_speculative_tokens": 4,
                      "draft_sample_method": "probabilistic", "dspark_draft_topk": 128}
    result = invoke(target_dir, draft, "--draft-topk", "129", "--dry-run")
    assert result.exit_code == 2 and "draft vocabulary size 128" in one_sentence(result.stderr)
    document = json.loads(invoke(target_dir, draft, "--json", "-").stdout)
    assert any("d2t" in note for note in document["notes"])


def test_json_document(target_dir, draft_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(stand_in_vllm(tmp_path / "bin", tmp_path / "record")))
    result = invoke(target_dir, draft_dir, "--json", "-", "--port", "9000")
    assert result.exit_code == 0
    document = json.loads(result.stdout)
    assert document["argv"] == shlex.split(document["command"])
    assert json.loads(document["argv"][4]) == document["speculative_config"]
    assert document["argv"][-2:] == ["--port", "9000"]
    assert (document["trained_block_size"], document["exit_code"]) == (4, 0)
    assert document["vllm"] == str(tmp_path / "bin" / "vllm")
    assert not (tmp_path / "record").exists()  # --json never starts vLLM


# --- refusals ------------------------------------------------------------------------------------------------------


def test_refused_draft_exits_1_with_the_findings(tmp_path, target_dir):
    draft = write_draft(tmp_path / "gated", DraftSpec(markov_head_type="gated"))
    result = invoke(target_dir, draft, "--dry-run")
    assert result.exit_code == 1
    assert result.stdout == ""  # no command for a draft vLLM cannot serve
    assert "x DSP012" in result.stderr and "fix:" in result.stderr
    assert "is refused: validate found 1 error against" in " ".join(result.stderr.split())
    document = json.loads(invoke(target_dir, draft, "--json", "-").stdout)
    assert document["refused"] and document["exit_code"] == 1
    assert [f["code"] for f in document["findings"] if f["severity"] == "error"] == ["DSP012"]


def test_the_target_is_checked_too(tmp_path, spec, draft_dir):
    wider = write_target_config(tmp_path / "wide-target", spec, hidden_size=128)
    result = invoke(wider, draft_dir, "--dry-run")
    assert result.exit_code == 1 and "x DSP024" in result.stderr


def test_unreadable_inputs_exit_2(tmp_path, target_dir, draft_dir):
    result = invoke(target_dir, tmp_path / "missing", "--dry-run")
    assert result.exit_code == 2 and "DSP500" in one_sentence(result.stderr)
    result = invoke(target_dir / "config.json", draft_dir, "--dry-run")
    assert result.exit_code == 2 and "is a file; vLLM serves a model folder" in one_sentence(result.stderr)
    result = invoke(target_dir, draft_dir, "--dry-run", "--", "--speculative-config", "{}")
    assert result.exit_code == 2 and "dspark builds itself" in one_sentence(result.stderr)
    result = invoke(target_dir, draft_dir, "--port", "1", "--dry-run", "--", "--port=2")
    assert result.exit_code == 2 and "port is given twice" in one_sentence(result.stderr)
    result = invoke(target_dir, tmp_path / "missing", "--json", "-")
    assert json.loads(result.stdout)["error"]["code"] == "DSP500"


def test_without_vllm_prints_the_command_and_exits_2(target_dir, draft_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    result = invoke(target_dir, draft_dir)
    assert result.exit_code == 2
    assert shlex.split(result.stdout.strip())[:2] == ["vllm", "serve"]
    assert "pip install vllm" in one_sentence(result.stderr)


# --- the exec hand-off, in a real process ---------------------------------------------------------------------------


def stand_in_vllm(bin_dir: Path, record: Path, exit_code: int = 7) -> Path:
    """A `vllm` executable that writes its PID and arguments (NUL-separated) to `record`, then exits."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "vllm"
    script.write_text(f"#!/bin/sh\necho $$ > '{record}.pid'\nprintf '%s\\0' \"$@\" > '{record}'\nexit {exit_code}\n")
    script.chmod(0o755)
    return bin_dir


def run_cli(*args: str, path: Path) -> subprocess.Popen:
    env = {**os.environ, "PATH": f"{path}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONUNBUFFERED", None)  # buffered stdout, as for most users: what is printed before exec must survive
    return subprocess.Popen([sys.executable, "-m", "dspark_cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_exec_replaces_the_process_and_passes_the_exit_code(tmp_path, target_dir, draft_dir):
    record = tmp_path / "record"
    bin_dir = stand_in_vllm(tmp_path / "bin", record, exit_code=7)
    args = ["serve", "-t", str(target_dir), "-d", str(draft_dir), "--draft-topk", "8", "--", "--max-model-len", "64"]
    process = run_cli(*args, path=bin_dir)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 7, stderr  # vLLM's exit code, unchanged
    assert int((tmp_path / "record.pid").read_text()) == process.pid  # same process: exec, not a child
    received = record.read_text().split("\0")[:-1]
    expected = shlex.split(stdout.strip())  # the command printed before the hand-off is what ran
    assert received == expected[1:]
    assert json.loads(received[3])["dspark_draft_topk"] == 8 and received[-2:] == ["--max-model-len", "64"]


def test_dry_run_never_starts_vllm(tmp_path, target_dir, draft_dir):
    record = tmp_path / "record"
    process = run_cli("serve", "-t", str(target_dir), "-d", str(draft_dir), "--dry-run",
                      path=stand_in_vllm(tmp_path / "bin", record))
    stdout, _ = process.communicate(timeout=120)
    assert process.returncode == 0 and stdout.startswith("vllm serve ")
    assert not record.exists()


def test_serve_imports_no_torch(target_dir, draft_dir):
    script = (
        "import sys\n"
        "from dspark_cli.cli import app\n"
        "try:\n"
        f"    app(['serve', '-t', {str(target_dir)!r}, '-d', {str(draft_dir)!r}, '--json', '-'])\n"
        "except SystemExit as exit:\n"
        "    code = exit.code\n"
        "heavy = [m for m in ('torch', 'transformers', 'triton', 'modelopt', 'safetensors') if m in sys.modules]\n"
        "print(code, heavy, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.stderr.strip().splitlines()[-1] == "0 []"
    assert json.loads(done.stdout)["speculative_config"]["method"] == "dspark"


def _plan(path: Path, fields: dict) -> Path:
    path.write_text(json.dumps({"format": "dspark-plan/1", "speculative_config": fields}))
    return path


def test_from_plan_carries_the_recommended_fields(tmp_path, target_dir, draft_dir):
    plan = _plan(tmp_path / "plan.json", {"num_speculative_tokens": 3, "dspark_confidence_threshold": 0.4})
    _, config = dry_run(target_dir, draft_dir, "--from-plan", plan)
    assert config["num_speculative_tokens"] == 3 and config["dspark_confidence_threshold"] == 0.4
    _, config = dry_run(target_dir, draft_dir, "--from-plan", _plan(tmp_path / "k.json", {"num_speculative_tokens": 2}))
    assert config["num_speculative_tokens"] == 2 and "dspark_confidence_threshold" not in config
    too_long = invoke(target_dir, draft_dir, "--from-plan", _plan(tmp_path / "l.json", {"num_speculative_tokens": 9}),
                      "--dry-run")
    assert too_long.exit_code == 2 and ("l.json: speculative_config.num_speculative_tokens 9 is larger than the 4 "
                                        "draft tokens") in one_sentence(too_long.stderr)
    for fields, expected in (({"num_speculative_tokens": 0}, "integer >= 1"),
                             ({"num_speculative_tokens": 2, "dspark_confidence_threshold": 2}, "in (0, 1]"),
                             ({"num_speculative_tokens": 2, "method": "eagle"}, "is not a plan"),
                             (None, "recommends nothing")):
        refused = invoke(target_dir, draft_dir, "--from-plan", _plan(tmp_path / "bad.json", fields), "--dry-run")
        assert refused.exit_code == 2 and expected in one_sentence(refused.stderr), refused.stderr


def test_from_plan_threshold_needs_a_confidence_head(tmp_path, target_dir):
    draft = write_draft(tmp_path / "nohead", DraftSpec(confidence=False))
    plan = _plan(tmp_path / "plan.json", {"num_speculative_tokens": 4, "dspark_confidence_threshold": 0.5})
    refused = invoke(target_dir, draft, "--from-plan", plan, "--dry-run")
    assert refused.exit_code == 2 and "needs a DSpark draft with a confidence head" in one_sentence(refused.stderr)
