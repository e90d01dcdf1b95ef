"""`dspark bench audit` against stand-in engines (llama.cpp's, vLLM's and SGLang's APIs on loopback): every
generated token compared, near ties of the reference passed over, drafting counts read per request, the T > 0
test's two sides, verdicts, exit codes and the JSON document. vLLM and SGLang are tested only this way here (their
API as their sources define it); tests/bench/test_audit_real.py runs the real llama-server."""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass, field

import pytest
from loopback import JsonHandler, LoopbackServer
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import EXIT_FINDINGS, EXIT_INCONCLUSIVE
from dspark_cli.runtime.bench.audit import (MAX_TIES, AuditConfig, AuditPrompt, ReferenceRun, audit_prompt,
                                            divergence, run_audit, shipped_prompts)
from dspark_cli.runtime.bench.audit_stats import chi2_survival, homogeneity_test, pooled_bins

VOCAB = 97
WEIGHTS = [0.6 ** k for k in range(10)]  # the stand-in's sampling distribution over tokens 0..9


def greedy_tokens(prompt: list[int], n: int) -> list[int]:
    """A function of the absolute position only, so a continuation from any greedy prefix goes on alike."""
    return [(len(prompt) + i) * 7 % VOCAB for i in range(n)]


def sampled_tokens(seed: int, n: int, top_p: float, top_k: int) -> list[int]:
    """Tokens 0..9 weighted 0.6^k, cut by top-k (0: off) then top-p (the smallest prefix holding top_p)."""
    kept = WEIGHTS[:top_k] if top_k > 0 else list(WEIGHTS)
    mass, cut = sum(kept), []
    for weight in kept:
        cut.append(weight)
        if sum(cut) >= top_p * mass - 1e-12:
            break
    rng = random.Random(seed)
    return [rng.choices(range(len(cut)), cut)[0] for _ in range(n)]


@dataclass
class StandIn:
    """One engine: `api` llamacpp (/tokenize, /completion with timings) or vllm (/v1/completions with
    return_token_ids, /metrics counters). `change_at`: greedy answers get another token there; `drafted` /
    `accepted`: its drafting per request; `honor_top_p` False: it samples as if top_p were 1."""

    api: str = "llamacpp"  # or "vllm", "sglang" (/v1/completions; SGLang: its mean accept length in server info)
    accept_length: float = 2.5
    change_at: int | None = None
    drafted: int = 14
    accepted: int = 6
    honor_top_p: bool = True
    bodies: list[dict] = field(default_factory=list)
    counters: list[int] = field(default_factory=lambda: [0, 0, 0])  # vLLM: drafts, draft tokens, accepted
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> "StandIn":
        engine = self

        class Handler(JsonHandler):
            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"data": [{"id": "stand-in"}]})
                elif self.path == "/props" and engine.api == "llamacpp":
                    self._send(200, {"default_generation_settings": {}})
                elif self.path == "/get_server_info" and engine.api == "sglang":
                    self._send(200, {"internal_states": [{"avg_spec_accept_length": engine.accept_length}]})
                elif self.path == "/metrics" and engine.api == "vllm":
                    data = engine.metrics().encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._send(200, engine.answer(self.path, body))

        self.server = LoopbackServer(Handler)
        return self

    def __exit__(self, *exc) -> None:
        self.server.close()

    @property
    def url(self) -> str:
        return self.server.url

    def metrics(self) -> str:
        drafts, tokens, accepted = self.counters
        return (f"vllm:spec_decode_num_drafts_total{{engine=\"0\"}} {drafts}\n"
                f"vllm:spec_decode_num_draft_tokens_total{{engine=\"0\"}} {tokens}\n"
                f"vllm:spec_decode_num_accepted_tokens_total{{engine=\"0\"}} {accepted}\n")

    def generate(self, prompt: list[int], n: int, body: dict) -> list[int]:
        with self.lock:
            self.bodies.append(body)
            self.counters = [self.counters[0] + 2, self.counters[1] + self.drafted,
                             self.counters[2] + self.accepted]
        if body["temperature"] == 0:
            tokens = greedy_tokens(prompt, n)
            if self.change_at is not None and n > self.change_at:
                tokens[self.change_at] = (tokens[self.change_at] + 1) % VOCAB
            return tokens
        top_p = body.get("top_p", 1.0) if self.honor_top_p else 1.0
        return sampled_tokens(body["seed"], n, top_p, body.get("top_k", 0))

    def answer(self, path: str, body: dict) -> dict:
        if path == "/tokenize":
            return {"tokens": [ord(c) % VOCAB for c in body["content"]]}
        if path == "/detokenize":
            return {"content": " ".join(map(str, body["tokens"]))}
        if path == "/completion":
            tokens = self.generate(body["prompt"], body["n_predict"], body)
            timings = {"draft_n": self.drafted, "draft_n_accepted": self.accepted} if self.drafted else {}
            return {"tokens": tokens, "timings": timings}
        prompt = body["prompt"] if isinstance(body["prompt"], list) else [ord(c) % VOCAB for c in body["prompt"]]
        tokens = self.generate(prompt, body["max_tokens"], body)
        return {"choices": [{"text": "", "token_ids": tokens, "prompt_token_ids": prompt}]}


