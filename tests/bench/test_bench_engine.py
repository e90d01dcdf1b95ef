"""`dspark bench engine`'s library half (runtime/bench/engine.py) against stand-in llama-servers whose timings come
from a known cost model (tests/fixtures/fake_llama_server.py): the profile recovers the model's numbers, sample i of
every point comes from the same pass (interleaved repeats, the warm-up dropped), and what cannot be profiled is
refused in one sentence before any sample."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from fake_llama_server import Costs, FakeLlamaServer, demo_ggufs
from verdict_inputs import verify_tokens

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.bench.engine import ProfileConfig, profile_engine
from dspark_cli.runtime.checkpoint.fingerprint import file_fingerprint, folder_fingerprint
from dspark_cli.runtime.demo import DEMO_DIR
from dspark_cli.runtime.measure.engine_profile import PROFILE_FORMAT, read_engine_profile

TEXT = "def read_config(path):\n    return open(path).read()\n" * 20
CONCURRENCIES, CONTEXTS, NS, REPEATS, GENERATE = (1, 2), (16, 64), (2, 7), 3, 9
LOADS = {-1: 5.0, 0: 1.0, 1: 1.25, 2: 0.8}  # per pass: the warm-up (dropped) under a heavy load


def costs() -> Costs:
    return Costs(theta=lambda m: 3.0 + 0.5 * m + 0.01 * m * m, plain=lambda r, c: 10.0 + 2.0 * r + 0.01 * c * r,
                 delta=lambda n, r, c: 1.0 + 0.5 * n * r + 0.001 * c, accept={2: 1, 7: 3})


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    return demo_ggufs(tmp_path_factory.mktemp("ggufs"))


def config(plain, servers, draft, **changes) -> ProfileConfig:
    base = ProfileConfig(plain=plain.url, spec=[(s.draft_n, s.url) for s in servers], concurrencies=CONCURRENCIES,
                         contexts=CONTEXTS, text=TEXT, draft_file=str(draft), repeats=REPEATS, generate=GENERATE,
                         timeout_s=30)
    return replace(base, **changes)


@pytest.fixture(scope="module")
def profiled(ggufs):
    """One profile of three fake servers (plain, drafting 2, drafting 7), the load changed between passes."""
    target, draft = ggufs
    model = costs()
    model.load = LOADS[-1]
    jobs = len(verify_tokens(7, CONCURRENCIES)) + len(CONCURRENCIES) * len(CONTEXTS) * (1 + len(NS))
    seen = []

    def on_sample(job, repeat, ms):
        seen.append((job, repeat))
        if len(seen) % jobs == 0:  # a pass is over: the next one runs under its own load
            model.load = LOADS.get(len(seen) // jobs - 1, 1.0)

    with pytest.MonkeyPatch.context() as monkeypatch, model.gangs(monkeypatch), \
            FakeLlamaServer(model, model_path=str(target)) as plain, \
            FakeLlamaServer(model, 2, model_path=str(target)) as two, \
            FakeLlamaServer(model, 7, model_path=str(target)) as seven:
        document = profile_engine(config(plain, [two, seven], draft), on_sample=on_sample)
        urls = {"plain": plain.url, "spec": {"2": two.url, "7": seven.url}}
    return document, model, seen, jobs, urls


def test_the_profile_recovers_the_cost_model(profiled, ggufs):
    document, model, _, _, urls = profiled
    target, draft = ggufs
    loads = [LOADS[i] for i in range(REPEATS)]
    assert document["format"] == PROFILE_FORMAT and document["engine"] == "llamacpp"
    assert document["engine_version"] == "b11434-fake" and document["servers"] == urls
    assert (document["block_size"], document["repeats"], document["generate"]) == (7, REPEATS, GENERATE)
    assert document["models"] == {
        "target": {"path": str(target.resolve()), "fingerprint": file_fingerprint(target),
                   "source": folder_fingerprint(DEMO_DIR / "target")},
        "draft": {"path": str(draft.resolve()), "fingerprint": file_fingerprint(draft),
                  "source": folder_fingerprint(DEMO_DIR / "draft")}}
    assert [p["tokens"] for p in document["verify_ms"]] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]
    for point in document["verify_ms"]:
        assert point["ms"] == pytest.approx([model.theta(point["tokens"]) * load for load in loads])
    assert {(p["requests"], p["context"]) for p in document["plain_ms"]} == {(r, c) for r in (1, 2) for c in (16, 64)}
    for point in document["plain_ms"]:
        assert point["ms"] == pytest.approx([model.plain(point["requests"], point["context"]) * load
                                             for load in loads])
    assert len(document["spec_ms"]) == 8
    for point in document["spec_ms"]:
        n, r, c = point["draft_n"], point["requests"], point["context"]
        assert point["ms"] == pytest.approx([model.spec(n, r, c) * load for load in loads])
        # GENERATE - 1 = 8 tokens after the first: drafting 2 and accepting 1 a step: 4 accepted in 4 steps
        # (8 drafted); drafting 7 and accepting 3: 6 accepted in 2 steps (14 drafted)
        assert point["acceptance"] == pytest.approx(4 / 8 if n == 2 else 6 / 14)

    profile = read_engine_profile(Path("costs.json"), document)
    for n in NS:
        for r in CONCURRENCIES:
            for c in CONTEXTS:  # pass 0 ran at load 1, the median load
                assert profile.draft_ms(r, n, c, 0) == pytest.approx(model.delta(n, r, c))
    assert profile.context_ms(2, 64) == pytest.approx(0.01 * 64 * 2)  # D(2, 64) - D(2, 0)
    assert profile.verify_ms(2, 3, 16) == pytest.approx(model.theta(6) + model.plain(2, 16) - model.theta(2)
                                                        + 2 * 0.01 * 16 * 2)


def test_repeats_are_interleaved_passes_after_a_dropped_warm_up(profiled):
    """Every pass samples every point once, in a rotated order; the profile's sample i of every point comes from
    pass i (its load), the warm-up's samples from none."""
    _, model, seen, jobs, _ = profiled
    assert len(seen) == (1 + REPEATS) * jobs
    assert [repeat for _, repeat in seen] == [r for r in range(-1, REPEATS) for _ in range(jobs)]
    passes = [[job for job, _ in seen[i * jobs:(i + 1) * jobs]] for i in range(1 + REPEATS)]
    assert all(sorted(p) == sorted(passes[0]) and len(set(p)) == jobs for p in passes)
    assert len({p[0] for p in passes[1:]}) == REPEATS  # each pass starts elsewhere

    served = []  # the servers' own log, one entry per job: R decode requests of one point count once
    log = iter(model.log)
    for entry in log:
        if entry[1] == "decode":
            rest = [next(log) for _ in range(entry[2] - 1)]
            assert all(e == entry for e in rest)  # the R requests of a point arrived together (a barrier of R)
        served.append(entry)
    expected = []
    for job, _ in seen:
        if job[0] == "verify":
            expected.append(("plain", "verify", job[1]))
        elif job[0] == "plain":
            expected.append(("plain", "decode", job[1], job[2]))
        else:
            expected.append((f"spec{job[1]}", "decode", job[2], job[3]))
    assert served == expected


