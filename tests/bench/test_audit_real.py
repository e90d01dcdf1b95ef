"""`dspark bench audit` against the real llama.cpp b11434 llama-server on the demo pair (the draft under dspark's
flags; the target alone beside it): identical to the plain server and to dspark's float32 reference at T = 0 and
the T > 0 check passed; then each planted fault (tests/fixtures/fault_proxy.py, between the audit and the
speculative server) caught: top_p dropped, one token changed after the first block, drafting off (inconclusive), a
tool-call JSON cut short. Short runs (few prompts and tokens, small samples where the fault is large); docs/bench.md
has the full run's figures. Skipped when the build is absent (scripts/build_llamacpp.sh; CI builds it)."""

from __future__ import annotations

import json

import pytest
from fault_proxy import CHANGED_POSITION, FaultProxy
from llama_server import demo_ggufs, llama_server, needs_llamacpp  # noqa: F401 (demo_ggufs is a fixture)
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import EXIT_FINDINGS, EXIT_INCONCLUSIVE
from dspark_cli.runtime.bench.audit import AuditConfig, run_audit, shipped_prompts
from dspark_cli.runtime.demo import DEMO_DIR

pytestmark = needs_llamacpp

SAMPLES = 40  # per server and check: a dropped top-p moves positions 0 and 3 by a TV of 0.30 and 0.67 on the demo
# pair, which 50 samples detect at each position with probability 0.96 (docs/bench.md, Power)


@pytest.fixture(scope="module")
def servers(demo_ggufs):
    target, draft = demo_ggufs
    with llama_server(target, draft, slots=2) as spec, llama_server(target, slots=2) as plain:
        yield spec, plain


def prompts_of(*kinds: str):
    shipped = shipped_prompts()
    return [next(p for p in shipped if p.kind == kind) for kind in kinds]


def audit(spec: str, plain: str, kinds=("code",), **changes):
    settings = dict(speculative=spec, plain=plain, prompts=prompts_of(*kinds), max_tokens=16, samples=0)
    return run_audit(AuditConfig(**{**settings, **changes}))


def test_the_demo_pair_on_llama_server_is_identical_and_samples_alike(servers, tmp_path):
    spec, plain = servers
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "audit.json"
    prompts.write_text("".join(json.dumps({"prompt": p.text}) + "\n" for p in prompts_of("code", "tool_call")))
    result = CliRunner().invoke(app, ["bench", "audit", spec, "--plain", plain, "--target",
                                      str(DEMO_DIR / "target"), "--draft", str(DEMO_DIR / "draft"), "--prompts",
                                      str(prompts), "--max-tokens", "16", "--samples", str(SAMPLES), "--json",
                                      str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["servers"]["speculative"]["engine"] == "llamacpp" and doc["verdict"] == "identical"
    for prompt in doc["prompts"]:
        assert prompt["verdict"] == "identical" and prompt["drafted"] > 0 and prompt["accepted"] > 0
        assert prompt["speculative_tokens"] == prompt["plain_tokens"] == prompt["reference_tokens"]
        assert len(prompt["speculative_tokens"]) == 16
    assert doc["sampling"]["passed"] and len(doc["sampling"]["checks"]) == 4


def test_a_dropped_top_p_fails_the_sampling_check(servers):
    spec, plain = servers
    with FaultProxy(spec, "drop_top_p") as proxy:
        report = audit(proxy.url, plain, max_tokens=12, samples=SAMPLES)
    assert [p.verdict for p in report.prompts] == ["identical"]  # greedy output does not show it
    failed = {(c.name, c.position) for c in report.checks if not c.passed}
    assert failed and all(name == "top-p" for name, _ in failed)
    assert report.verdict == "differs" and report.exit_code == EXIT_FINDINGS


def test_a_token_changed_after_the_first_block_differs_there(servers):
    spec, plain = servers
    with FaultProxy(spec, "change_token") as proxy:
        report = audit(proxy.url, plain)
        assert proxy.changed >= 1
    difference = report.prompts[0].vs_plain
    assert report.verdict == "differs" and difference.position == CHANGED_POSITION
    assert difference.speculative == difference.other ^ 1


def test_a_drafter_that_is_off_is_inconclusive(servers):
    spec, plain = servers
    with FaultProxy(spec, "no_draft", plain=plain) as proxy:
        report = audit(proxy.url, plain, kinds=("code", "chat"))
    assert [(p.verdict, p.drafted) for p in report.prompts] == [("inconclusive", 0)] * 2
    assert report.verdict == "inconclusive" and report.exit_code == EXIT_INCONCLUSIVE


def test_a_truncated_tool_call_differs(servers):
    spec, plain = servers
    with FaultProxy(spec, "truncate_tool_call") as proxy:
        report = audit(proxy.url, plain, kinds=("code", "tool_call"))
        assert proxy.changed >= 1
    code, tool = report.prompts
    assert code.verdict == "identical"
    assert tool.verdict == "differs" and tool.vs_plain.position == 8 and tool.vs_plain.speculative is None
