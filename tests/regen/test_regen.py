"""`dspark regen`'s library half against a stand-in server (tests/fixtures/regen_server.py): the token ids stored
are the server's, turns run in order with each reply fed to the next, records are appended as they finish, a
resumed run skips what succeeded and retries the rest, concurrency is bounded, an interrupt keeps what finished."""

from __future__ import annotations

import json
import time

import pytest
from regen_server import EOS, PROBE, FakeServer, render, reply_ids

from dspark_cli.errors import DsparkError, SettingError
from dspark_cli.runtime.regen.client import Sampling, base_url, connect
from dspark_cli.runtime.regen.prompts import read_conversations
from dspark_cli.runtime.regen import records
from dspark_cli.runtime.regen.records import error_path
from dspark_cli.runtime.regen.run import Regeneration


@pytest.fixture
def server(request):
    fake = FakeServer(getattr(request, "param", "llamacpp"))
    yield fake
    fake.close()


def write_prompts(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(fake, prompts, out, resume=False, concurrency=2, force=False, on_record=None, **sampling):
    target = connect(fake.url, Sampling(**sampling))
    job = Regeneration(target, read_conversations(prompts), out, resume=resume, concurrency=concurrency, force=force)
    return job, job.execute(on_record)


CHAT = {"conversations": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"},
                          {"role": "assistant", "content": "old reply"}, {"role": "user", "content": "xyz"},
                          {"role": "assistant", "content": "old second"}]}


@pytest.mark.parametrize("server", ["llamacpp", "vllm", "sglang"], indirect=True)
def test_turns_in_order_with_the_servers_own_ids(server, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [CHAT])
    job, tally = run(server, prompts, tmp_path / "out.jsonl")
    assert (tally.succeeded, tally.failed) == (1, 0)
    [record] = lines(tmp_path / "out.jsonl")
    first, second = record["turns"]
    # the ids are the server's sampled ids (a stop token included), not the reply's text tokenized again
    assert first["token_ids"] == reply_ids("cba#1") + [EOS] and first["text"] == "cba#1"
    assert second["token_ids"] == reply_ids("zyx#2") + [EOS] and second["finish_reason"] == "stop"
    # the second turn was sent the first regenerated reply, not the input's assistant message
    assert "".join(map(chr, second["prompt_token_ids"])) == render(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"},
         {"role": "assistant", "content": "cba#1"}, {"role": "user", "content": "xyz"}])
    assert all("old" not in prompt for prompt in server.prompts)
    assert record["conversations"][-1] == {"role": "assistant", "content": "zyx#2"}
    assert record["token_ids"] == second["prompt_token_ids"] + second["token_ids"]
    assert record["settings"] == {"api": "llamacpp" if server.flavour == "llamacpp" else "openai",
                                  "model": "fake-model", "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0,
                                  "max_tokens": 4096, "thinking": False}
    assert lines(error_path(tmp_path / "out.jsonl")) == []


@pytest.mark.parametrize("server", ["llamacpp", "vllm"], indirect=True)
def test_requests_carry_the_sampling_settings(server, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"turns": ["abcdef"]}])
    run(server, prompts, tmp_path / "out.jsonl", temperature=0.6, top_p=0.95, top_k=5, min_p=0.01, max_tokens=3,
        thinking=True)
    probe, body = server.bodies
    assert (probe["n_predict"] if server.flavour == "llamacpp" else probe["max_tokens"]) == 1
    limit = body["n_predict"] if server.flavour == "llamacpp" else body["max_tokens"]
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"], limit) == (0.6, 0.95, 5, 0.01, 3)
    template = server.templated[-1] if server.flavour == "llamacpp" else body
    assert template["chat_template_kwargs"] == {"enable_thinking": True}
    [turn] = lines(tmp_path / "out.jsonl")[0]["turns"]
    assert turn["finish_reason"] == "length" and len(turn["token_ids"]) == 3


@pytest.mark.parametrize("server", ["sglang"], indirect=True)
def test_top_k_off_is_minus_one_on_the_openai_api(server, tmp_path):
    run(server, write_prompts(tmp_path / "p.jsonl", ["abc"]), tmp_path / "out.jsonl", top_k=0)
    assert server.bodies[-1]["top_k"] == -1 and server.bodies[-1]["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("server", ["plain"], indirect=True)
def test_a_server_without_token_ids_is_refused_before_any_work(server):
    with pytest.raises(DsparkError, match=r"failed a one-token request through the openai API: the server returned "
                       "no token ids with its reply"):
        connect(server.url, Sampling())
    assert server.prompts == [PROBE]


def test_a_failed_turn_is_an_error_record_and_the_others_succeed(server, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"turns": ["one"]}, {"turns": ["ok", "FAIL now"]}, "three"])
    _, tally = run(server, prompts, tmp_path / "out.jsonl")
    assert (tally.succeeded, tally.failed) == (2, 1)
    [error] = lines(error_path(tmp_path / "out.jsonl"))
    assert (error["index"], error["turn"]) == (1, 2)
    assert error["error"] == "the server answered /completion with HTTP 500: model exploded."
    assert sorted(r["index"] for r in lines(tmp_path / "out.jsonl")) == [0, 2]


