"""The engine cost profile (runtime/measure/engine_profile.py): the document `dspark bench engine` writes, read back
and checked (each kind of bad input one sentence naming the file and the key), and the cost model's arithmetic
against numbers computed by hand."""

from __future__ import annotations

import copy
import json

import pytest

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.measure.engine_profile import PROFILE_FORMAT, read_engine_profile

# Block 4, R in {1, 2}, one context (64), the draft measured at n = 1 and n = 3, three repeats: the middle one as
# given here, one 1.5 times slower, one 0.8 times (so every median is the value given). θ is measured at 1, 2, 4 and
# 10 tokens only.
THETA = {1: 5.0, 2: 6.0, 4: 10.0, 10: 22.0}
PLAIN = {1: 20.0, 2: 24.0}
# spec ms; Δ by hand from the medians, V(R, n + 1) = θ(R·(n + 1)) + D(R) - θ(R) (one context: no attention term)
#   R = 1: V(1, 2) = 6 + 20 - 5 = 21 -> spec 25, Δ 4;   V(1, 4) = 10 + 20 - 5 = 25 -> spec 27, Δ 2
#   R = 2: V(2, 2) = θ(4) + 24 - θ(2) = 28 -> spec 31, Δ 3;   V(2, 4) = θ(8) + 24 - 6 = 18 + 18 = 36 -> spec 45, Δ 9
SPEC = {(1, 1): 25.0, (3, 1): 27.0, (1, 2): 31.0, (3, 2): 45.0}
SPREAD = (1.0, 1.5, 0.8)


def ms(value: float) -> list[float]:
    return [value * f for f in SPREAD]


def good_doc() -> dict:
    return {
        "format": PROFILE_FORMAT, "engine": "llamacpp", "engine_version": "b11434", "hardware": "a test cpu",
        "models": {"target": {"path": "/m/target.gguf", "fingerprint": "s256:aa", "source": "s256:bb"},
                   "draft": {"path": "/m/draft.gguf", "fingerprint": "s256:cc", "source": None}},
        "block_size": 4, "repeats": 3,
        "verify_ms": [{"tokens": m, "ms": ms(v)} for m, v in THETA.items()],
        "plain_ms": [{"requests": r, "context": 64, "ms": ms(v)} for r, v in PLAIN.items()],
        "spec_ms": [{"draft_n": n, "requests": r, "context": 64, "ms": ms(v), "acceptance": 0.25 * n}
                    for (n, r), v in SPEC.items()],
    }


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(good_doc()))
    return read_engine_profile(path)


def test_a_good_profile_round_trips(tmp_path, profile):
    doc = good_doc()
    assert profile.source == str(tmp_path / "costs.json")
    assert (profile.engine, profile.engine_version, profile.hardware) == ("llamacpp", "b11434", "a test cpu")
    assert (profile.block_size, profile.repeats) == (4, 3)
    assert {"target": profile.target.to_dict(), "draft": profile.draft.to_dict()} == doc["models"]
    assert profile.verify == {m: tuple(ms(v)) for m, v in THETA.items()}
    assert profile.plain == {(r, 64): tuple(ms(v)) for r, v in PLAIN.items()}
    assert profile.spec == {(n, r, 64): tuple(ms(v)) for (n, r), v in SPEC.items()}
    assert profile.acceptance == {(n, r, 64): 0.25 * n for (n, r) in SPEC}
    assert (profile.concurrencies, profile.contexts, profile.draft_ns) == ([1, 2], [64], [1, 3])
    assert profile.plain_ms(2, 64) == (24.0, 36.0, 24.0 * 0.8) and profile.median_plain(2, 64) == 24.0
    assert read_engine_profile(tmp_path / "other name", doc) == read_engine_profile(tmp_path / "other name",
                                                                                       json.loads(json.dumps(doc)))


