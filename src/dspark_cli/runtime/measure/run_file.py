"""The eval run file as input: read it with bounded size and nesting, then check every key and value.

A run file is written by `dspark eval --json`, but `--resume`, `--compare`, `dspark calibrate` and `dspark plan` read
it back, and by then it may be truncated (a full disk, a copy cut short), edited by hand or produced by another tool.
`read_run_document` returns the parsed document only when it has the shape `EvalRun` needs; otherwise one sentence
names the file, the key (as a path such as `results[3].rounds[7].accepted`) and what is wrong. Pure Python.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.io.reading import ReadError, read_json_file

RUN_FORMAT = "dspark-eval/2"  # /2 adds the rounds' raw confidence logits
READABLE_FORMATS = ("dspark-eval/1", RUN_FORMAT)
MAX_RUN_BYTES = 4 * 1024**3  # ~3,500 prompts of 2,048 tokens with every round take well under 1 GB
MAX_SEED = 2**64 - 1
CONFIDENCE_RULES = ("survival", "per-slot")
ROUND_TIMES = ("draft_backbone", "markov", "verify", "rollback", "other")  # rollback: runs from stateful targets on


class RunFileError(DsparkError):
    """One problem in a run file; the message names the file and the key."""


def read_run_document(path: Path) -> dict:
    """The checked document of the run file at `path` (a regular file of at most MAX_RUN_BYTES, JSON nested at
    most io.reading.MAX_JSON_DEPTH deep); RunFileError with one sentence otherwise."""
    path = Path(path)
    try:
        doc = read_json_file(path, "run file", MAX_RUN_BYTES, "give a run file `dspark eval` writes with the json option",
                             invalid="is not valid JSON (truncated?)")
    except ReadError as error:
        raise RunFileError(error.message) from None
    return check_run_document(doc, path)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


class _Checker:
    """Checks values against the schema, raising at the first problem with the key's path in the message."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, problem: str) -> None:
        raise RunFileError(f"{self.path}: {where} {problem}; this is not a run file `dspark eval` writes with the json option "
                           "(truncated or edited?): fix the value or run the evaluation again.")

    def keys(self, value: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
        if not isinstance(value, dict):
            self.fail(where, f"must be an object, not {_kind(value)}")
        missing = [k for k in required if k not in value]
        if missing:
            self.fail(where, f"lacks the key {missing[0]!r}")
        unknown = [k for k in value if k not in required and k not in optional]
        if unknown:
            self.fail(where, f"has the unknown key {unknown[0]!r}")
        return value

    def integer(self, value: Any, where: str, low: int = 0, high: int | None = None, null: bool = False) -> None:
        if value is None and null:
            return
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(where, f"must be an integer{' or null' if null else ''}, not {_kind(value)}")
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            self.fail(where, f"must be {bound}, not {value}")

    def number(self, value: Any, where: str, low: float | None = 0.0, null: bool = False, finite: bool = True) -> None:
        if value is None and null:
            return
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            self.fail(where, f"must be a number{' or null' if null else ''}, not {_kind(value)}")
        if finite and not math.isfinite(value):
            self.fail(where, f"must be a finite number, not {value}")
        if low is not None and value < low:
            self.fail(where, f"must be at least {low}, not {value}")

    def string(self, value: Any, where: str, null: bool = False, choices: tuple[str, ...] = ()) -> None:
        if value is None and null:
            return
        if not isinstance(value, str):
            self.fail(where, f"must be a string{' or null' if null else ''}, not {_kind(value)}")
        if choices and value not in choices:
            self.fail(where, f"must be one of {', '.join(choices)}, not {value!r}")

    def boolean(self, value: Any, where: str, null: bool = False) -> None:
        if value is None and null:
            return
        if not isinstance(value, bool):
            self.fail(where, f"must be true or false{' or null' if null else ''}, not {_kind(value)}")

    def items(self, value: Any, where: str, null: bool = False) -> list:
        if value is None and null:
            return []
        if not isinstance(value, list):
            self.fail(where, f"must be a list{' or null' if null else ''}, not {_kind(value)}")
        return value


SETTINGS = ("target", "draft", "device", "dtype", "block_size", "markov", "temperature", "confidence_threshold",
            "confidence_rule", "max_new_tokens", "seed", "chat", "thinking", "baseline", "limit")
SAMPLING_SETTINGS = ("draft_topk", "top_p", "top_k")  # runs of dspark 0.1 lack them: the defaults
RESULT_KEYS = ("set_name", "index", "prompt", "prompt_tokens", "new_tokens", "ttft_s", "total_s", "rounds", "tokens",
               "finished_by_stop", "baseline")
ROUND_KEYS = ("proposed", "accepted", "emitted", "drafted", "confidences")


def check_run_document(doc: Any, path: Path) -> dict:
    """The run file's document if it has the shape EvalRun reads; RunFileError naming the first problem."""
    c = _Checker(path)
    c.keys(doc, "the document", ("format", "settings", "sets", "results"), ("statistics",))
    if doc["format"] not in READABLE_FORMATS:
        c.fail("'format'", f"is {doc['format']!r}, not one of {', '.join(READABLE_FORMATS)} (the formats this dspark "
               "reads)")
    settings = _check_settings(c, doc["settings"])
    names = _check_sets(c, doc["sets"])
    block = settings["block_size"]
    for r, result in enumerate(c.items(doc["results"], "'results'")):
        _check_result(c, result, f"results[{r}]", names, block)
    if "statistics" in doc and not isinstance(doc["statistics"], dict):  # recomputed on every save, never read
        c.fail("'statistics'", f"must be an object, not {_kind(doc['statistics'])}")
    return doc


def _check_settings(c: _Checker, settings: Any) -> dict:
    s = c.keys(settings, "'settings'", SETTINGS, ("calibration", "draft_kind", *SAMPLING_SETTINGS, "requested"))
    for key in ("target", "draft", "device", "dtype", "markov"):
        c.string(s[key], f"settings.{key}")
    c.integer(s["block_size"], "settings.block_size", low=1)  # saved once resolved, before the first result
    c.number(s["temperature"], "settings.temperature")
    c.number(s["confidence_threshold"], "settings.confidence_threshold", null=True)
    if s["confidence_threshold"] is not None and not 0 < s["confidence_threshold"] <= 1:
        c.fail("settings.confidence_threshold", f"must be in (0, 1], not {s['confidence_threshold']}")
    c.string(s["confidence_rule"], "settings.confidence_rule", choices=CONFIDENCE_RULES)
    c.integer(s["max_new_tokens"], "settings.max_new_tokens", low=1)
    c.integer(s["seed"], "settings.seed", high=MAX_SEED)
    c.boolean(s["chat"], "settings.chat", null=True)
    c.boolean(s["thinking"], "settings.thinking")
    c.boolean(s["baseline"], "settings.baseline")
    c.integer(s["limit"], "settings.limit", low=1, null=True)
    c.integer(s.get("draft_topk"), "settings.draft_topk", low=1, null=True)
    c.number(s.get("top_p", 1.0), "settings.top_p")
    c.integer(s.get("top_k", 0), "settings.top_k")
    if "requested" in s:  # the flags as given, what --resume compares the command line with
        c.keys(s["requested"], "settings.requested", (), SETTINGS + SAMPLING_SETTINGS)
    if "draft_kind" in s:  # what the report's header names: "Gemma-4 draft, rnn Markov head"
        c.string(s["draft_kind"], "settings.draft_kind")
    calibration = s.get("calibration")
    if calibration is not None:
        c.keys(calibration, "settings.calibration", ("path", "temperatures"))
        c.string(calibration["path"], "settings.calibration.path")
        for i, t in enumerate(c.items(calibration["temperatures"], "settings.calibration.temperatures")):
            c.number(t, f"settings.calibration.temperatures[{i}]", low=None)
            if t <= 0:
                c.fail(f"settings.calibration.temperatures[{i}]", f"must be above 0, not {t}")
    return s


def _check_sets(c: _Checker, sets: Any) -> set[str]:
    names = set()
    for i, prompt_set in enumerate(c.items(sets, "'sets'")):
        where = f"sets[{i}]"
        c.keys(prompt_set, where, ("name", "path", "prompts"))
        c.string(prompt_set["name"], f"{where}.name")
        c.string(prompt_set["path"], f"{where}.path")
        for j, prompt in enumerate(c.items(prompt_set["prompts"], f"{where}.prompts")):
            c.string(prompt, f"{where}.prompts[{j}]")
        if prompt_set["name"] in names:
            c.fail(f"{where}.name", f"repeats the set name {prompt_set['name']!r}")
        names.add(prompt_set["name"])
    return names


def _check_result(c: _Checker, result: Any, where: str, names: set[str], block: int | None) -> None:
    r = c.keys(result, where, RESULT_KEYS)
    c.string(r["set_name"], f"{where}.set_name")
    if r["set_name"] not in names:
        c.fail(f"{where}.set_name", f"names the prompt set {r['set_name']!r}, which 'sets' does not hold")
    c.integer(r["index"], f"{where}.index")
    c.string(r["prompt"], f"{where}.prompt")
    c.integer(r["prompt_tokens"], f"{where}.prompt_tokens", low=1)
    c.integer(r["new_tokens"], f"{where}.new_tokens")
    c.number(r["ttft_s"], f"{where}.ttft_s")
    c.number(r["total_s"], f"{where}.total_s")
    c.boolean(r["finished_by_stop"], f"{where}.finished_by_stop")
    _check_tokens(c, r["tokens"], f"{where}.tokens")
    if r["baseline"] is not None:
        b = c.keys(r["baseline"], f"{where}.baseline", ("new_tokens", "ttft_s", "total_s", "tokens"))
        c.integer(b["new_tokens"], f"{where}.baseline.new_tokens")
        c.number(b["ttft_s"], f"{where}.baseline.ttft_s")
        c.number(b["total_s"], f"{where}.baseline.total_s")
        _check_tokens(c, b["tokens"], f"{where}.baseline.tokens")
    for i, round_ in enumerate(c.items(r["rounds"], f"{where}.rounds")):
        _check_round(c, round_, f"{where}.rounds[{i}]", block)


def _check_tokens(c: _Checker, tokens: Any, where: str) -> None:
    for i, token in enumerate(c.items(tokens, where)):
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            c.fail(f"{where}[{i}]", f"must be a token id (an integer >= 0), not {token!r}"[:200])


def _check_round(c: _Checker, round_: Any, where: str, block: int | None) -> None:
    r = c.keys(round_, where, ROUND_KEYS, ("confidence_logits", *ROUND_TIMES))
    c.integer(r["drafted"], f"{where}.drafted", low=1, high=block)
    if r["drafted"] != block:  # every round drafts one whole block: a shorter one is ragged against the others
        c.fail(f"{where}.drafted", f"is {r['drafted']}, not the run's block size {block} (settings.block_size): "
               "every round drafts one whole block, so this round's lists are ragged against the others'")
    c.integer(r["proposed"], f"{where}.proposed", high=r["drafted"])
    c.integer(r["accepted"], f"{where}.accepted", high=r["proposed"])
    c.integer(r["emitted"], f"{where}.emitted", low=1)
    if r["emitted"] not in (r["accepted"], r["accepted"] + 1):
        c.fail(f"{where}.emitted", f"must be accepted or accepted + 1 ({r['accepted'] + 1}), not {r['emitted']}")
    for key in ("confidences", "confidence_logits"):
        values = c.items(r.get(key), f"{where}.{key}", null=True)
        if r.get(key) is not None and len(values) != r["drafted"]:
            c.fail(f"{where}.{key}", f"has {len(values)} entries, not one per drafted position ({r['drafted']})")
        for i, value in enumerate(values):  # NaN stays possible: a broken head's values are kept and reported
            c.number(value, f"{where}.{key}[{i}]", low=None, finite=False)
    for key in ROUND_TIMES:
        if key in r:
            c.number(r[key], f"{where}.{key}")


def finite_logits(round_: dict, where: str) -> list[float] | None:
    """A recorded round's raw confidence logits (None when the run has none). A run file keeps NaN / inf from a
    broken confidence head (the report says so); what fits or replays them refuses it here, in one sentence."""
    logits = round_.get("confidence_logits")
    bad = next((x for x in logits or () if not math.isfinite(x)), None)
    if bad is not None:
        raise DsparkError(f"{where} has a confidence logit {bad} (a broken confidence head); calibrating and planning "
                          "need finite logits: fix the draft's confidence head and run the evaluation again.")
    return logits


def round_place(source: str, result, number: int) -> str:
    """Where a round is: 'run.json: round 3 of prompt 2 of eval_code'."""
    return f"{source}: round {number + 1} of prompt {result.index + 1} of {result.set_name}"