def test_resume_skips_what_succeeded_and_retries_the_errors(server, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"turns": ["one"]}, {"turns": ["FAIL"]}, {"turns": ["three"]}])
    out = tmp_path / "out.jsonl"
    run(server, prompts, out)
    before = out.read_text()
    prompts.write_text(prompts.read_text())  # unchanged input
    server.prompts.clear()
    _, tally = run(server, prompts, out, resume=True)
    assert server.asked() == [render([{"role": "user", "content": "FAIL"}])]  # only the failed one again
    assert (tally.skipped, tally.succeeded, tally.failed) == (2, 0, 1)
    assert out.read_text() == before  # kept as it was: appended to, never rewritten
    assert len(lines(error_path(out))) == 1  # the error file holds this run's errors only


def test_resume_completes_what_an_interrupt_left(server, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"turns": [f"p{i}"]} for i in range(6)])
    out = tmp_path / "out.jsonl"

    def stop_at_the_second(record):
        written.append(record)
        if len(written) == 2:
            raise KeyboardInterrupt

    written = []
    target = connect(server.url, Sampling())
    job = Regeneration(target, read_conversations(prompts), out, resume=False, concurrency=1)
    with pytest.raises(KeyboardInterrupt):
        job.execute(stop_at_the_second)
    kept = lines(out)
    assert len(kept) == job.tally.succeeded >= 2 and job.tally.left == 6 - len(kept)
    fresh = FakeServer()  # the interrupted run's worker may still finish the request it held on the first one
    try:
        _, tally = run(fresh, prompts, out, resume=True)
    finally:
        fresh.close()
    assert tally.skipped == len(kept) and tally.succeeded == 6 - len(kept)
    assert len(fresh.asked()) == 6 - len(kept)
    assert lines(out)[: len(kept)] == kept
    assert sorted(r["index"] for r in lines(out)) == list(range(6))


def test_an_interrupt_writes_the_records_that_finished_meanwhile(server, tmp_path, monkeypatch):
    from dspark_cli.runtime.regen import run as run_module

    wait = run_module._next

    def when_all_finished(results):  # the three replies are in before the first is written
        while results.qsize() < 3:
            time.sleep(0.01)
        return wait(results)

    def interrupt(record):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "_next", when_all_finished)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"turns": [f"p{i}"]} for i in range(3)])
    job = Regeneration(connect(server.url, Sampling()), read_conversations(prompts), tmp_path / "out.jsonl", False, 3)
    with pytest.raises(KeyboardInterrupt):
        job.execute(interrupt)
    assert sorted(r["index"] for r in lines(tmp_path / "out.jsonl")) == [0, 1, 2]
    assert job.tally.succeeded == 3


def test_each_record_is_on_disk_before_the_next(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(records.os, "fsync", lambda fd: synced.append(fd))
    out = tmp_path / "out.jsonl"
    success, errors = records.open_outputs(out, resume=False, force=False)
    with success, errors:
        records.append(success, {"index": 0})
        assert out.read_text() == '{"index": 0}\n' and synced == [success.fileno()]
        records.append(errors, {"index": 1})
        assert error_path(out).read_text() == '{"index": 1}\n' and synced[1] == errors.fileno()


def test_resume_refuses_other_settings_or_another_prompt_file(server, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"turns": ["one"]}, {"turns": ["two"]}])
    out = tmp_path / "out.jsonl"
    run(server, prompts, out)
    with pytest.raises(DsparkError, match=r"other settings \(temperature: 0.7\)"):
        run(server, prompts, out, resume=True, temperature=0.2)
    write_prompts(prompts, [{"turns": ["one"]}, {"turns": ["changed"]}])
    with pytest.raises(DsparkError, match="another prompt than record 2"):
        run(server, prompts, out, resume=True)


def test_resume_cuts_a_partial_last_line(server, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"turns": ["one"]}, {"turns": ["two"]}])
    out = tmp_path / "out.jsonl"
    run(server, prompts, out, concurrency=1)
    whole = out.read_text().splitlines(keepends=True)
    out.write_text(whole[0] + whole[1][:40])  # a hard kill in the middle of the second record
    job, tally = run(server, prompts, out, resume=True)
    assert "cut off a partial last record" in job.notes[0]
    assert (tally.skipped, tally.succeeded) == (1, 1)
    assert sorted(r["index"] for r in lines(out)) == [0, 1]


@pytest.mark.parametrize("concurrency", [1, 3])
def test_concurrency_is_bounded(tmp_path, concurrency):
    fake = FakeServer("vllm", delay=0.15)
    try:
        prompts = write_prompts(tmp_path / "p.jsonl", [{"turns": [f"p{i}"]} for i in range(8)])
        run(fake, prompts, tmp_path / "out.jsonl", concurrency=concurrency)
        assert fake.max_in_flight == concurrency
    finally:
        fake.close()


