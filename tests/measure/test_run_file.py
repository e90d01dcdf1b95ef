"""Run files and prompt sets are input: `dspark eval --resume` / `--compare` (and calibrate, plan) read them back, and a
truncated, tampered or hostile file gets one sentence naming the file and the key, exit code 2, no traceback."""

import copy
import json

import pytest
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.measure import evaluation as ev
from dspark_cli.runtime.measure.run_file import check_run_document

runner = CliRunner()


@pytest.fixture(scope="module")
def run_doc(tmp_path_factory) -> dict:
    """A real run file of the demo pair: 2 prompts, 8 new tokens."""
    path = tmp_path_factory.mktemp("run") / "run.json"
    result = runner.invoke(app, ["eval", "--data", str(ev.SHIPPED_SETS[0]), "--limit", "2", "--max-new-tokens", "8",
                                 "--json", str(path)])
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text())


def _tampered(doc: dict, change) -> dict:
    doc = copy.deepcopy(doc)
    change(doc)
    return doc


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


CASES = {
    "missing settings key": (lambda d: d["settings"].pop("seed"), "'settings' lacks the key 'seed'"),
    "string seed": (lambda d: d["settings"].update(seed="7"), "settings.seed must be an integer, not a string"),
    "mistyped max_new_tokens": (lambda d: d["settings"].update(max_new_tokens=True),
                                "settings.max_new_tokens must be an integer, not a boolean"),
    "unknown settings key": (lambda d: d["settings"].update(speed=3), "'settings' has the unknown key 'speed'"),
    "bad confidence rule": (lambda d: d["settings"].update(confidence_rule="max"),
                            "settings.confidence_rule must be one of survival, per-slot"),
    "unknown round key": (lambda d: d["results"][1]["rounds"][0].update(bogus=1),
                          "results[1].rounds[0] has the unknown key 'bogus'"),
    "accepted above proposed": (lambda d: d["results"][0]["rounds"][0].update(accepted=99),
                                "results[0].rounds[0].accepted must be between 0 and"),
    "emitted off by two": (lambda d: d["results"][0]["rounds"][0].update(emitted=d["results"][0]["rounds"][0]
                                                                           ["accepted"] + 2),
                           "results[0].rounds[0].emitted must be accepted or accepted + 1"),
    "short confidences": (lambda d: d["results"][0]["rounds"][0].update(confidences=[0.5]),
                          "results[0].rounds[0].confidences has 1 entries, not one per drafted position"),
    "string logit": (lambda d: d["results"][0]["rounds"][0]["confidence_logits"].__setitem__(2, "x"),
                     "results[0].rounds[0].confidence_logits[2] must be a number, not a string"),
    "negative time": (lambda d: d["results"][0].update(total_s=-1.0), "results[0].total_s must be at least 0"),
    "token not an id": (lambda d: d["results"][0]["tokens"].__setitem__(0, 1.5),
                        "results[0].tokens[0] must be a token id"),
    "unknown set": (lambda d: d["results"][0].update(set_name="nope"),
                    "results[0].set_name names the prompt set 'nope', which 'sets' does not hold"),
    "result lacks rounds": (lambda d: d["results"][0].pop("rounds"), "results[0] lacks the key 'rounds'"),
    "rounds not a list": (lambda d: d["results"][0].update(rounds={"a": 1}),
                          "results[0].rounds must be a list, not an object"),
    "sets not a list": (lambda d: d.update(sets="x"), "'sets' must be a list, not a string"),
    "other format": (lambda d: d.update(format="dspark-eval/9"), "'format' is 'dspark-eval/9', not one of"),
    "block size a float": (lambda d: d["settings"].update(block_size=7.0),
                           "settings.block_size must be an integer, not a number"),
    "round past block size": (lambda d: d["settings"].update(block_size=2),
                              "results[0].rounds[0].drafted must be between 1 and 2"),
    "ragged round": (lambda d: _ragged(d["results"][1]["rounds"][0], 3),
                     "results[1].rounds[0].drafted is 3, not the run's block size 7 (settings.block_size)"),
}


def _ragged(round_: dict, length: int) -> None:
    """One round's lists cut to `length`, consistent within the round: ragged only against the other rounds."""
    round_.update(drafted=length, proposed=min(round_["proposed"], length), accepted=min(round_["accepted"], length),
                  confidences=round_["confidences"][:length], confidence_logits=round_["confidence_logits"][:length])
    round_["emitted"] = round_["accepted"] + 1


