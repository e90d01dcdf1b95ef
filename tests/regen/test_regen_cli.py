"""`dspark regen` from the command line against a stand-in server (tests/fixtures/regen_server.py): exit codes,
one-sentence refusals, the interrupt message; and `dspark train`'s reader on the records it writes."""

from __future__ import annotations

import json

import pytest
from regen_server import FakeServer
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.train.data import read_documents, render_documents, tokenize_stream

runner = CliRunner()


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def server():
    fake = FakeServer()
    yield fake
    fake.close()


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"turns": [f"prompt {i}"]}) + "\n" for i in range(3)))
    return path


def regen(*args):
    return runner.invoke(app, ["regen", *map(str, args)])


def test_regen_writes_every_conversation(server, prompts, tmp_path):
    done = regen(prompts, "-o", tmp_path / "out.jsonl", "--url", server.url)
    assert done.exit_code == 0, done.output
    assert "regenerated 3 conversations into" in words(done.stdout)
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3


def test_failures_exit_1_and_name_the_error_file(server, prompts, tmp_path):
    prompts.write_text(prompts.read_text() + '{"turns": ["FAIL"]}\n')
    done = regen(prompts, "-o", tmp_path / "out.jsonl", "--url", server.url)
    assert done.exit_code == 1
    assert words(done.stderr) == (f"error: 1 of 4 conversations failed; their errors are in {tmp_path}/out_error.jsonl "
                                  "(the first: the server answered /completion with HTTP 500: model exploded.); rerun "
                                  "with --resume to retry them. Already written and kept: "
                                  f"{tmp_path}/out.jsonl, {tmp_path}/out_error.jsonl.")


@pytest.mark.parametrize("args, message", [
    (["--url", "localhost:8080"], "--url 'localhost:8080' is not an http:// or https:// address"),
    (["--url", "http://127.0.0.1:9", "--timeout", "2"], "cannot reach the server at http://127.0.0.1:9"),
    (["--top-p", "0"], "--top-p must be above 0 and at most 1, got 0.0."),
    (["--min-p", "-1"], "--min-p must be between 0 and 1, got -1.0."),
    (["--timeout", "0"], "--timeout must be a number of seconds above 0, got 0.0."),
    (["--model", "other"], "serves fake-model, not other; pass one of them with --model."),
    (["--api", "grpc"], "--api 'grpc' is not an API; choose auto, llamacpp, openai."),
    (["--resume", "--force"], "--resume continues"),
])
def test_bad_settings_are_one_sentence_and_exit_2(server, prompts, tmp_path, args, message):
    args = ["--url", server.url] + args if "--url" not in args else args
    done = regen(prompts, "-o", tmp_path / "out.jsonl", *args)
    assert done.exit_code == 2, done.output
    assert message in words(done.stderr) and "Traceback" not in done.output
    assert not (tmp_path / "out.jsonl").exists()


def test_a_server_without_token_ids_exits_2(prompts, tmp_path):
    plain = FakeServer("plain")
    try:
        done = regen(prompts, "-o", tmp_path / "out.jsonl", "--url", plain.url)
    finally:
        plain.close()
    assert done.exit_code == 2
    assert "returned no token ids with its reply" in words(done.stderr) and "Check --api" in words(done.stderr)
    assert not (tmp_path / "out.jsonl").exists()


def test_outputs_are_refused_before_any_request(server, prompts, tmp_path):
    done = regen(prompts, "-o", prompts.with_suffix(".txt"), "--url", server.url)
    assert done.exit_code == 2 and "must end in .jsonl" in words(done.stderr)
    (tmp_path / "out_error.jsonl").write_text("")
    done = regen(prompts, "-o", tmp_path / "out.jsonl", "--url", server.url)
    assert done.exit_code == 2 and "out_error.jsonl already exists; continue it with --resume" in words(done.stderr)
    done = regen(prompts, "-o", tmp_path / "out.jsonl", "--url", server.url, "--force")
    assert done.exit_code == 0, done.output
    same = tmp_path / "same.jsonl"
    same.write_text('{"turns": ["x"]}\n')
    done = regen(same, "-o", same, "--url", server.url, "--force")
    assert done.exit_code == 2 and "is the prompt file" in words(done.stderr)
    assert sorted(server.asked()) == [f"[user]prompt {i}[assistant]" for i in range(3)]  # the --force run's alone