PROMPTS = [AuditPrompt("code", "def f(x):"), AuditPrompt("tool_call", '{"name": "read_file", "arguments": {')]


def audit(spec: StandIn, plain: StandIn, **changes):
    settings = dict(speculative=spec.url, plain=plain.url, prompts=PROMPTS, max_tokens=16, samples=0)
    return run_audit(AuditConfig(**{**settings, **changes}))


# --- T = 0 --------------------------------------------------------------------------------------------------


def test_identical_engines_are_identical_with_their_drafting_counts():
    with StandIn() as spec, StandIn(drafted=0, accepted=0) as plain:
        report = audit(spec, plain)
    assert report.verdict == "identical" and report.exit_code == 0
    for result in report.prompts:
        assert result.verdict == "identical" and len(result.speculative) == 16
        assert (result.drafted, result.accepted) == (14, 6)
    assert all(b["temperature"] == 0 and b["ignore_eos"] and b["n_predict"] == 16 for b in spec.bodies)


def test_a_token_changed_after_the_first_block_is_found_where_it_is():
    """Position 9 lies after a 7-token block: an audit comparing a prefix only would call this identical."""
    with StandIn(change_at=9) as spec, StandIn() as plain:
        report = audit(spec, plain)
    assert report.verdict == "differs" and report.exit_code == EXIT_FINDINGS
    for result in report.prompts:
        d = result.vs_plain
        assert result.verdict == "differs" and d.position == 9
        assert d.other == greedy_tokens(result.prompt_ids, 16)[9] and d.speculative == (d.other + 1) % VOCAB
        assert d.speculative_text.split()[0] == str(d.speculative)  # decoded by the engine's /detokenize


@pytest.mark.parametrize("position", [0, 7, 8, 15])
def test_every_generated_token_is_compared(position):
    ours = list(range(16))
    theirs = ours[:position] + [99] + ours[position + 1:]
    assert divergence(ours, theirs) == position
    assert divergence(ours, ours[:12]) == 12 and divergence(ours, list(ours)) is None


def test_a_drafter_that_drafts_nothing_is_inconclusive():
    with StandIn(drafted=0, accepted=0) as spec, StandIn(drafted=0, accepted=0) as plain:
        report = audit(spec, plain)
    assert [p.verdict for p in report.prompts] == ["inconclusive"] * 2
    assert report.verdict == "inconclusive" and report.exit_code == EXIT_INCONCLUSIVE


def test_a_drafter_that_accepts_nothing_is_inconclusive_but_a_difference_still_differs():
    with StandIn(accepted=0) as spec, StandIn() as plain:
        assert audit(spec, plain).verdict == "inconclusive"
    with StandIn(accepted=0, change_at=3) as spec, StandIn() as plain:
        assert audit(spec, plain).verdict == "differs"


def reference_of(prompt: list[int], n: int, tie_at: int | None = None, margin: float = 0.001) -> ReferenceRun:
    tokens = greedy_tokens(prompt, n)
    top = [[(t, 5.0), ((t + 1) % VOCAB, 5.0 - (margin if i == tie_at else 3.0))] for i, t in enumerate(tokens)]
    return ReferenceRun(tokens, top)


def test_a_near_tie_of_the_reference_is_passed_over_and_a_clear_difference_is_not():
    ids = [ord(c) % VOCAB for c in PROMPTS[0].text]
    config = AuditConfig(speculative="", plain="", prompts=PROMPTS, max_tokens=16, samples=0)
    with StandIn(change_at=9) as spec, StandIn() as plain:
        servers = {"speculative": _connected(spec.url, "speculative"), "plain": _connected(plain.url, "plain")}
        tied = audit_prompt(0, PROMPTS[0], ids, servers, reference_of(ids, 16, tie_at=9), config)
        clear = audit_prompt(0, PROMPTS[0], ids, servers, reference_of(ids, 16, tie_at=9, margin=0.5), config)
    assert [t.position for t in tied.ties] == [9] and tied.ties[0].margin == pytest.approx(0.001)
    assert tied.speculative[9] == tied.plain[9] == tied.reference[9]  # both go on from the reference's token
    assert len(tied.speculative) == 16 and tied.verdict == "identical"
    assert clear.ties == [] and clear.speculative[9] != clear.plain[9]


