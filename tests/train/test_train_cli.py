"""`dspark train` end to end through the Typer app (CliRunner): output files, validate --target, lossless generate,
resume, and every refusal (one sentence, exit 2, nothing allocated or written)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from pair_factory import write_byte_tokenizer
from safetensors.torch import load_file
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.runtime.train import run as training_run

runner = CliRunner()
CODE = "def add(a, b):\n    return a + b\n\n\nclass Counter:\n    def increment(self, step=1):\n        return step\n"
RUN = ["--steps", "4", "--batch-size", "2", "--seq-len", "32", "--anchors", "6", "--lr", "1e-2", "--seed", "3",
       "--device", "cpu"]
TINY = [*RUN, "--block-size", "4", "--markov-rank", "8"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target, data file): a random 3-layer Qwen3 over a 256-token byte tokenizer that has no free id, so train
    must add a mask row (V = T + 1)."""
    from dspark_cli.runtime.train.tiny_target import TargetGeometry

    root = tmp_path_factory.mktemp("train_cli")
    target = write_byte_tokenizer(root / "target")
    model = TargetGeometry(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16).build(1, 0)
    model.save_pretrained(target)
    data = root / "code.py"
    data.write_text(CODE * 8)
    return target, data


def train(pair, out: Path, *args: str):
    target, data = pair
    return runner.invoke(app, ["train", "--target", str(target), "--data", str(data), "-o", str(out), *TINY, *args])


def resume(pair, out: Path, checkpoint: Path, *args: str):
    """--resume with only the run options: the geometry comes from the checkpoint."""
    target, data = pair
    return runner.invoke(app, ["train", "--target", str(target), "--data", str(data), "-o", str(out), *RUN,
                               "--resume", str(checkpoint), *args])


def one_sentence_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    text = " ".join(result.output.split())
    for needle in needles:
        assert needle in text, text