def test_theta_is_the_median_interpolated_between_measured_counts_and_clamped(profile, tmp_path):
    assert profile.theta_ms(3) == pytest.approx(8.0)  # 6 + (3 - 2) / (4 - 2) · (10 - 6)
    assert profile.theta_ms(7) == pytest.approx(16.0)  # 10 + 3 / 6 · 12
    assert profile.theta_ms(2.5) == pytest.approx(7.0)  # a mean verify length is not an integer
    assert profile.theta_ms(4) == 10.0 and profile.theta_ms(10) == 22.0
    assert profile.theta_ms(0.5) == 5.0 and profile.theta_ms(20) == 22.0  # held beyond the measured ones
    disturbed = good_doc()
    disturbed["verify_ms"][2]["ms"] = [10.0, 1000.0, 9.0]  # one pass disturbed at 4 tokens: the median stays 10
    assert read_engine_profile(tmp_path / "d.json", disturbed).theta_ms(3) == pytest.approx(8.0)


def test_verify_draft_and_step_by_hand(profile):
    # V(R, t, c) = θ(R·t) + D(R, c) - θ(R), from the medians
    assert profile.verify_ms(2, 1.5, 64) == pytest.approx(8.0 + 24.0 - 6.0)  # θ(3) = 8
    assert profile.verify_ms(1, 1, 64) == pytest.approx(20.0)  # one token each: the plain step itself
    assert profile.verify_ms(2, 4, 64) == pytest.approx(36.0)
    # Δ_i = S_i - V: per repeat, at the measured n, linear between them, held beyond them
    assert [profile.draft_ms(2, n, 64, 0) for n in (1, 2, 3, 4)] == pytest.approx([3.0, 6.0, 9.0, 9.0])
    assert [profile.draft_ms(1, n, 64, 0) for n in (1, 2, 3, 4)] == pytest.approx([4.0, 3.0, 2.0, 2.0])
    assert [profile.draft_ms(2, n, 64, 1) for n in (1, 2, 3)] == pytest.approx([46.5 - 28, 25.0, 67.5 - 36])
    assert [profile.draft_ms(2, n, 64, 2) for n in (1, 2, 3)] == pytest.approx([24.8 - 28, -1.6, 0.0])
    # step_i = max(D_i, Δ_i + V)
    assert profile.step_ms(2, 64, 2, 1.5) == pytest.approx([26.0 + 6.0, 26.0 + 25.0, 26.0 - 1.6])
    assert profile.step_ms(2, 64, 3, 4) == pytest.approx(ms(45.0))  # a measured n verifying all n: S_i itself
    assert profile.step_ms(1, 64, 1, 2) == pytest.approx(ms(25.0))


def test_a_step_is_never_below_the_plain_step(tmp_path):
    doc = good_doc()
    doc["spec_ms"][2]["ms"] = [31.0, 46.5, 10.0]  # n = 1, R = 2: the third pass 10 ms, Δ_2 = 10 - 28 < 0
    profile = read_engine_profile(tmp_path / "costs.json", doc)
    assert profile.draft_ms(2, 1, 64, 2) == pytest.approx(-18.0)
    assert profile.step_ms(2, 64, 1, 2) == pytest.approx([31.0, 46.5, 24.0 * 0.8])  # the plain step of that pass


def test_each_further_scored_token_pays_the_contexts_attention(tmp_path):
    """A(R, c) = D(R, c) - D(R, 0), D(R, 0) extrapolated from the two smallest contexts: at R = 1 the plain step is
    20 ms at context 64 and 27 ms at 512 (7 ms per 448 tokens), so D(1, 0) = 19; at 1024 it is 30 ms (A = 11, not
    the line's 35 - 19 = 16). At R = 2 the plain step falls with the context: A is held at 0."""
    doc = good_doc()
    plain = {(1, 64): 20.0, (1, 512): 27.0, (1, 1024): 30.0, (2, 64): 24.0, (2, 512): 23.0, (2, 1024): 23.5}
    doc["plain_ms"] = [{"requests": r, "context": c, "ms": ms(v)} for (r, c), v in plain.items()]
    doc["spec_ms"] = [{"draft_n": n, "requests": r, "context": c, "ms": ms(60.0)} for n in (1, 3) for (r, c) in plain]
    profile = read_engine_profile(tmp_path / "costs.json", doc)
    assert [profile.context_ms(1, c) for c in (64, 512, 1024)] == pytest.approx([1.0, 8.0, 11.0])
    assert [profile.context_ms(2, c) for c in (64, 512, 1024)] == [0.0, 0.0, 0.0]
    # V(R, t, c) = θ(R·t) + D(R, c) - θ(R) + (t - 1)·A(R, c)
    assert profile.verify_ms(1, 3, 512) == pytest.approx(8.0 + 27.0 - 5.0 + 2 * 8.0)
    assert profile.verify_ms(1, 1, 1024) == pytest.approx(30.0)  # the anchor alone: the plain step
    assert profile.verify_ms(1, 2.5, 64) == pytest.approx(7.0 + 20.0 - 5.0 + 1.5 * 1.0)
    assert profile.draft_ms(1, 1, 512, 0) == pytest.approx(60.0 - (6.0 + 27.0 - 5.0 + 8.0))
    assert profile.verify_ms(2, 2, 1024) == pytest.approx(10.0 + 23.5 - 6.0)
    single = read_engine_profile(tmp_path / "one.json", good_doc())  # one context: no attention term
    assert single.context_ms(1, 64) == 0.0 and single.verify_ms(1, 4, 64) == pytest.approx(10 + 20 - 5)