def test_past_max_ties_the_prompt_is_inconclusive():
    ids = [ord(c) % VOCAB for c in PROMPTS[0].text]
    config = AuditConfig(speculative="", plain="", prompts=PROMPTS, max_tokens=32, samples=0)
    every = ReferenceRun(greedy_tokens(ids, 32), [[(t, 1.0), ((t + 1) % VOCAB, 1.0)] for t in greedy_tokens(ids, 32)])
    with StandIn(change_at=0) as spec, StandIn() as plain:  # every request's first token is the other candidate
        servers = {"speculative": _connected(spec.url, "speculative"), "plain": _connected(plain.url, "plain")}
        result = audit_prompt(0, PROMPTS[0], ids, servers, every, config)
    assert len(result.ties) == MAX_TIES + 1 and result.verdict == "inconclusive"


def _connected(url: str, role: str):
    from dspark_cli.runtime.bench.audit_client import connect_audit

    return connect_audit(url, role, "auto", None, 30)


# --- T > 0 --------------------------------------------------------------------------------------------------


def test_the_distribution_check_passes_for_one_sampler_and_fails_for_a_dropped_top_p():
    with StandIn() as spec, StandIn() as plain:
        same = audit(spec, plain, samples=120, prompts=PROMPTS[:1])
        seeds = {(b["seed"], "spec") for b in spec.bodies if b["temperature"] > 0}
        seeds |= {(b["seed"], "plain") for b in plain.bodies if b["temperature"] > 0}
    assert same.distribution_passed and same.verdict == "identical"
    assert len({seed for seed, _ in seeds}) == len(seeds) == 2 * 2 * 120  # independent: no seed used twice
    with StandIn(honor_top_p=False) as spec, StandIn() as plain:
        dropped = audit(spec, plain, samples=120, prompts=PROMPTS[:1])
    failed = [(c.name, c.position) for c in dropped.checks if not c.passed]
    assert ("top-p", 0) in failed and ("top-p", 3) in failed and all(name == "top-p" for name, _ in failed)
    assert dropped.verdict == "differs" and dropped.exit_code == EXIT_FINDINGS


def test_sampled_requests_continue_the_plain_servers_greedy_prefix():
    with StandIn() as spec, StandIn() as plain:
        report = audit(spec, plain, samples=20, prompts=PROMPTS[:1])
        sampled = [b for b in spec.bodies if b["temperature"] > 0]
    ids = report.prompts[0].prompt_ids
    assert all(b["prompt"] == ids + greedy_tokens(ids, 16)[:8] and b["n_predict"] == 4 for b in sampled)
    assert {(b["top_p"], b["top_k"]) for b in sampled} == {(0.5, 0), (1.0, 4)}


