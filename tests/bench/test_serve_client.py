"""`dspark bench serve` against a scripted engine (tests/fixtures/fake_engine.py): what it counts, times and reads
from the engine, its bounds, its outputs and its exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.bench.serve import Endpoint, ServeConfig, run_serve_bench

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["alpha", "beta", "gamma", "delta"]


def bench(url: str, **changes):
    settings = dict(url=url, prompts=PROMPTS, concurrencies=(1, 2), max_tokens=8, warmup=False)
    return run_serve_bench(ServeConfig(**{**settings, **changes}))


def test_tokens_come_from_usage_not_the_prompt():
    with FakeEngine(flavour="openai", tokens=5, prompt_tokens=11) as engine:
        report = bench(engine.url)
    for level in report.levels:
        assert [r.tokens for r in level.requests] == [5] * 4
        assert all(r.usage and r.prompt_tokens == 11 for r in level.requests)
        assert level.tokens == 20
        assert level.throughput == pytest.approx(20 / level.wall_s)


def test_requests_carry_the_settings():
    with FakeEngine(flavour="openai") as engine:
        bench(engine.url, max_tokens=3, concurrencies=(1,))
        bodies = engine.bodies
    assert len(bodies) == len(PROMPTS)  # bounded: each prompt once per level, no warm-up here
    assert sorted(b["prompt"] for b in bodies) == sorted(PROMPTS)
    assert all(b["max_tokens"] == 3 and b["temperature"] == 0 and b["stream"] and b["ignore_eos"]
               and b["model"] == "fake-model" for b in bodies)


def test_ttft_itl_and_concurrency():
    with FakeEngine(flavour="openai", tokens=4, first_delay=0.3, gap=0.1) as engine:
        report = bench(engine.url, concurrencies=(2,))
        assert engine.max_in_flight == 2
    for request in report.levels[0].requests:  # lower bounds from the engine's delays; no upper bound (load)
        assert request.ttft_s >= 0.3
        assert request.itl_s >= 0.1
        assert request.itl_s == pytest.approx((request.last_token_s - request.ttft_s) / 3)  # three gaps
        assert request.latency_s >= request.last_token_s >= request.ttft_s
    level = report.levels[0]
    assert level.summary()["per_request_tokens_per_s"] == pytest.approx(
        sum(4 / r.latency_s for r in level.requests) / 4)


def test_llamacpp_acceptance_from_each_response():
    with FakeEngine(flavour="llamacpp", draft_n=14, accepted=6) as engine:
        report = bench(engine.url, concurrencies=(1,))
    level = report.levels[0]
    assert report.servers["speculative"].engine == "llamacpp"
    assert [(r.draft_n, r.draft_accepted) for r in level.requests] == [(14, 6)] * 4
    assert level.acceptance == pytest.approx(24 / 56)
    assert level.summary()["draft_n_accepted"] == 24


def test_vllm_acceptance_from_counters_between_scrapes():
    with FakeEngine(flavour="vllm", draft_n=14, accepted=6, counters_offset=1000) as engine:
        report = bench(engine.url, concurrencies=(1, 2))
    assert report.servers["speculative"].engine == "vllm"
    for level in report.levels:  # the 1000 earlier drafts are not this level's
        assert level.counters.drafts == 8 and level.counters.draft_tokens == 56 and level.counters.accepted == 24
        assert level.counters.per_position == (12.0, 12.0)
        assert level.acceptance == pytest.approx(24 / 56)


def test_baseline_and_speedup():
    with FakeEngine(flavour="openai", tokens=6, gap=0.01) as spec, FakeEngine(flavour="openai", tokens=6,
                                                                               gap=0.05) as base:
        report = bench(spec.url, baseline=base.url, concurrencies=(1,))
    spec_level, base_level = report.level("speculative", 1), report.level("baseline", 1)
    assert report.speedup(1) == pytest.approx(spec_level.throughput / base_level.throughput)
    assert report.speedup(1) > 1
    assert report.to_dict()["speedup"] == {"1": report.speedup(1)}


def test_every_request_is_bounded_by_the_timeout():
    with FakeEngine(flavour="openai", tokens=50, gap=0.2) as engine:
        started = time.perf_counter()
        report = bench(engine.url, concurrencies=(2,), timeout_s=0.5, max_tokens=50)
        elapsed = time.perf_counter() - started
    requests = report.levels[0].requests
    assert len(requests) == 4 and all(r.timed_out and not r.ok for r in requests)
    assert all(r.latency_s < 0.5 + 0.3 for r in requests)
    assert elapsed < 2 * (0.5 + 0.3) + 1.5  # two rounds of two requests, each cut at its bound
    assert report.failures == 4


def test_a_stalled_stream_is_cut_at_the_bound():
    """The socket waits only for the time left: a request whose first token came late is not given a whole new
    timeout for its next read."""
    with FakeEngine(flavour="openai", tokens=3, first_delay=0.8, gap=2.0) as engine:
        report = bench(engine.url, prompts=["one"], concurrencies=(1,), timeout_s=1.0)
    (request,) = report.levels[0].requests
    assert request.timed_out and request.ttft_s >= 0.8
    assert request.latency_s < 1.4  # 0.8 + a fresh 1.0 s wait would end near 1.8


def test_engine_errors_are_reported_per_request():
    with FakeEngine(flavour="openai", status=503) as engine:
        report = bench(engine.url, concurrencies=(1,))
    assert all(r.error == "HTTP 503: model overloaded" for r in report.levels[0].requests)
    assert report.levels[0].throughput is None


def test_the_number_of_requests_is_bounded():
    with pytest.raises(DsparkError, match="pass the requests option"):
        bench("http://127.0.0.1:9", prompts=["p"] * 10_001)


def test_endpoint_parsing():
    endpoint = Endpoint.parse("http://10.0.0.5:8000/v1/")
    assert (endpoint.host, endpoint.port, endpoint.prefix) == ("10.0.0.5", 8000, "")
    assert Endpoint.parse("https://h/proxy").prefix == "/proxy" and Endpoint.parse("https://h").port == 443


def run_cli(*args):
    return CliRunner().invoke(app, ["bench", "serve", *args])


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://h/", "http://h:99999", "http:///v1"])
def test_bad_url_is_one_sentence(url):
    result = run_cli(url)
    assert result.exit_code == 2
    assert "is not an http(s) address" in result.output and "Traceback" not in result.output


def test_server_down_is_one_sentence(tmp_path):
    with FakeEngine() as engine:
        url = engine.url  # a port that was just free and is closed again
    result = run_cli(url, "--json", str(tmp_path / "out.json"))
    assert result.exit_code == 2
    assert f"cannot reach the speculative server at {url}" in result.output
    assert not (tmp_path / "out.json").exists()


def test_cli_json_plot_exclusive_and_failures(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\nthree\n")
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    with FakeEngine(flavour="llamacpp", tokens=3) as spec, FakeEngine(flavour="openai", tokens=3) as base:
        args = [spec.url, "--baseline", base.url, "--prompts", str(prompts), "--concurrency", "1,2",
                "--max-tokens", "3", "--json", str(out), "--plot", str(plot)]
        result = run_cli(*args)
        assert result.exit_code == 0, result.output
        doc = json.loads(out.read_text())
        assert doc["format"] == "dspark-bench-serve/1" and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert [(lv["server"], lv["concurrency"], lv["ok"]) for lv in doc["levels"]] == [
            ("speculative", 1, 3), ("baseline", 1, 3), ("speculative", 2, 3), ("baseline", 2, 3)]
        assert len(doc["requests"]) == 12 and doc["levels"][0]["acceptance"] == pytest.approx(6 / 14)
        before, served = out.read_text(), spec.served
        again = run_cli(*args)
        assert again.exit_code == 2 and "already exists" in again.output and out.read_text() == before
        assert spec.served == served  # refused before any request
        assert run_cli(*args, "--force").exit_code == 0
    with FakeEngine(flavour="openai", status=500) as broken:
        failed = run_cli(broken.url, "--prompts", str(prompts), "--concurrency", "1", "--no-warmup", "--plot",
                         str(tmp_path / "none.png"))
    assert failed.exit_code == 1 and "3 request(s) failed or timed out" in failed.output
    assert "no plot written" in failed.output and not (tmp_path / "none.png").exists()
    assert run_cli(spec.url, "--plot", "-").exit_code == 2


@pytest.mark.parametrize("answer, why", [
    ("json", "no tokens: the server answered without streaming (Content-Type application/json"),
    ("tgi", "no tokens: 5 streamed event(s) carried no completion text"),
])
def test_a_request_that_produced_no_tokens_failed_and_the_run_says_why(tmp_path, answer, why):
    out = tmp_path / "serve.json"
    with FakeEngine(flavour="openai", tokens=3, answer=answer) as engine:
        warm = run_cli(engine.url, "--concurrency", "1", "--requests", "2")
        cold = run_cli(engine.url, "--concurrency", "1", "--requests", "2", "--no-warmup", "--json", out)
    assert warm.exit_code == 2 and "failed the warm-up completion: " + why in " ".join(warm.output.split())
    message = " ".join(cold.output.split())
    assert cold.exit_code == 1 and "2 request(s) failed or timed out" in message and f"The first: {why}" in message
    assert [r["tokens"] for r in json.loads(out.read_text())["requests"]] == [0, 0]
    # what the message says was kept is what is on disk: the --json file, not the temporary file it went through
    assert f"Already written and kept: {out}." in message and ".tmp" not in message


@pytest.mark.parametrize("signum, code, word", [(signal.SIGINT, 130, "interrupted"),
                                                (signal.SIGTERM, 143, "terminated")])
def test_an_interrupt_prints_what_was_measured(tmp_path, signum, code, word):
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"prompt {i}" for i in range(40)) + "\n")
    with FakeEngine(flavour="llamacpp", tokens=4, gap=0.05) as engine:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        process = subprocess.Popen([sys.executable, "-c", "from dspark_cli.cli import main; main()", "bench",
                                    "serve", engine.url, "--prompts", str(prompts), "--concurrency", "1",
                                    "--json", str(tmp_path / "partial.json")],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.time() + 60
        while engine.served < 5 and time.time() < deadline:  # the warm-up and 4 prompts
            time.sleep(0.05)
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == code, stderr
    kept = f"{word}: already written and kept: {tmp_path / 'partial.json'}"
    assert "spec" in stdout and kept in "".join(stderr.split("\n"))
    doc = json.loads((tmp_path / "partial.json").read_text())
    assert doc["interrupted"] and not doc["levels"][0]["complete"]
    assert 3 <= doc["levels"][0]["ok"] < 40  # the last one served may still be on its way