def test_an_interrupt_says_what_was_kept(server, prompts, tmp_path, monkeypatch):
    from dspark_cli.runtime.regen import run

    wait = run._next
    calls = []

    def interrupted(results):  # Ctrl-C while waiting for the third record
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return wait(results)

    monkeypatch.setattr(run, "_next", interrupted)
    out = tmp_path / "out.jsonl"
    done = regen(prompts, "-o", out, "--url", server.url, "--concurrency", "1")
    assert done.exit_code == 130
    kept = len(out.read_text().splitlines())  # 2, or 3 when the third finished before the interrupt was handled
    left = f"{3 - kept} conversation{'' if kept == 2 else 's'}"
    assert words(done.stderr) == (f"interrupted: {out} keeps {kept} conversations regenerated ({kept} by this run), "
                                  f"{tmp_path}/out_error.jsonl 0 conversations that failed; {left} not finished: "
                                  "continue with --resume")
    monkeypatch.setattr(run, "_next", wait)
    done = regen(prompts, "-o", out, "--url", server.url, "--resume")
    assert done.exit_code == 0 and f"({kept} already there)" in words(done.stdout)
    assert sorted(json.loads(line)["index"] for line in out.read_text().splitlines()) == [0, 1, 2]


def test_an_interrupt_during_a_write_still_counts_what_is_on_disk(server, prompts, tmp_path, monkeypatch):
    from dspark_cli.runtime.regen import run

    append = run.append

    def signal_during_fsync(handle, record):  # the record is whole on disk, its count not yet taken
        append(handle, record)
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "append", signal_during_fsync)
    out = tmp_path / "out.jsonl"
    done = regen(prompts, "-o", out, "--url", server.url, "--concurrency", "1")
    assert done.exit_code == 130
    kept = len(out.read_text().splitlines())
    assert kept >= 1 and f"{out} keeps {kept} conversation" in words(done.stderr)


def test_sigterm_is_exit_143_with_what_was_kept(server, prompts, tmp_path, monkeypatch):
    from dspark_cli.errors import Terminated
    from dspark_cli.runtime.regen import run

    def terminated(results):
        raise Terminated()

    monkeypatch.setattr(run, "_next", terminated)
    out = tmp_path / "out.jsonl"
    done = regen(prompts, "-o", out, "--url", server.url)
    assert done.exit_code == 143
    assert words(done.stderr).startswith(f"terminated: {out} keeps ")


class VocabOf:
    """The part of a tokenizer train's reader uses for token-id records: its size."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) + 1 for c in text] for text in texts]}


def test_train_reads_token_ids_as_they_are(tmp_path):
    data = tmp_path / "regen.jsonl"
    data.write_text(json.dumps({"token_ids": [5, 9, 2], "conversations": [], "status": "success"}) + "\n"
                    + json.dumps({"text": "ab"}) + "\n")
    documents = read_documents([data])
    assert documents[0].token_ids == [5, 9, 2]
    stream = tokenize_stream(render_documents(documents, VocabOf(100)), VocabOf(100), separator_id=0)
    assert stream.tolist() == [5, 9, 2, 0, 98, 99, 0]
    with pytest.raises(DsparkError, match=r"regen.jsonl:1: token id 9 is outside the target tokenizer's 8 ids"):
        render_documents(documents, VocabOf(8))


@pytest.mark.parametrize("record, message", [({"status": "error", "error": "x"}, "an error record of dspark regen"),
                                             ({"token_ids": [1, -2]}, "'token_ids' must be a non-empty list")])
def test_train_refuses_error_records_and_bad_ids(tmp_path, record, message):
    data = tmp_path / "regen_error.jsonl"
    data.write_text(json.dumps(record) + "\n")
    with pytest.raises(DsparkError, match=message):
        read_documents([data])