def test_check_covers_names_what_was_not_measured(profile):
    profile.check_covers([1, 2], [64], "costs.json")
    with pytest.raises(DsparkError, match="costs.json was measured at concurrency 1, 2, not 4"):
        profile.check_covers([1, 4], [64], "costs.json")
    with pytest.raises(DsparkError, match="costs.json was measured at context 64 tokens, not 512"):
        profile.check_covers([1], [512], "costs.json")


def _set(path: str, value):
    """An edit of the good document: set the value at a dotted path (list indices as numbers); DELETE removes."""
    def edit(doc):
        keys = path.split(".")
        node = doc
        for key in keys[:-1]:
            node = node[int(key)] if key.isdigit() else node[key]
        last = int(keys[-1]) if keys[-1].isdigit() else keys[-1]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return edit


DELETE = object()


def _spec_without_plain(doc):
    doc["spec_ms"].append({"draft_n": 1, "requests": 4, "context": 64, "ms": [1.0, 2.0, 3.0]})


def _plain_without_spec(doc):
    doc["plain_ms"].append({"requests": 4, "context": 64, "ms": [1.0, 2.0, 3.0]})  # verify_ms has 4 tokens


def _duplicate(doc):
    doc["plain_ms"].append(dict(doc["plain_ms"][0]))


def _draft_n_beyond_the_block(doc):
    for point in doc["spec_ms"]:  # every n = 3 point becomes n = 5, more than the block size 4
        point["draft_n"] = 5 if point["draft_n"] == 3 else point["draft_n"]


def _plain_without_verify(doc):
    doc["verify_ms"] = [p for p in doc["verify_ms"] if p["tokens"] != 2]