def test_a_speculative_server_that_drafts_nothing_is_refused(ggufs):
    target, draft = ggufs
    model = costs()
    with pytest.MonkeyPatch.context() as monkeypatch, model.gangs(monkeypatch), \
            FakeLlamaServer(model, model_path=str(target)) as plain, \
            FakeLlamaServer(model, 2, model_path=str(target), drafts=False) as idle:
        with pytest.raises(DsparkError) as refused:
            profile_engine(config(plain, [idle], draft, repeats=1))
    assert str(refused.value) == (f"the server at {idle.url} drafted nothing: it is not speculating (started without "
                                  "a draft model and a speculative type?); give a server that drafts.")


def test_a_plain_server_that_reuses_its_cache_for_a_fresh_prompt_is_refused(ggufs):
    target, draft = ggufs
    model = costs()
    with FakeLlamaServer(model, model_path=str(target), reuses_cache=True) as plain, \
            FakeLlamaServer(model, 2, model_path=str(target)) as spec:
        with pytest.raises(DsparkError) as refused:
            profile_engine(config(plain, [spec], draft, repeats=1))
    assert str(refused.value) == (f"the plain server at {plain.url} processed 1 prompt tokens of a fresh 2-token prompt; "
                                  "it must not reuse a cache here.")  # at 2 tokens: the 1-token prompt before it has none to reuse


def refusal(ggufs, plain_options: dict | None = None, spec_options: dict | None = None, **changes) -> str:
    """The one sentence profile_engine refuses with (no sample is taken: the fakes' log stays empty)."""
    target, draft = ggufs
    model = costs()
    with FakeLlamaServer(model, **{"model_path": str(target), **(plain_options or {})}) as plain, \
            FakeLlamaServer(model, 2, **{"model_path": str(target), **(spec_options or {})}) as spec:
        with pytest.raises(DsparkError) as refused:
            profile_engine(config(plain, [spec], draft, **changes))
        message = str(refused.value).replace(plain.url, "PLAIN").replace(spec.url, "SPEC")
    assert model.log == [] and "\n" not in message
    return message


@pytest.mark.parametrize("answer, words", [("bare", "answered POST /completion without timings."),
                                           ("list", "answered POST /completion with JSON that is not an object")])
