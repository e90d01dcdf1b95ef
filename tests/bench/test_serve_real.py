"""`dspark bench serve` against the real llama.cpp b11434 llama-server serving the demo pair (two slots, one thread),
with and without the draft: the acceptance it reports is the engine's own (its /metrics counters, started with
`--metrics`), every request generates max-tokens tokens and none outlives its bound. Skipped when the build is
absent (scripts/build_llamacpp.sh; CI builds it)."""

from __future__ import annotations

import json

import pytest
from llama_server import demo_ggufs, llama_server, needs_llamacpp  # noqa: F401 (demo_ggufs is a fixture)
from typer.testing import CliRunner

from dspark_cli.cli import app

pytestmark = needs_llamacpp

MAX_TOKENS = 24
TIMEOUT_S = 60


def test_bench_serve_on_llama_server(demo_ggufs, tmp_path):
    target, draft = demo_ggufs
    out = tmp_path / "serve.json"
    with llama_server(target, draft, slots=2, extra=["--metrics"]) as spec, llama_server(target, slots=2) as base:
        result = CliRunner().invoke(app, ["bench", "serve", spec, "--baseline", base, "--requests", "4",
                                          "--concurrency", "1,2", "--max-tokens", str(MAX_TOKENS), "--timeout",
                                          str(TIMEOUT_S), "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["servers"]["speculative"]["engine"] == doc["servers"]["baseline"]["engine"] == "llamacpp"
    levels = {(lv["server"], lv["concurrency"]): lv for lv in doc["levels"]}
    assert sorted(levels) == [("baseline", 1), ("baseline", 2), ("speculative", 1), ("speculative", 2)]
    for (server, concurrency), level in levels.items():
        assert level["ok"] == level["requests"] == 4 and level["tokens"] == 4 * MAX_TOKENS
        assert level["tokens_per_s"] > 0 and level["ttft_s"]["median"] > 0 and level["itl_s"]["median"] > 0
        if server == "baseline":
            assert level["draft_n"] == 0 and level["acceptance"] is None and level["counters"] is None
            continue
        counters = level["counters"]  # llama.cpp's own totals, /metrics before and after the level
        assert level["draft_n"] == counters["draft_tokens"] > 0
        assert level["draft_n_accepted"] == counters["accepted"]
        assert level["acceptance"] == pytest.approx(counters["accepted"] / counters["draft_tokens"])
        assert sum(counters["accepted_per_position"]) == counters["accepted"]
    for request in doc["requests"]:
        assert request["tokens"] == MAX_TOKENS and request["tokens_from_usage"]
        assert request["latency_s"] <= TIMEOUT_S and not request["timed_out"]
    assert all(doc["speedup"][c] > 0 for c in ("1", "2"))
