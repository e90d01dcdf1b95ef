"""CLI text: user and finding text is printed literally (never read as rich markup); usage lines name
arguments plainly."""

import pytest
from ckpt_factory import DraftSpec, write_draft
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.runtime.bench import run as bench_module
from dspark_cli.runtime.quantize import write as quantize_module

runner = CliRunner()
BRACKETED = "markov_w2 is [vocab_size, 384] and [bold]not bold[/bold]"


def words(text: str) -> str:
    return " ".join(text.translate(str.maketrans("│╭╮╰╯─", "      ")).split())


def test_quantize_warnings_and_paths_keep_their_brackets(tmp_path, monkeypatch):
    monkeypatch.setattr(quantize_module, "_rank_warnings", lambda rank: [BRACKETED])
    source = write_draft(tmp_path / "draft", DraftSpec())
    out = tmp_path / "out[red]x"
    result = runner.invoke(app, ["quantize", str(source), "-o", str(out), "--engine", "torch"])
    assert result.exit_code == 0, result.output
    assert BRACKETED in words(result.stderr)
    assert "out[red]x" in words(result.stdout)


def test_bench_notes_keep_their_brackets(monkeypatch):
    notes = bench_module._notes
    monkeypatch.setattr(bench_module, "_notes", lambda *args: [BRACKETED, *notes(*args)])
    result = runner.invoke(app, ["bench", "markov", "--device", "cpu", "--vocab", "64", "--rank", "16", "--block",
                                 "2", "--batch", "1", "--topk", "8", "--format", "bf16", "--temperature", "0",
                                 "--reps", "1", "--warmup", "0"])
    assert result.exit_code == 0, result.output
    assert BRACKETED in words(result.stdout)


@pytest.mark.parametrize("command, usage", [(["validate"], "[OPTIONS] CHECKPOINT"),
                                            (["quantize"], "[OPTIONS] CHECKPOINT"),
                                            (["generate"], "[OPTIONS] [PROMPT]")])
def test_usage_lines_name_arguments_plainly(command, usage):
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0
    text = words(result.stdout)
    assert usage in text and "{" not in text.split("Usage:")[1].split("  ")[0]
    assert "{checkpoint}" not in text and "{CHECKPOINT}" not in text


@pytest.mark.parametrize("command", [["bench", "markov", "--device", "cpu", "--draft"], ["validate", "--deep"]])
def test_a_checkpoint_folder_name_that_is_not_utf8_is_one_sentence(tmp_path, command):
    import os

    draft = write_draft(tmp_path / os.fsdecode(b"draft-\xff"), DraftSpec())
    result = runner.invoke(app, [*command, str(draft)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "draft-\\xff has a name that is not valid UTF-8" in words(result.stderr)


@pytest.mark.parametrize("command", [
    ["validate", "DRAFT", "--json", "OUT"],
    ["serve", "--target", "DRAFT", "--draft", "DRAFT", "--dry-run", "--json", "OUT"],
    ["generate", "hi", "--max-new-tokens", "2", "--json", "OUT"],
    ["eval", "--limit", "1", "--max-new-tokens", "2", "--markdown", "OUT"],
    ["quantize", "DRAFT", "-o", "OUT", "--engine", "torch"],
    ["bench", "markov", "--device", "cpu", "--vocab", "64", "--rank", "16", "--block", "2", "--batch", "1",
     "--topk", "8", "--format", "bf16", "--reps", "1", "--warmup", "0", "--json", "OUT"],
])
def test_an_output_path_no_file_can_have_is_one_sentence(tmp_path, command):
    """A name longer than the file system allows (ENAMETOOLONG) is refused before any work, like every OSError
    about a path the user named."""
    draft = write_draft(tmp_path / "draft", DraftSpec())
    out = tmp_path / ("x" * 300 + ".json")
    args = [str(draft) if arg == "DRAFT" else str(out) if arg == "OUT" else arg for arg in command]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    text = words(result.output)
    assert "Traceback" not in text and "File name too long" in text, text[-600:]


@pytest.mark.parametrize("command", [
    ["eval", "--limit", "1", "--max-new-tokens", "2", "--json", "SAME", "--markdown", "SAME"],
    ["bench", "markov", "--device", "cpu", "--vocab", "64", "--rank", "16", "--block", "2", "--batch", "1",
     "--topk", "8", "--format", "bf16", "--reps", "1", "--warmup", "0", "--json", "SAME", "--plot", "SAME"],
    ["calibrate", "RUN", "-o", "SAME", "--json", "SAME"],
    ["plan", "RUN", "-o", "SAME", "--json", "SAME"],
])
def test_two_outputs_naming_one_new_file_are_refused(tmp_path, command):
    """One command's outputs would destroy each other: refused before any work, whether or not the file exists."""
    same, run = tmp_path / "out.json", tmp_path / "run.json"
    run.write_text("{}")
    args = [str(same) if arg == "SAME" else str(run) if arg == "RUN" else arg for arg in command]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "is the --" in words(result.output) and not same.exists(), words(result.output)


@pytest.mark.parametrize("command", [["validate", "DRAFT", "--target", "DRAFT"],
                                     ["bench", "verify", "--target", "DRAFT", "--tokens", "2"],
                                     ["generate", "hi", "--target", "DRAFT", "--draft", "DRAFT"],
                                     ["serve", "--target", "DRAFT", "--draft", "DRAFT", "--dry-run"]])
def test_a_draft_given_as_the_target_is_refused(tmp_path, command):
    """Every command that reads a target's config.json refuses a draft checkpoint there (bench verify timed it,
    exit 0)."""
    draft = write_draft(tmp_path / "draft", DraftSpec())
    result = runner.invoke(app, [str(draft) if arg == "DRAFT" else arg for arg in command])
    assert result.exit_code == 2, result.output
    assert "is a draft checkpoint" in words(result.output), words(result.output)[-400:]


@pytest.mark.parametrize("command", [["eval", "--limit", "1"],
                                     ["train", "--target", "DEMO", "--data", "DATA", "-o", "OUT"]])
@pytest.mark.parametrize("seconds", ["inf", "nan", "0", "-1", "1e12"])
def test_a_dist_timeout_outside_its_range_is_one_sentence(tmp_path, command, seconds):
    from dspark_cli.runtime.demo import demo_pair

    data = tmp_path / "data.txt"
    data.write_text("some text to train on\n" * 20)
    values = {"OUT": str(tmp_path / "out"), "DEMO": str(demo_pair()[0]), "DATA": str(data)}
    args = [values.get(arg, arg) for arg in command]
    result = runner.invoke(app, [*args, "--dist-timeout", seconds])
    assert result.exit_code == 2, result.output
    assert "--dist-timeout must be a number of seconds above 0" in words(result.output)