def test_an_answer_without_timings_is_one_sentence(ggufs, answer, words):
    """A server that answers /completion in another shape stops the profile in one sentence naming it (was a
    KeyError or AttributeError in a request thread, then a TypeError)."""
    target, draft = ggufs
    for role in ("plain", "spec"):
        model = costs()
        options = {"model_path": str(target), "answer": answer}
        with pytest.MonkeyPatch.context() as monkeypatch, model.gangs(monkeypatch), \
                FakeLlamaServer(model, **(options if role == "plain" else options | {"answer": "timings"})) as plain, \
                FakeLlamaServer(model, 2, **(options if role == "spec" else options | {"answer": "timings"})) as spec:
            with pytest.raises(DsparkError) as refused:
                profile_engine(config(plain, [spec], draft, repeats=1))
        url = plain.url if role == "plain" else spec.url
        assert str(refused.value).startswith(f"the server at {url} {words}"), str(refused.value)


def test_tokens_that_are_not_ids_are_one_sentence(ggufs):
    assert refusal(ggufs, plain_options={"answer": "pieces"}) == (
        "the plain server at PLAIN answered POST /tokenize without a list of token ids; check that it is a running "
        "llama-server.")


def test_a_server_that_is_not_llamacpp_is_refused(ggufs):
    assert refusal(ggufs, plain_options={"llama": False}) == (
        "the plain server at PLAIN is not a llama-server (no build_info in GET /props): `dspark bench engine` reads "
        "llama.cpp's per-request timings; for vLLM, SGLang or TensorRT-LLM give `dspark plan` their own cost tables.")
    assert refusal(ggufs, spec_options={"llama": False}).startswith(
        "the speculative server (n = 2) at SPEC is not a llama-server")


def test_too_few_slots_or_too_little_context_is_refused(ggufs):
    assert refusal(ggufs, spec_options={"slots": 1}) == (
        "the speculative server (n = 2) at SPEC has 1 slots but the concurrency option asks for 2; start it with -np 2 "
        "or more.")
    assert refusal(ggufs, plain_options={"n_ctx": 80}) == (
        "the plain server at PLAIN gives each slot 80 tokens of context, but the largest context asked plus the "
        "generated tokens need 82; start it with a larger -c.")  # 64 + 9 + 7 + 2


def test_servers_of_another_target_or_a_longer_draft_are_refused(ggufs):
    assert refusal(ggufs, spec_options={"model_path": "/other/target.gguf"}).startswith(
        "the speculative server at SPEC serves /other/target.gguf but the plain server ")
    target, draft = ggufs
    model = costs()
    with FakeLlamaServer(model, model_path=str(target)) as plain, FakeLlamaServer(model, 9) as nine:
        with pytest.raises(DsparkError, match="is said to draft 9 tokens, more than the draft's block size 7"):
            profile_engine(config(plain, [nine], draft))


def test_settings_and_files_are_checked_before_any_request(ggufs, tmp_path):
    target, draft = ggufs
    model = costs()
    with FakeLlamaServer(model, model_path=str(target)) as plain, \
            FakeLlamaServer(model, 2, model_path=str(target)) as spec:
        cases = [
            (dict(spec=[]), "give at least one speculative server"),
            (dict(spec=[(2, spec.url), (2, spec.url)]), "two speculative servers draft the same number of tokens"),
            (dict(concurrencies=(1, 1)), "the concurrency option takes distinct integers"),
            (dict(contexts=(0, 16)), "the context option takes distinct token counts >= 1"),
            (dict(repeats=0), "the repeats option must be from 1 to 1000, got 0"),
            (dict(generate=3), "the generate option must be at least 4 tokens, got 3"),
            (dict(draft_file=str(tmp_path / "missing.gguf")), "the draft file .* does not exist"),
            (dict(text="short"), "the prompts give fewer than 16 tokens"),
        ]
        for changes, says in cases:
            with pytest.raises(DsparkError, match=says):
                profile_engine(config(plain, [spec], draft, **changes))
        not_gguf = tmp_path / "draft.gguf"
        not_gguf.write_bytes(b"not a gguf file at all")
        with pytest.raises(DsparkError, match="is not a readable GGUF file"):
            profile_engine(config(plain, [spec], not_gguf))
        with pytest.raises(DsparkError, match="has no dflash.block_size: give the draft GGUF"):
            profile_engine(config(plain, [spec], target))  # the target's GGUF given as the draft
    assert model.log == []
    closed = plain.url  # stopped above
    with pytest.raises(DsparkError, match=f"cannot reach the plain server at {closed}"):
        profile_engine(replace(config(plain, [spec], draft), plain=closed))