def test_homogeneity_test_pools_rare_tokens_and_matches_known_values():
    assert chi2_survival(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_survival(9.487729036781154, 4) == pytest.approx(0.05, rel=1e-9)
    bins = pooled_bins(__import__("collections").Counter([1] * 20 + [2] * 3 + [3] * 2),
                       __import__("collections").Counter([1] * 18 + [2] * 4 + [4] * 4))
    assert bins == [(20, 18), (5, 8)]  # 2, 3 and 4 are rare (pooled counts 7, 2, 4 < 10): one bin
    test = homogeneity_test([0] * 50 + [1] * 50, [0] * 80 + [1] * 20)
    assert test.df == 1 and test.tv == pytest.approx(0.3)
    assert test.chi2 == pytest.approx(200 * (50 * 20 - 50 * 80) ** 2 / (100 * 100 * 130 * 70))
    assert homogeneity_test([5] * 40, [5] * 40).p == 1.0


# --- vLLM's API ---------------------------------------------------------------------------------------------


def test_vllm_api_token_ids_and_counters_per_request():
    with StandIn(api="vllm") as spec, StandIn(api="vllm", drafted=0, accepted=0) as plain:
        report = audit(spec, plain)
        bodies = spec.bodies
    assert report.servers["speculative"].engine == "vllm" and report.verdict == "identical"
    assert [(p.drafted, p.accepted) for p in report.prompts] == [(14, 6)] * 2  # counters before and after each
    greedy = [b for b in bodies if b["max_tokens"] == 16]
    assert all(b["return_token_ids"] and b["ignore_eos"] and isinstance(b["prompt"], list) for b in greedy)
    with StandIn(api="vllm", change_at=12) as spec, StandIn(api="vllm") as plain:
        assert [p.vs_plain.position for p in audit(spec, plain).prompts] == [12, 12]


def test_sglang_api_drafting_from_its_mean_accept_length():
    with StandIn(api="sglang") as spec, StandIn(api="sglang") as plain:
        report = audit(spec, plain, samples=10, prompts=PROMPTS[:1])
        sampled = [b for b in spec.bodies if b["temperature"] > 0]
    assert report.servers["speculative"].engine == "sglang" and report.verdict == "identical"
    assert report.prompts[0].drafted is None and report.sglang_accept_length == 2.5
    assert {b["top_k"] for b in sampled} == {-1, 4}  # SGLang's "off" is -1
    with StandIn(api="sglang", accept_length=1.0) as spec, StandIn(api="sglang") as plain:
        off = audit(spec, plain)
    assert off.drafting_unknown and off.verdict == "inconclusive" and off.exit_code == EXIT_INCONCLUSIVE


# --- the command --------------------------------------------------------------------------------------------


def test_cli_json_and_exit_codes(tmp_path):
    out = tmp_path / "audit.json"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p.text}) + "\n" for p in PROMPTS))
    runner = CliRunner()
    with StandIn() as spec, StandIn() as plain:
        ok = runner.invoke(app, ["bench", "audit", spec.url, "--plain", plain.url, "--prompts", str(prompts),
                                 "--max-tokens", "16", "--samples", "60", "--json", str(out)])
    assert ok.exit_code == 0, ok.output
    doc = json.loads(out.read_text())
    assert doc["format"] == "dspark-bench-audit/1" and doc["verdict"] == "identical"
    assert doc["settings"]["samples"] == 60 and doc["settings"]["tie_margin"] == 0.01
    assert doc["greedy"]["identical"] == 2 and len(doc["sampling"]["checks"]) == 4
    assert len(doc["prompts"][0]["speculative_tokens"]) == 16
    with StandIn(change_at=9) as spec, StandIn() as plain:
        refused = runner.invoke(app, ["bench", "audit", spec.url, "--plain", plain.url, "--prompts", str(prompts),
                                      "--max-tokens", "16", "--samples", "0", "--json", str(out)])
        assert refused.exit_code == 2 and "already exists" in refused.output
        assert spec.bodies == [] and plain.bodies == []  # refused before any request
    with StandIn(change_at=9) as spec, StandIn() as plain:
        differs = runner.invoke(app, ["bench", "audit", spec.url, "--plain", plain.url, "--prompts", str(prompts),
                                      "--max-tokens", "16", "--samples", "0", "--json", str(out), "--force"])
    assert differs.exit_code == EXIT_FINDINGS and "differs" in differs.output
    assert json.loads(out.read_text())["prompts"][0]["vs_plain"]["position"] == 9
    with StandIn(drafted=0) as spec, StandIn() as plain:
        none = runner.invoke(app, ["bench", "audit", spec.url, "--plain", plain.url, "--prompts", str(prompts),
                                   "--max-tokens", "16", "--samples", "0"])
    assert none.exit_code == EXIT_INCONCLUSIVE and "inconclusive" in none.output


def test_cli_refuses_half_a_pair_and_a_short_max_tokens():
    runner = CliRunner()
    half = runner.invoke(app, ["bench", "audit", "http://127.0.0.1:9", "--plain", "http://127.0.0.1:9", "--target",
                               "x"])
    assert half.exit_code == 2 and "--draft" in half.output
    with StandIn() as spec, StandIn() as plain:
        short = runner.invoke(app, ["bench", "audit", spec.url, "--plain", plain.url, "--max-tokens", "4"])
    assert short.exit_code == 2 and "--max-tokens must be at least 12" in short.output


def test_the_shipped_prompts_hold_every_kind():
    kinds = [p.kind for p in shipped_prompts()]
    assert {"code", "prose", "tool_call", "json", "chat", "long"} <= set(kinds)
    assert any("<tool_call>" in p.text for p in shipped_prompts())
    assert any(p.text.startswith("<|im_start|>") for p in shipped_prompts())
    assert max(len(p.text) for p in shipped_prompts()) > 2000
