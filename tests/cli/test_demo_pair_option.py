"""`--pair NAME`: generate and eval run a shipped demo pair by its short name; the hybrid pair (a Qwen3.5-style
target) is lossless at greedy in float32."""

import json

import pytest
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.runtime import demo

runner = CliRunner()
HYBRID_BUILT = (demo.HYBRID_DEMO_DIR / "draft" / "config.json").is_file()
needs_hybrid = pytest.mark.skipif(not HYBRID_BUILT, reason="the hybrid demo pair is not built "
                                  "(scripts/build_demo.py --pair demo-hybrid)")


@needs_hybrid
def test_generate_runs_the_hybrid_pair_by_its_short_name_losslessly(tmp_path):
    out = tmp_path / "run.json"
    result = runner.invoke(app, ["generate", "def parse(text):\n", "--pair", "demo-hybrid", "--max-new-tokens", "48",
                                 "--baseline", "--dtype", "float32", "--device", "cpu", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "greedy output identical to plain decoding on all 1 prompts" in result.output
    doc = json.loads(out.read_text())
    assert doc["settings"]["target"] == str(demo.HYBRID_DEMO_DIR / "target")
    assert doc["settings"]["draft"] == str(demo.HYBRID_DEMO_DIR / "draft")
    (run,) = doc["prompts"]
    assert len(run["tokens"]) == 48 and run["tokens"] == run["baseline_tokens"] and run["first_divergence"] is None
    assert doc["summary"]["tau"] > 1.5  # the draft is accepted often, not just lossless
    config = json.loads((demo.HYBRID_DEMO_DIR / "target" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and "linear_attention" in config["layer_types"]


@needs_hybrid
def test_generate_without_a_prompt_continues_the_demo_prompts_on_the_hybrid_pair(tmp_path):
    result = runner.invoke(app, ["generate", "--pair", "demo-hybrid", "--max-new-tokens", "4", "--json",
                                 str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [run["prompt"] for run in doc["prompts"]] == list(demo.DEMO_PROMPTS)


@needs_hybrid
def test_eval_runs_the_hybrid_pair_on_the_shipped_prompt_sets(tmp_path):
    out = tmp_path / "eval.json"
    result = runner.invoke(app, ["eval", "--pair", "demo-hybrid", "--limit", "1", "--max-new-tokens", "8",
                                 "--device", "cpu", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["settings"]["target"] == str(demo.HYBRID_DEMO_DIR / "target")
    assert sorted(s["name"] for s in doc["sets"]) == ["eval_code", "eval_prose"]
    again = runner.invoke(app, ["eval", "--resume", str(out), "--pair", "demo-hybrid", "--device", "cpu"])
    assert again.exit_code == 0, again.output  # the same pair: nothing left to run
    other = runner.invoke(app, ["eval", "--resume", str(out), "--pair", "demo", "--device", "cpu"])
    assert other.exit_code == 2 and "was run with --target" in other.output  # another pair: refused


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_an_unknown_pair_is_one_sentence(command):
    result = runner.invoke(app, [command, "hello", "--pair", "demo-mamba"] if command == "generate" else
                           [command, "--pair", "demo-mamba"])
    assert result.exit_code == 2
    assert "--pair must be one of demo, demo-hybrid (the shipped demo pairs), not 'demo-mamba'" in (
        " ".join(result.output.split()))


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_a_pair_and_a_target_are_refused_together(command):
    args = ["--pair", "demo", "--target", "some/target", "--draft", "some/draft"]
    result = runner.invoke(app, [command, "hello", *args] if command == "generate" else [command, *args])
    assert result.exit_code == 2 and "pass --pair, or --target and --draft, not both" in result.output


def test_a_pair_not_built_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setattr(demo, "HYBRID_DEMO_DIR", tmp_path / "no-hybrid")
    result = runner.invoke(app, ["generate", "hello", "--pair", "demo-hybrid"])
    assert result.exit_code == 2
    assert ("the demo-hybrid pair is not built yet; run `python scripts/build_demo.py` with --pair demo-hybrid or "
            "pass --target and --draft") in " ".join(result.output.split())
