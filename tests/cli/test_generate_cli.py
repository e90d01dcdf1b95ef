"""`dspark generate` end to end on a tiny pair (CliRunner): streaming, report, --json, --baseline, input errors."""

import json

import pytest
import torch
from ckpt_factory import DraftSpec, write_draft, write_target_config
from pair_factory import bigram_draft, bigram_target, write_byte_tokenizer
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.runtime import demo

runner = CliRunner()
SPEC = DraftSpec(block_size=8, markov_rank=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = bigram_target(root / "target", SPEC)
    write_byte_tokenizer(target)
    draft = bigram_draft(root / "draft", SPEC, target)
    return str(target), str(draft)


def generate(*args: str):
    return runner.invoke(app, ["generate", *args])


def test_greedy_run_with_baseline_and_json(pair, tmp_path):
    target, draft = pair
    out = tmp_path / "run.json"
    result = generate("hello world", "--target", target, "--draft", draft, "--max-new-tokens", "24", "--baseline",
                      "--json", str(out))
    assert result.exit_code == 0, result.output
    for text in ("per-position acceptance", "τ (incl. bonus)", "speedup", "confidence calibration",
                 "greedy output identical to plain decoding on all 1 prompts"):
        assert text in result.output
    doc = json.loads(out.read_text())
    assert doc["settings"]["block_size"] == 8 and doc["settings"]["markov"] == "dense"
    assert doc["settings"]["dtype"] == "float32" and doc["settings"]["device"] == "cpu"
    summary = doc["summary"]
    assert summary["tau"] > 1.0 and len(summary["acceptance_conditional"]) == 8
    assert summary["baseline"]["speedup"] > 0 and summary["calibration"] is not None
    (run,) = doc["prompts"]
    assert run["tokens"] == run["baseline_tokens"] and run["first_divergence"] is None
    streamed = run["completion"].translate(dict.fromkeys(map(ord, "\a\b\v\f\r")))  # rich drops these controls
    assert streamed and streamed in result.output  # the text was streamed as it was accepted


def test_prompt_files_sampling_and_json_on_stdout(pair, tmp_path):
    target, draft = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "first prompt"}\n"second prompt"\n\n')
    args = ["--prompts", str(prompts), "--target", target, "--draft", draft, "--max-new-tokens", "12",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--markov", "topk", "--draft-topk", "16",
            "--confidence-threshold", "0.2", "--json", "-"]
    first, second = generate(*args), generate(*args)
    assert first.exit_code == 0, first.output
    doc = json.loads(first.stdout)  # the streamed text and the report went to stderr
    assert [run["prompt"] for run in doc["prompts"]] == ["first prompt", "second prompt"]
    assert doc["settings"]["markov"] == "topk" and doc["settings"]["draft_topk"] == 16
    assert doc["summary"]["baseline"] is None
    assert json.loads(second.stdout)["prompts"] == doc["prompts"]  # --seed makes the run reproducible