BAD = [  # (edit, the key the message names, what it says)
    (_set("format", "dspark-engine-costs/2"), "'format'", "must be 'dspark-engine-costs/1'"),
    (_set("format", DELETE), "'format'", "must be 'dspark-engine-costs/1'"),
    (_set("repeats", 0), "'repeats'", "an integer from 1 to 1000"),
    (_set("repeats", "2"), "'repeats'", "an integer from 1 to 1000"),
    (_set("repeats", True), "'repeats'", "an integer from 1 to 1000"),
    (_set("repeats", 2), "'verify_ms[0].ms'", "must hold 2 finite times above 0"),  # the points hold 3 samples
    (_set("block_size", 0), "'block_size'", "an integer from 1 to 1024"),
    (_set("block_size", 2.5), "'block_size'", "an integer from 1 to 1024"),
    (_set("verify_ms.1.ms", [6.0, 9.0]), "'verify_ms[1].ms'", "must hold 3 finite times above 0"),  # one missing
    (_set("plain_ms.1.ms", [24.0, 36.0, 19.0, 50.0]), "'plain_ms[1].ms'", "must hold 3 finite times above 0"),
    (_set("plain_ms.0.ms", [20.0, 0.0, 16.0]), "'plain_ms[0].ms'", "must hold 3 finite times above 0"),
    (_set("spec_ms.2.ms", [31.0, -1.0, 24.8]), "'spec_ms[2].ms'", "must hold 3 finite times above 0"),
    (_set("verify_ms.0.ms", [float("nan"), 7.5, 4.0]), "'verify_ms[0].ms'", "must hold 3 finite times above 0"),
    (_set("verify_ms.0.ms", [5.0, float("inf"), 4.0]), "'verify_ms[0].ms'", "must hold 3 finite times above 0"),
    (_set("verify_ms.0.ms", ["5", 7.5, 4.0]), "'verify_ms[0].ms'", "must hold 3 finite times above 0"),
    (_set("verify_ms.0.ms", [True, 7.5, 4.0]), "'verify_ms[0].ms'", "must hold 3 finite times above 0"),
    (_set("verify_ms.0.ms", 5.0), "'verify_ms[0].ms'", "must hold 3 finite times above 0"),
    (_set("verify_ms.0.tokens", "1"), "'verify_ms[0]'", "needs tokens as integers"),
    (_set("verify_ms.0.tokens", 0), "'verify_ms[0]'", "needs tokens as integers"),
    (_set("plain_ms.0.requests", True), "'plain_ms[0]'", "needs requests, context as integers"),
    (_set("plain_ms.0.context", -1), "'plain_ms[0]'", "needs requests, context as integers (context >= 0"),
    (_set("spec_ms.0.draft_n", 0), "'spec_ms[0]'", "needs draft_n, requests, context as integers"),
    (_set("spec_ms.0.draft_n", 1.0), "'spec_ms[0]'", "needs draft_n, requests, context as integers"),
    (_set("spec_ms.0", [1, 1, 64]), "'spec_ms[0]'", "must be an object"),
    (_set("spec_ms", {"draft_n": 1}), "'spec_ms'", "must be a list of at most"),
    (_set("verify_ms", []), "'verify_ms'", "is empty"),
    (_set("spec_ms", []), "'spec_ms'", "is empty"),
    (_spec_without_plain, "'spec_ms'", "has a point at 4 requests and context 64 that plain_ms lacks"),
    (_plain_without_spec, "'spec_ms'", "lacks a point at 4 requests and context 64"),
    (_plain_without_verify, "'verify_ms'", "lacks 2 tokens"),
    (_duplicate, "'plain_ms[2]'", "repeats another point"),
    (_draft_n_beyond_the_block, "'spec_ms'", "has a draft_n outside 1..block_size (4)"),
    (_set("spec_ms.0.acceptance", 1.5), "'spec_ms.acceptance'", "from 0 to 1 or null"),
    (_set("spec_ms.0.acceptance", "0.5"), "'spec_ms.acceptance'", "from 0 to 1 or null"),
    (_set("models", DELETE), "'models'", "must be an object with 'target' and 'draft'"),
    (_set("models.target", "t.gguf"), "'models.target'", "must be an object"),
    (_set("models.draft.path", 7), "'models.draft'", "path, fingerprint and source as strings or null"),
    (_set("engine", ""), "'engine'", "a non-empty string"),
    (_set("engine_version", None), "'engine_version'", "a non-empty string"),
    (_set("hardware", 3), "'hardware'", "a non-empty string"),
]


@pytest.mark.parametrize("edit, key, says", BAD, ids=[f"{i}-{key}" for i, (_, key, _) in enumerate(BAD)])
def test_each_bad_profile_is_one_sentence_naming_the_file_and_the_key(tmp_path, edit, key, says):
    doc = copy.deepcopy(good_doc())
    edit(doc)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(DsparkError) as error:
        read_engine_profile(path)
    message = str(error.value)
    assert message.startswith(f"{path}: {key} "), message
    assert says in message, message
    assert "\n" not in message and message.endswith("measure it again.")


def test_not_a_profile_at_all(tmp_path):
    path = tmp_path / "costs.json"
    for text, says in (("[1, 2]", "'format'"), ("{", "not valid JSON"), ('{"format": "dspark-plan/1"}', "'format'")):
        path.write_text(text)
        with pytest.raises(DsparkError) as error:
            read_engine_profile(path)
        assert str(path) in str(error.value) and says in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(DsparkError, match="missing.json"):
        read_engine_profile(tmp_path / "missing.json")
