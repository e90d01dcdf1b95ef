"""`dspark validate` on the command line: report, --json, --strict, --target, exit codes, no heavy imports."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from ckpt_factory import replace_tensor, write_draft, write_target_config
from typer.testing import CliRunner

from dspark_cli.cli import app

runner = CliRunner()


def invoke(*args: str):
    result = runner.invoke(app, ["validate", *map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def one_sentence(stderr: str) -> str:
    """The error line as rich printed it (rich wraps long lines), checked to be one 'error: DSP5xx ….' sentence."""
    text = " ".join(stderr.split())
    assert text.startswith("error: DSP5") and text.count("error:") == 1 and text.endswith(".")
    assert "Traceback" not in stderr
    return text


def test_valid_checkpoint_exits_0_with_resolved_values(draft_dir):
    result = invoke(draft_dir)
    assert result.exit_code == 0
    out = " ".join(result.stdout.split())
    assert "mask token 250 (mask_token_id)" in out
    assert "target layers [0, 2] = hidden_states [1, 3] (target_layer_ids)" in out
    assert "markov head vanilla, rank 32, bf16" in out
    assert "DSP100" in out and "ok 0 errors, 0 warnings, 1 info" in out
    assert "DSP601-DSP607, DSP609: tensor values are checked only with --deep" in out


def test_errors_exit_1_grouped_by_severity(tmp_path, spec):
    path = write_draft(tmp_path / "d", spec.with_(markov_head_type="gated"), edit={"block_size": None})
    result = invoke(path)
    assert result.exit_code == 1
    out = result.stdout
    assert out.index("Errors (1)") < out.index("DSP012") < out.index("Warnings (1)") < out.index("DSP014")
    assert out.index("DSP014") < out.index("Info (1)") < out.index("DSP100")
    assert "x 1 errors, 1 warnings, 1 info" in " ".join(out.split())


def test_strict_turns_warnings_into_exit_1(tmp_path, spec):
    path = write_draft(tmp_path / "d", spec, edit={"block_size": None})
    assert invoke(path).exit_code == 0
    assert invoke(path, "--strict").exit_code == 1
    assert json.loads(invoke(path, "--strict", "--json", "-").stdout)["exit_code"] == 1


def test_json_is_the_only_output_on_stdout(tmp_path, spec):
    path = write_draft(tmp_path / "d", spec.with_(markov_head_type="rnn"))
    result = invoke(path, "--json", "-")
    document = json.loads(result.stdout)
    assert result.exit_code == 1 == document["exit_code"]
    assert document["format"] == "deepspec" and document["summary"]["errors"] == 1
    assert [f["code"] for f in document["findings"]] == ["DSP012", "DSP100"]
    assert set(document["findings"][0]) == {"code", "severity", "message", "hint"}
    assert document["resolved"]["mask_token"] == {"value": 250, "source": "mask_token_id"}


def test_target_folder_or_config_file(tmp_path, draft_dir, spec):
    target = write_target_config(tmp_path / "target", spec, num_hidden_layers=2)
    for given in (target, target / "config.json"):
        document = json.loads(invoke(draft_dir, "--target", given, "--json", "-").stdout)
        assert document["resolved"]["target_depth"] == {"value": 2, "source": "num_hidden_layers of --target"}
        assert {f["code"] for f in document["findings"]} == {"DSP019", "DSP031"}


def test_read_error_is_one_sentence_and_exit_2(draft_dir):
    weights = draft_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    result = invoke(draft_dir)
    assert result.exit_code == 2 and result.stdout == ""
    assert one_sentence(result.stderr).startswith("error: DSP506 ")


def test_read_error_with_json_still_prints_a_document(tmp_path):
    result = invoke(tmp_path / "missing", "--json", "-")
    assert result.exit_code == 2
    document = json.loads(result.stdout)
    assert document["exit_code"] == 2 and document["error"]["code"] == "DSP500"
    one_sentence(result.stderr)


def test_read_error_naming_a_markup_like_tensor(tmp_path):
    header = json.dumps({"[/x]": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    result = invoke(tmp_path)
    assert result.exit_code == 2
    assert one_sentence(result.stderr).startswith("error: DSP504 ") and "'[/x]'" in result.stderr


def test_bad_target_is_a_read_error(draft_dir, tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    result = invoke(draft_dir, "--target", tmp_path / "t")
    assert result.exit_code == 2
    assert one_sentence(result.stderr).startswith("error: DSP512 ")


def test_uncached_hub_target_offline_is_a_read_error(draft_dir):
    result = invoke(draft_dir, "--target", "nobody-dspark/not-in-the-cache")
    assert result.exit_code == 2
    assert one_sentence(result.stderr).startswith("error: DSP511 ")


def test_deep_finds_nan(tmp_path, spec):
    inf = torch.full((64,), float("inf"))
    path = write_draft(tmp_path / "d", spec, mutate=replace_tensor("hidden_norm.weight", inf))
    assert invoke(path).exit_code == 0
    result = invoke(path, "--deep", "--json", "-")
    assert result.exit_code == 1
    assert "DSP601" in {f["code"] for f in json.loads(result.stdout)["findings"]}


def test_validate_imports_no_torch(draft_dir):
    script = (
        "import sys\n"
        "from dspark_cli.cli import app\n"
        "try:\n"
        f"    app(['validate', {str(draft_dir)!r}, '--json', '-'])\n"
        "except SystemExit as exit:\n"
        "    code = exit.code\n"
        "heavy = [m for m in ('torch', 'transformers', 'triton', 'modelopt', 'safetensors') if m in sys.modules]\n"
        "print(code, heavy, file=sys.stderr)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.stderr.strip().splitlines()[-1] == "0 []"
    assert json.loads(done.stdout)["exit_code"] == 0



def test_many_findings_of_one_code_print_ten_and_a_count(tmp_path, spec):
    extra = {f"extra.{i}.weight": torch.zeros(1) for i in range(25)}
    path = write_draft(tmp_path / "d", spec, mutate=lambda t: {**t, **extra})
    result = invoke(path)
    codes = [line.split()[1] for line in result.output.splitlines() if line.strip().startswith(("x DSP", "! DSP"))]
    assert codes.count("DSP205") == 11, result.output  # ten findings and the count line
    assert "... and 15 more DSP205 findings (--json lists all)." in " ".join(result.output.split())
    listed = json.loads(invoke(path, "--json", "-").output)["findings"]
    assert sum(f["code"] == "DSP205" for f in listed) == 25


def test_hostile_checkpoint_files_are_one_sentence_exit_2(tmp_path, spec):
    path = write_draft(tmp_path / "d", spec)
    (path / "config.json").unlink()
    (path / "config.json").symlink_to("/dev/zero")
    result = invoke(path)
    assert result.exit_code == 2 and "not a regular file" in one_sentence(result.output)
    (path / "config.json").unlink()
    (path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    result = invoke(path)
    assert result.exit_code == 2 and "levels deep" in one_sentence(result.output)


@pytest.mark.parametrize("model_type", [["qwen3"], {"a": 1}, 7])
def test_a_model_type_that_is_not_a_string_gives_a_report_not_a_traceback(tmp_path, spec, model_type):
    draft = write_draft(tmp_path / "d", spec, edit={"architectures": ["DSparkDraftModel"], "model_type": model_type})
    result = runner.invoke(app, ["validate", str(draft), "--json", "-"])
    assert result.exit_code in (0, 1), result.output  # a report, not a crash
    assert json.loads(result.stdout)["format"]