def test_eval_prompt_set_records_feed_generate(pair, tmp_path):
    """A `dspark eval` prompt set (DeepSpec's {"turns": [...]} records) is a --prompts file: the first turn."""
    target, draft = pair
    prompts = tmp_path / "set.jsonl"
    prompts.write_text('{"turns": ["first turn", "second turn"], "id": 1}\n{"prompt": "plain"}\n')
    result = generate("--prompts", str(prompts), "--target", target, "--draft", draft, "--max-new-tokens", "4",
                      "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [run["prompt"] for run in doc["prompts"]] == ["first turn", "plain"]


def test_text_prompt_file(pair, tmp_path):
    target, draft = pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\n\ntwo\n")
    result = generate("--prompts", str(prompts), "--target", target, "--draft", draft, "--max-new-tokens", "4",
                      "--block-size", "3", "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [run["prompt"] for run in doc["prompts"]] == ["one", "two"] and doc["summary"]["block_size"] == 3


def test_demo_pair_missing_is_one_sentence(monkeypatch, tmp_path):
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path / "no-demo")
    result = generate("hello")
    assert result.exit_code == 2
    assert "the demo pair is not built yet; run `python scripts/build_demo.py` or pass --target and --draft" in (
        " ".join(result.output.split())
    )


def test_demo_pair_is_used_without_target_and_draft(monkeypatch, pair, tmp_path):
    target, draft = pair
    root = tmp_path / "demo"
    root.mkdir()
    (root / "target").symlink_to(target)
    (root / "draft").symlink_to(draft)
    monkeypatch.setattr(demo, "DEMO_DIR", root)
    result = generate("--max-new-tokens", "4", "--json", str(tmp_path / "r.json"))  # no prompt: the demo's own
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["settings"]["target"] == str(root / "target")
    assert [run["prompt"] for run in doc["prompts"]] == list(demo.DEMO_PROMPTS)


def test_no_prompt_with_an_explicit_pair_is_refused(pair):
    result = generate("--target", pair[0], "--draft", pair[1])
    assert result.exit_code == 2 and "give a PROMPT argument or --prompts FILE" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--block-size", "9"], "--block-size 9 is larger than the 8 draft tokens"),
        (["--markov", "nvfp4", "--draft-topk", "8"], "needs a draft whose markov_w2 is NVFP4"),
        (["--markov", "topk"], "--markov topk: the topk Markov strategy gathers top-k candidates; give a draft top-k"),
        (["--markov", "sparse"], "--markov must be one of"),
        (["--draft-topk", "999"], "--draft-topk must be between 1 and"),
        (["--confidence-threshold", "1.5"], "--confidence-threshold must be in (0, 1]"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--chat"], "has no chat template"),
        (["--dtype", "int8"], "--dtype must be"),
        (["--temperature", "inf"], "temperature must be a finite number >= 0"),
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "-0.5"], "--temperature"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--top-p", "nan"], "--top-p must be in (0, 1]"),
        (["--seed", str(2**64)], "--seed"),
        (["--seed", "-1"], "--seed"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--block-size", "0"], "--block-size must be at least 1"),
        (["--draft-topk", "0"], "--draft-topk must be between 1 and"),
        (["--confidence-threshold", "nan"], "--confidence-threshold must be in (0, 1]"),
    ],
)
def test_bad_options_are_one_clear_sentence(pair, args, message):
    target, draft = pair
    result = generate("hello", "--target", target, "--draft", draft, "--max-new-tokens", "2", *args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


@pytest.fixture(scope="module")
def dflash2_pair(tmp_path_factory):
    """A tiny Qwen3 target with a random DFlash2 draft (selector_top_k 4) beside it."""
    root = tmp_path_factory.mktemp("cli-dflash2")
    target = bigram_target(root / "target", DraftSpec(markov_rank=0, confidence=False))
    write_byte_tokenizer(target)
    draft = write_draft(root / "draft", DraftSpec(family="dflash2", markov_rank=0, confidence=False, block_size=7,
                                                  selector_top_k=4, dtype=torch.float32))
    return str(target), str(draft)


def test_a_dflash2_report_names_its_path_selector_not_a_markov_stage(dflash2_pair):
    target, draft = dflash2_pair
    result = generate("hello", "--target", target, "--draft", draft, "--max-new-tokens", "12", "--json", "-")
    assert result.exit_code == 0, result.output
    settings = json.loads(result.stdout)["settings"]
    assert (settings["markov"], settings["draft_topk"]) == ("selector", 4)
    assert settings["draft_kind"] == "DFlash2 draft, path selector"
    report = result.stderr
    assert "DFlash2 draft, path selector, block 6, selector top-4, T=0.0" in report
    assert "selector stage" in report and "Markov stage" not in report and "markov" not in report


@pytest.mark.parametrize("command", ["generate", "eval"])
@pytest.mark.parametrize("args, message", [
    (["--draft-topk", "2"], "--draft-topk cannot be used with a DFlash2 draft: its path selector walks the "
                            "selector_top_k = 4 candidates it was trained with; drop --draft-topk."),
    (["--markov", "topk"], "--markov topk: a DFlash2 draft has no Markov head; its path selector's walk is the one "
                           "stage it runs; drop --markov."),
])
def test_a_draft_top_k_or_markov_strategy_for_a_dflash2_draft_is_one_sentence(dflash2_pair, tmp_path, command, args,
                                                                               message):
    """The Markov settings do not apply to a DFlash2 draft: refused by flag before anything loads, not ignored."""
    target, draft = dflash2_pair
    inputs = (["hello"] if command == "generate" else ["--data", str(demo.DEMO_DIR / "eval_code.jsonl"), "--limit", "1"])
    result = runner.invoke(app, [command, *inputs, "--target", target, "--draft", draft, "--max-new-tokens", "2",
                                 *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_target_without_draft_is_refused(pair):
    result = generate("hello", "--target", pair[0])
    assert result.exit_code == 2 and "pass both --target and --draft" in result.output


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("p.csv", "a,b\n", "use a .txt file"),
        ("p.jsonl", "{not json\n", "line 1 is not JSON"),
        ("p.jsonl", '{"text": "x"}\n', "line 1: give a JSON string, an object with a 'prompt'"),
    ],
)
def test_bad_prompt_files(pair, tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    result = generate("--prompts", str(path), "--target", pair[0], "--draft", pair[1])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_incompatible_target_is_refused_before_loading(pair, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    write_target_config(other, SPEC, hidden_size=32)  # config.json only: no weights to load
    result = generate("hello", "--target", str(other), "--draft", pair[1])
    assert result.exit_code == 2 and "DSP024" in result.output


def copy_draft_with(draft: str, root, **values: float):
    """A copy of `draft` whose tensors named in `values` (dots as __) are filled with that value."""
    import shutil

    from safetensors.torch import load_file, save_file

    copy = root / "draft-copy"
    shutil.copytree(draft, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    for name, value in values.items():
        tensors[name.replace("__", ".")].fill_(value)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return str(copy)


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_a_draft_with_nan_weights_is_reported_and_the_json_is_kept(pair, tmp_path, temperature):
    target, draft = pair
    broken = copy_draft_with(draft, tmp_path, confidence_head__proj__weight=float("nan"),
                             markov_head__markov_w2__weight=float("inf"))
    out = tmp_path / "run.json"
    result = generate("hello", "--target", target, "--draft", broken, "--max-new-tokens", "12", "--temperature",
                      temperature, "--json", str(out))
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "has NaN or inf values in 2 weight tensor(s)" in text and "markov_head.markov_w2.weight" in text
    assert "confidence calibration unavailable" in text
    doc = json.loads(out.read_text())
    assert doc["summary"]["calibration"] is None and "not probabilities" in doc["summary"]["calibration_unavailable"]
    assert len(doc["prompts"][0]["tokens"]) == 12


def no_weight_loading(monkeypatch):
    """Make loading the target fail loudly: the checks under test must run before it."""
    from dspark_cli.runtime.model import target as target_module

    def refuse(*args, **kwargs):
        raise AssertionError("the target's weights were loaded")

    monkeypatch.setattr(target_module.TargetModel, "load", classmethod(refuse))


def test_a_one_megabyte_prompt_is_refused_before_loading(pair, tmp_path, monkeypatch):
    """The byte tokenizer makes 1 MB one token per byte: 1,000,000 tokens against a 4096-position context."""
    no_weight_loading(monkeypatch)
    prompts = tmp_path / "big.txt"
    prompts.write_text("a" * 1_000_000 + "\n")
    result = generate("--prompts", str(prompts), "--target", pair[0], "--draft", pair[1])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "prompt 1 has 1,000,000 tokens" in text and "more than the 4,096 of" in text


def test_prompt_plus_new_tokens_beyond_the_context_is_refused(pair, monkeypatch):
    no_weight_loading(monkeypatch)
    result = generate("b" * 4000, "--target", pair[0], "--draft", pair[1], "--max-new-tokens", "97")
    assert result.exit_code == 2, result.output
    assert "4,097 positions, more than the 4,096" in " ".join(result.output.split())


def test_a_prompt_that_fits_exactly_runs(pair):
    result = generate("c" * 4094, "--target", pair[0], "--draft", pair[1], "--max-new-tokens", "2")
    assert result.exit_code == 0, result.output


def with_chat_template(target: str, root, template: str) -> str:
    """A copy of the target whose tokenizer carries `template` as its chat template."""
    import shutil

    from transformers import AutoTokenizer

    copy = root / "chat-target"
    shutil.copytree(target, copy)
    tokenizer = AutoTokenizer.from_pretrained(str(copy))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(copy))
    return str(copy)


@pytest.mark.parametrize(
    "template, message",
    [
        ("{{ messages[0]['content'] | no_such_filter }}", "TemplateAssertionError: No filter named 'no_such_filter'"),
        ("{{ raise_exception('roles must alternate') }}", "TemplateError: roles must alternate"),
        ("{{ messages.nope.nope }}", "UndefinedError"),
        ("{{ 1 + messages[0]['content'] }}", "TypeError"),
        ("{% for m in messages %}{{ m['content'] }}", "TemplateSyntaxError"),
    ],
)
def test_a_failing_chat_template_is_one_sentence(pair, tmp_path, monkeypatch, template, message):
    no_weight_loading(monkeypatch)
    target = with_chat_template(pair[0], tmp_path, template)
    result = generate("hello", "--target", target, "--draft", pair[1])
    assert result.exit_code == 2 and "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert f"the chat template of {target} fails: {message}" in text and "pass --no-chat" in text


def test_a_runaway_chat_template_is_stopped(pair, tmp_path, monkeypatch):
    from dspark_cli.runtime.decode import chat

    no_weight_loading(monkeypatch)
    monkeypatch.setattr(chat, "CHAT_TEMPLATE_SECONDS", 0.5)
    loop = ("{% for i in range(100000) %}{% for j in range(100000) %}{{ messages[0]['content'] }}"
            "{% endfor %}{% endfor %}")
    target = with_chat_template(pair[0], tmp_path, loop)
    result = generate("hello", "--target", target, "--draft", pair[1])
    assert result.exit_code == 2, result.output
    assert "was still rendering after 0.5 s" in " ".join(result.output.split())


def test_an_oversized_chat_rendering_is_refused(pair, tmp_path, monkeypatch):
    from dspark_cli.runtime.decode import chat

    no_weight_loading(monkeypatch)
    monkeypatch.setattr(chat, "CHAT_TEMPLATE_MAX_CHARS", 1000)
    template = "{% for i in range(300) %}{{ messages[0]['content'] }}{% endfor %}"
    target = with_chat_template(pair[0], tmp_path, template)
    result = generate("hello", "--target", target, "--draft", pair[1])
    assert result.exit_code == 2, result.output
    assert "produced 1,500 characters for one prompt (the limit is 1,000)" in " ".join(result.output.split())


def test_a_working_chat_template_is_used(pair, tmp_path):
    target = with_chat_template(pair[0], tmp_path, "<{{ messages[0]['content'] }}>")
    out = tmp_path / "r.json"
    result = generate("hello", "--target", target, "--draft", pair[1], "--max-new-tokens", "3", "--json", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["settings"]["chat"] is True and doc["prompts"][0]["prompt_tokens"] == len("<hello>")


@pytest.mark.parametrize("which", ["--target", "--draft"])
def test_a_folder_name_that_is_not_utf8_is_named_not_the_file(pair, tmp_path, which):
    import os
    import shutil

    target, draft = pair
    moved = tmp_path / os.fsdecode(b"folder-\xff\xfe")
    shutil.copytree(target if which == "--target" else draft, moved)
    paths = {"--target": target, "--draft": draft, which: str(moved)}
    result = generate("hello", "--target", paths["--target"], "--draft", paths["--draft"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert f"{which} {tmp_path}/folder-\\xff\\xfe has a name that is not valid UTF-8" in text
    assert "the files themselves may be fine" in text


def test_a_prompt_that_is_not_utf8_is_one_sentence():
    result = generate("caf\udce9")  # the shell's bytes b"caf\xe9" (Latin-1), as Python receives them
    assert result.exit_code == 2 and "is not valid UTF-8" in result.output and "Traceback" not in result.output


def test_a_prompts_file_is_read_bounded_and_refused_in_one_sentence(tmp_path, monkeypatch):
    from dspark_cli.runtime.measure import evaluation

    prompts = tmp_path / "p.txt"
    prompts.write_text("one prompt\n" * 10)
    monkeypatch.setattr(evaluation, "MAX_PROMPT_SET_BYTES", 32)  # the cap (1 GiB) made small
    result = generate("--prompts", str(prompts))
    assert result.exit_code == 2 and "prompts file" in result.output and "Traceback" not in result.output
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9\n")
    result = generate("--prompts", str(latin))
    assert result.exit_code == 2 and "not UTF-8" in result.output