def test_train_writes_a_draft_that_validates_and_generates_losslessly(pair, tmp_path):
    target = str(pair[0])
    out = tmp_path / "draft"
    result = train(pair, out, "--save-every", "2")
    assert result.exit_code == 0, result.output
    assert "no free id: mask token 256 added" in " ".join(result.output.split())
    assert "vLLM: serves" in result.output  # each engine's verdict on the draft; SGLang sizes markov_w2 to the
    assert "SGLang: refuses (DSP703)" in result.output  # target's vocabulary, and this draft added a mask row
    assert "TensorRT-LLM: " in result.output
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "config.json", "model.safetensors"]
    assert sorted(p.name for p in (out / "checkpoint-2").iterdir()) == [
        "config.json", "model.safetensors", "trainer_state.json", "trainer_state.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["draft_vocab_size"], config["mask_token_id"]) == (257, 256, 256)
    assert load_file(str(out / "model.safetensors"))["embed_tokens.weight"].shape == (257, 32)  # own mask row

    checked = runner.invoke(app, ["validate", str(out), "--target", target])
    assert checked.exit_code == 0 and "vLLM can load this" in " ".join(checked.output.split()), checked.output

    report = tmp_path / "run.json"
    ran = runner.invoke(app, ["generate", "def add(a", "--target", target, "--draft", str(out), "--max-new-tokens",
                              "24", "--baseline", "--device", "cpu", "--dtype", "float32",
                              "--json", str(report)])
    assert ran.exit_code == 0, ran.output
    (run,) = json.loads(report.read_text())["prompts"]
    assert run["tokens"] == run["baseline_tokens"] and run["first_divergence"] is None


def test_resume_continues_bit_identically_and_keeps_the_checkpoint_geometry(pair, tmp_path):
    straight = train(pair, tmp_path / "a", "--save-every", "2")
    assert straight.exit_code == 0, straight.output
    checkpoint = tmp_path / "a" / "checkpoint-2"
    # the geometry flags may be left out: they come from the checkpoint
    resumed = resume(pair, tmp_path / "b", checkpoint)
    assert resumed.exit_code == 0, resumed.output
    assert "at step 2 (draft geometry from its config.json)" in " ".join(resumed.output.split())
    first, second = load_file(str(tmp_path / "a/model.safetensors")), load_file(str(tmp_path / "b/model.safetensors"))
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name

    for flag, value, key in (("--markov-rank", "16", "markov_rank"), ("--block-size", "5", "block_size"),
                             ("--layers", "2", "num_hidden_layers"), ("--mask-token-id", "3", "mask_token_id")):
        result = resume(pair, tmp_path / "c", checkpoint, flag, value)
        one_sentence_error(result, f"{key} is", f"{flag} {value}")
    one_sentence_error(resume(pair, tmp_path / "c", checkpoint, "--steps", "2"),
                       "at step 2", "--steps")
    assert not (tmp_path / "c").exists()


@pytest.fixture
def no_target_weights(monkeypatch):
    """Fail the test if the target's weights are loaded: refusals must come before any allocation."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(training_run, "load_target_model", refuse)


BAD_VALUES = [
    (["--device", "foo"], ["--device 'foo'", "auto, cpu, cuda or cuda:N"]),
    (["--device", "cuda:x"], ["--device 'cuda:x'"]),
    (["--lr", "nan"], ["--lr", "finite"]),
    (["--lr", "inf"], ["--lr", "finite"]),
    (["--lr", "-1"], ["--lr", "above 0"]),
    (["--lr", "0"], ["--lr", "above 0"]),
    (["--seq-len", "1"], ["--seq-len"]),
    (["--seq-len", "4"], ["--seq-len 4 is too short for --block-size 4"]),
    (["--seq-len", "100000"], ["max_position_embeddings 2048"]),
    (["--block-size", "100000"], ["--block-size 100000 does not fit the target's context"]),
    (["--block-size", "40"], ["--seq-len 32 is too short for --block-size 40"]),
    (["--block-size", "0"], ["--block-size"]),
    (["--layers", "1000000000"], ["one training step needs about", "TB", "free"]),
    (["--markov-rank", "1000000000"], ["one training step needs about", "free"]),
    (["--batch-size", "100000000"], ["one training step needs about", "free"]),
    (["--layers", "0"], ["--layers"]),
    (["--markov-rank", "-1"], ["--markov-rank"]),
    (["--steps", "0"], ["--steps"]),
    (["--batch-size", "0"], ["--batch-size"]),
    (["--save-every", "-1"], ["--save-every"]),
    (["--anchors", "-1"], ["--anchors"]),
    (["--anchors", "0"], ["--anchors"]),
    (["--seed", "-1"], ["--seed"]),
    (["--seed", str(2**64)], ["--seed"]),
    (["--mask-token-id", "-1"], ["--mask-token-id"]),
    (["--mask-token-id", "300"], ["--mask-token-id 300 is outside"]),
    (["--target-layers", "x"], ["--target-layers 'x'"]),
    (["--target-layers", "0,7"], ["--target-layers [0, 7]"]),
    (["--tau-every", "-1"], ["--tau-every"]),
    (["--tau-new-tokens", "0"], ["--tau-new-tokens"]),
    (["--tau-data", "missing.jsonl"], ["missing.jsonl"]),
    (["--tau-data", "prompts.csv"], ["prompts.csv: use a .jsonl file"]),
]


@pytest.mark.parametrize("args, needles", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_values_are_refused_before_loading_anything(pair, tmp_path, no_target_weights, args, needles):
    out = tmp_path / "out"
    one_sentence_error(train(pair, out, *args), *needles)
    assert not out.exists()


def test_cuda_device_without_cuda_is_refused(pair, tmp_path, no_target_weights):
    if torch.cuda.is_available():
        one_sentence_error(train(pair, tmp_path / "out", "--device", f"cuda:{torch.cuda.device_count()}"),
                           "CUDA device(s)")
    else:
        one_sentence_error(train(pair, tmp_path / "out", "--device", "cuda"), "CUDA is not available")


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(pair, tmp_path):
    out = tmp_path / "out"
    result = train(pair, out, "--lr", "1e30", "--save-every", "1")
    one_sentence_error(result, "diverged at step 2", "no final draft was written", str(out / "checkpoint-1"))
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1"]  # no NaN draft, no NaN checkpoint
    for name, tensor in load_file(str(out / "checkpoint-1" / "trainer_state.safetensors")).items():
        assert tensor.dtype == torch.uint8 or torch.isfinite(tensor).all(), name


def _break(checkpoint: Path, how: str) -> None:
    state = checkpoint / "trainer_state.json"
    tensors = checkpoint / "trainer_state.safetensors"
    config = checkpoint / "config.json"
    if how == "json":
        state.write_text('{"step": ')
    elif how == "list":
        state.write_text("[1, 2]")
    elif how == "nested":
        state.write_text("[" * 100_000 + "]" * 100_000)
    elif how == "step":
        state.write_text(json.dumps({**json.loads(state.read_text()), "step": "two"}))
    elif how == "truncated":
        tensors.write_bytes(tensors.read_bytes()[:1000])
    elif how == "no-state":
        tensors.unlink()
    elif how == "no-config":
        config.unlink()
    elif how == "rank":  # a config edited after training: the state no longer fits it
        config.write_text(json.dumps({**json.loads(config.read_text()), "markov_rank": 16}))
    elif how == "vocab":
        config.write_text(json.dumps({**json.loads(config.read_text()), "vocab_size": 300}))


CORRUPTIONS = [
    ("json", ["trainer_state.json is not valid JSON"]),
    ("list", ["trainer_state.json holds a JSON list"]),
    ("nested", ["trainer_state.json", "nest"]),
    ("step", ["key 'step' is 'two'"]),
    ("truncated", ["trainer_state.safetensors cannot be read", "truncated"]),
    ("no-state", ["trainer_state.safetensors is missing"]),
    ("no-config", ["config.json is missing"]),
    ("rank", ["trainer_state.safetensors does not fit the draft of its config.json"]),
    ("vocab", ["vocab_size 300 does not fit this target's vocabulary"]),
]


@pytest.mark.parametrize("how, needles", CORRUPTIONS, ids=[how for how, _ in CORRUPTIONS])
def test_corrupted_resume_checkpoint_is_one_sentence(pair, tmp_path_factory, tmp_path, how, needles):
    source = tmp_path_factory.getbasetemp() / "resume_source"
    if not (source / "checkpoint-2").is_dir():
        assert train(pair, source, "--save-every", "2").exit_code == 0
    import shutil

    checkpoint = shutil.copytree(source / "checkpoint-2", tmp_path / "checkpoint-2")
    _break(checkpoint, how)
    one_sentence_error(resume(pair, tmp_path / "out", checkpoint), *needles)
    assert not (tmp_path / "out").exists()


def test_a_runaway_chat_template_is_stopped_with_one_sentence(pair, tmp_path, monkeypatch, no_target_weights):
    from dspark_cli.runtime.decode import chat as chat_module

    monkeypatch.setattr(chat_module, "CHAT_TEMPLATE_SECONDS", 0.5)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (tmp_path / "spin.jinja").write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                         "{% endfor %}")
    started = time.monotonic()
    result = runner.invoke(app, ["train", "--target", str(pair[0]), "--data", str(chat), "--chat-template",
                                 str(tmp_path / "spin.jinja"), "-o", str(tmp_path / "out"), *TINY])
    one_sentence_error(result, "chat.jsonl:1: the chat template was still rendering after 0.5 s")
    assert time.monotonic() - started < 30 and not (tmp_path / "out").exists()


def test_chat_template_and_data_errors_name_the_file(pair, tmp_path, no_target_weights):
    target = str(pair[0])
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")

    def run(data: Path, *args: str):
        return runner.invoke(app, ["train", "--target", target, "--data", str(data), "-o", str(tmp_path / "out"),
                                   *TINY, *args])

    one_sentence_error(run(chat), "needs a chat template", "--chat-template")
    one_sentence_error(run(chat, "--chat-template", str(tmp_path / "none.jinja")), "none.jinja does not exist")
    (tmp_path / "folder.jinja").mkdir()
    one_sentence_error(run(chat, "--chat-template", str(tmp_path / "folder.jinja")), "is not a regular file")
    (tmp_path / "binary.jinja").write_bytes(b"{{ x }}\x00\xff\xfe")
    one_sentence_error(run(chat, "--chat-template", str(tmp_path / "binary.jinja")), "binary.jinja is not UTF-8")
    (tmp_path / "latin1.jinja").write_bytes("{{ 'café' }}".encode("latin-1"))
    one_sentence_error(run(chat, "--chat-template", str(tmp_path / "latin1.jinja")), "latin1.jinja is not UTF-8")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }")
    one_sentence_error(run(chat, "--chat-template", str(tmp_path / "broken.jinja")), "chat.jsonl:1",
                       "the chat template fails")
    (tmp_path / "raises.jinja").write_text("{{ raise_exception('no system role') }}")
    one_sentence_error(run(chat, "--chat-template", str(tmp_path / "raises.jinja")), "chat template fails")

    records = tmp_path / "records.jsonl"
    for content, needles in ((b'{"text": "ok"}\n[1, 2]\n', ("records.jsonl:2: a JSONL record needs",)),
                             (b'{"text": "ok"}\n\n' + b"[" * 100_000 + b"]" * 100_000 + b"\n",
                             ("records.jsonl:3", "nest")),
                             (b'{"text": "caf\xe9"}\n', ("records.jsonl:1: not UTF-8 text",)),
                             (b'{"text": \n', ("records.jsonl:1", "not valid JSON"))):
        records.write_bytes(content)
        one_sentence_error(run(records), *needles)
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01" * 100)
    one_sentence_error(run(tmp_path / "weights.bin"), "weights.bin is a binary file")
    assert not (tmp_path / "out").exists()


def test_resume_with_other_trainable_copies_is_refused(pair, tmp_path):
    """A checkpoint trained with its own lm_head copy cannot resume without it (the state would not match)."""
    first = train(pair, tmp_path / "a", "--save-every", "2", "--train-lm-head")
    assert first.exit_code == 0, first.output
    checkpoint = tmp_path / "a" / "checkpoint-2"
    one_sentence_error(resume(pair, tmp_path / "b", checkpoint), "other values of --train-embeddings / --train-lm-head")
    resumed = resume(pair, tmp_path / "c", checkpoint, "--train-lm-head")
    assert resumed.exit_code == 0, resumed.output


def test_a_written_draft_dspark_refuses_ends_the_run_with_findings(pair, tmp_path, monkeypatch):
    """The check at the end of training: a draft dspark's own rules refuse with its target is named (exit 1, the
    draft kept) before the user finds out at generate time."""
    from dspark_cli.runtime.train import verdict

    real = verdict.judge_written_draft

    def refusing(draft, target):
        written = real(draft, target)
        return verdict.WrittenDraft(["DSP045 the draft copies a target-only setting."], written.verdicts)

    monkeypatch.setattr(verdict, "judge_written_draft", refusing)
    out = tmp_path / "draft"
    result = train(pair, out)
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "fails dspark's own checks with this target: DSP045" in text and "the draft is kept" in text
    assert (out / "model.safetensors").is_file()


def test_an_engine_that_cannot_serve_the_head_type_is_refused_before_training(pair, tmp_path):
    out = tmp_path / "draft"
    result = train(pair, out, "--engine", "vllm", "--markov-head-type", "gated")
    one_sentence_error(result, "--engine vllm: vLLM serves no gated Markov head (validate's DSP012)", "sglang")
    assert not out.exists()  # refused before anything was written


def test_auto_picks_an_engine_that_serves_the_head_and_a_named_engine_judges_the_draft(pair, tmp_path):
    """A gated head: auto trains for SGLang (vLLM serves vanilla heads only). This tokenizer has no free mask id, so
    the draft adds a vocabulary row, which SGLang refuses (DSP703): the verdict says so; with --engine sglang named,
    the run ends with exit 1 and the draft kept."""
    result = train(pair, tmp_path / "auto", "--markov-head-type", "gated")
    assert result.exit_code == 0, result.output
    assert "SGLang: refuses (DSP703)  (trained for)" in result.output and "vLLM: refuses (DSP012)" in result.output
    named = train(pair, tmp_path / "named", "--markov-head-type", "gated", "--engine", "sglang")
    assert named.exit_code == 1, named.output
    text = " ".join(named.output.split())
    assert "SGLang, the engine this draft was trained for, refuses" in text and "DSP703" in text
    assert (tmp_path / "named" / "model.safetensors").is_file()


def test_train_prints_the_measured_tau_and_logs_it(pair, tmp_path):
    """τ is measured at the --tau-every steps and at the end, printed, and logged (null at the other steps)."""
    log = tmp_path / "log.jsonl"
    result = train(pair, tmp_path / "out", "--tau-every", "3", "--tau-prompts", "1", "--log-jsonl", str(log))
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "held out from the end of the data" in text and "step 3: τ" in text and "step 4: τ" in text
    taus = [r["tau"] for r in map(json.loads, log.read_text().splitlines())]
    assert taus[:2] == [None, None] and all(1.0 <= t <= 5.0 for t in taus[2:])


def test_tau_on_a_prompt_set_as_eval_reads_it(pair, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("def add(a, b):", "class Counter:")))
    log = tmp_path / "log.jsonl"
    result = train(pair, tmp_path / "out", "--tau-data", str(prompts), "--tau-new-tokens", "16", "--log-jsonl",
                   str(log))
    assert result.exit_code == 0, result.output
    assert f"greedy loop on the prompts of {prompts}" in " ".join(result.output.split())
    taus = [r["tau"] for r in map(json.loads, log.read_text().splitlines())]
    assert taus[:3] == [None] * 3 and 1.0 <= taus[3] <= 5.0  # measured at the end (default every 100 steps)