def test_a_request_past_its_timeout_is_an_error_record(server, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"turns": ["SLOW"]}, {"turns": ["fast"]}])
    target = connect(server.url, Sampling(), timeout=0.5)
    start = time.monotonic()
    tally = Regeneration(target, read_conversations(prompts), tmp_path / "out.jsonl", False, 2).execute()
    assert (tally.succeeded, tally.failed) == (1, 1) and time.monotonic() - start < 1.9
    [error] = lines(error_path(tmp_path / "out.jsonl"))
    assert error["error"] == "the server did not answer /completion within 0.5 s (the timeout option)."


@pytest.mark.parametrize("server", ["llamacpp", "vllm"], indirect=True)
def test_any_failure_of_one_request_is_its_error_record_and_the_rest_are_kept(server, tmp_path, monkeypatch):
    """A reply cut mid-body, a first line that is not HTTP and an exception of any other kind each become that
    conversation's error record; the other conversations, before and after them, succeed."""
    from dspark_cli.runtime.regen.client import Server

    real = Server.reply

    def reply(self, messages):
        if "BUG" in messages[-1]["content"]:
            raise RuntimeError("anything at all")
        return real(self, messages)

    monkeypatch.setattr(Server, "reply", reply)
    turns = ["one", "CUT here", "two", "NOTHTTP here", "three", "BUG here", "four"]
    prompts = write_prompts(tmp_path / "p.jsonl", [{"turns": [turn]} for turn in turns])
    _, tally = run(server, prompts, tmp_path / "out.jsonl", concurrency=3)
    assert (tally.succeeded, tally.failed) == (4, 3)
    assert sorted(r["index"] for r in lines(tmp_path / "out.jsonl")) == [0, 2, 4, 6]
    errors = {r["index"]: r["error"] for r in lines(error_path(tmp_path / "out.jsonl"))}
    path = "/completion" if server.flavour == "llamacpp" else "/v1/chat/completions"
    assert errors[1].startswith(f"the server's answer to {path} broke off or is not HTTP (IncompleteRead")
    assert errors[3].startswith(f"the server's answer to {path} broke off or is not HTTP (BadStatusLine")
    assert errors[5] == "the request failed (RuntimeError: anything at all)."


def test_connect_refuses_bad_addresses_and_models(server):
    with pytest.raises(SettingError, match="not an http"):
        connect("localhost:8080", Sampling())
    with pytest.raises(DsparkError, match=r"cannot reach the server at http://127.0.0.1:9 \(.*\)\. Start the server"):
        connect("http://127.0.0.1:9", Sampling(), timeout=2)
    with pytest.raises(DsparkError, match="serves fake-model, not other"):
        connect(server.url, Sampling(), model="other")
    assert connect(server.url + "/v1/", Sampling()).url == server.url
    assert base_url("https://host:8000/prefix/v1") == "https://host:8000/prefix"


@pytest.mark.parametrize("changes, setting", [({"top_p": 0.0}, "top_p"), ({"temperature": float("nan")}, "temperature"),
                                              ({"min_p": 2.0}, "min_p"), ({"top_k": -1}, "top_k")])
def test_sampling_values_are_checked(changes, setting):
    with pytest.raises(SettingError) as caught:
        Sampling(**changes)
    assert caught.value.setting == setting


@pytest.mark.parametrize("line, problem", [('{"turns": []}', "'turns' must be a non-empty list"),
                                           ('{"messages": [{"role": "tool", "content": "x"}]}', "needs a role"),
                                           ('{"conversations": [{"role": "system", "content": "x"}]}', "no user"),
                                           ('{"text": "x"}', "a record needs 'turns'"), ("[1]", "not list"),
                                           ("{", "is not JSON")])
def test_bad_prompt_records_are_refused_with_file_and_line(tmp_path, line, problem):
    path = tmp_path / "p.jsonl"
    path.write_text('{"turns": ["fine"]}\n' + line + "\n")
    with pytest.raises(DsparkError, match=problem) as caught:
        read_conversations(path)
    assert f"{path}:2" in str(caught.value) or f"{path} line 2" in str(caught.value)


def test_prompt_formats(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", [{"turns": ["a", "b"]}, {"prompt": "c"}, "d",
                                                {"messages": [{"role": "user", "content": "e"}]}])
    found = [c.messages for c in read_conversations(path)]
    assert found[0] == ({"role": "user", "content": "a"}, {"role": "user", "content": "b"})
    assert [m[0]["content"] for m in found[1:]] == ["c", "d", "e"]
    text = tmp_path / "p.txt"
    text.write_text("first\nsecond\n")
    assert [c.messages[0]["content"] for c in read_conversations(text)] == ["first", "second"]