@pytest.mark.parametrize("command", [["calibrate", "-o", "sts.json"], ["plan"]])
def test_a_ragged_round_is_one_sentence_naming_the_file_and_the_round(command, run_doc, tmp_path):
    """calibrate and plan stack the rounds' lists: a round of another length was a tensor-shape message."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_tampered(run_doc, lambda d: _ragged(d["results"][0]["rounds"][-1], 3))))
    result = runner.invoke(app, [command[0], str(path), *[str(tmp_path / a) if a.endswith(".json") else a
                                                         for a in command[1:]]])
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in message, message
    last = len(run_doc["results"][0]["rounds"]) - 1
    assert f"{path}: results[0].rounds[{last}].drafted is 3, not the run's block size 7" in message


@pytest.mark.parametrize("name", sorted(CASES))
def test_tampered_run_files_are_one_sentence_in_resume_and_compare(name, run_doc, tmp_path):
    change, expected = CASES[name]
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_tampered(run_doc, change)))
    before = path.read_bytes()
    for flag in ("--resume", "--compare"):
        result = runner.invoke(app, ["eval", flag, str(path)])
        assert result.exit_code == 2, (flag, result.output)
        assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception,
                                                                                            SystemExit)
        assert expected in " ".join(result.output.split()), (flag, result.output)
        assert str(path) in " ".join(result.output.split())
    assert path.read_bytes() == before  # an input is never modified


@pytest.mark.parametrize("text, expected", [
    ("truncated", "is not valid JSON (truncated?)"),
    (_deep(100_000), "nests JSON objects or arrays more than 100 levels deep"),
    ('{"format": "dspark-eval/2", "settings": {"seed": ' + "7" * 5000 + "}}", "is not valid JSON"),
    ("[1, 2]", "the document must be an object, not a list"),
    ("", "is not valid JSON"),
])
def test_unreadable_run_files_are_one_sentence(text, expected, run_doc, tmp_path):
    path = tmp_path / "run.json"
    if text == "truncated":
        text = json.dumps(run_doc)[: len(json.dumps(run_doc)) // 2]
    path.write_text(text)
    for flag in ("--resume", "--compare"):
        result = runner.invoke(app, ["eval", flag, str(path)])
        assert result.exit_code == 2 and expected in " ".join(result.output.split()), (flag, result.output)
        assert result.output.count("error:") == 1


def test_a_written_run_file_passes_and_old_format_still_reads(run_doc, tmp_path):
    assert check_run_document(copy.deepcopy(run_doc), tmp_path / "r.json")["format"] == "dspark-eval/2"
    rounds = [r for result in run_doc["results"] for r in result["rounds"]]
    assert all(len(r["confidence_logits"]) == r["drafted"] for r in rounds)  # raw logits per round and position
    old = _tampered(run_doc, lambda d: d.update(format="dspark-eval/1"))
    for result in old["results"]:
        for r in result["rounds"]:
            del r["confidence_logits"]
    for key in ("calibration",):
        old["settings"].pop(key, None)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    run = ev.EvalRun.load(path)
    assert run.settings["calibration"] is None and len(run.results) == 2


def test_a_directory_or_fifo_is_refused_without_reading(tmp_path):
    import os

    fifo = tmp_path / "run.json"
    os.mkfifo(fifo)
    with pytest.raises(DsparkError, match="not a regular file"):
        ev.EvalRun.load(fifo)  # would block forever if it were opened for reading
    with pytest.raises(DsparkError, match="not a regular file"):
        ev.EvalRun.load(tmp_path)


@pytest.mark.parametrize("line, expected", [
    (_deep(100_000), "line 2 nests JSON objects or arrays more than 100 levels deep"),
    ('{"prompt": ' + "9" * 5000 + "}", "line 2 is not JSON"),
    ('{"turns": ' + _deep(150) + "}", "line 2 nests JSON objects or arrays more than 100 levels deep"),
])
def test_hostile_prompt_sets_name_the_file_and_line(line, expected, tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(DsparkError, match="set.jsonl") as raised:
        ev.read_prompt_set(path)
    assert expected in raised.value.message
    result = runner.invoke(app, ["eval", "--data", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert expected in " ".join(result.output.split())
