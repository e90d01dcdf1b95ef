"""End to end through the CLI: `dspark bench engine` against stand-in llama-servers (a known cost model) -> `dspark
plan RUN.json --costs PROFILE` -> `dspark plan -o PLAN` -> `dspark serve --engine llamacpp --from-plan PLAN
--dry-run`: the plan's draft length is the one served, a plan that does not pay serves the target alone, and what
does not fit is refused in one sentence."""

from __future__ import annotations

import json

import pytest
from fake_llama_server import Costs, FakeLlamaServer, demo_ggufs
from typer.testing import CliRunner
from verdict_inputs import DRAFT, TARGET, accepting, eval_run, profile_doc

from dspark_cli.cli import app
from dspark_cli.runtime.checkpoint.fingerprint import folder_fingerprint

runner = CliRunner()


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    return demo_ggufs(tmp_path_factory.mktemp("ggufs"))


@pytest.fixture(scope="module")
def run_file(tmp_path_factory):
    """The demo pair's eval run, by hand: two prompts of 25 rounds, each accepting 3 of its 7 drafted tokens."""
    path = tmp_path_factory.mktemp("runs") / "run.json"
    eval_run([[accepting(3, 7)] * 25] * 2, block=7).save(path)
    return path


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


# θ(M) = 3 + 0.5M, D(R, c) = 10 + 2R + 0.01·c·R, Δ(n, R) = 1 + 3nR; servers drafting 2 and 7. At C = 1, context 16
# (profiled at 16 and 64): A(1, 16) = 0.16, V(1, t) = 11.5 + 0.66t, Δ(1) = Δ(2) = 7 (held below 2), Δ(3) = 10,
# Δ(4) = 13. Every round accepts 3: τ(n) = min(n, 3) + 1 verifying n + 1, so step(n) = V(n + 1) + Δ(n) = 19.82,
# 20.48, 24.14, 27.8 ms for n = 1..4 and tokens/s ∝ τ / step peaks at n = 3: 4 · 12.16 / 24.14 = 2.01x plain.
def bench_costs() -> Costs:
    return Costs(theta=lambda m: 3.0 + 0.5 * m, plain=lambda r, c: 10.0 + 2.0 * r + 0.01 * c * r,
                 delta=lambda n, r, c: 1.0 + 3.0 * n * r, accept={2: 1, 7: 3})


def test_bench_engine_then_plan_then_serve_the_plans_draft_length(ggufs, run_file, tmp_path, monkeypatch):
    target, draft = ggufs
    model = bench_costs()
    profile = tmp_path / "profile.json"
    with model.gangs(monkeypatch), FakeLlamaServer(model, model_path=str(target)) as plain, \
            FakeLlamaServer(model, 2, model_path=str(target)) as two, \
            FakeLlamaServer(model, 7, model_path=str(target)) as seven:
        done = invoke("bench", "engine", plain.url, "--spec", f"2={two.url}", "--spec", f"7={seven.url}",
                      "--draft-file", draft, "--concurrency", "1,2", "--context", "16,64", "--repeats", "2",
                      "--generate", "8", "--json", profile)
    assert done.exit_code == 0, done.output
    assert "bench engine · llamacpp b11434-fake" in done.stdout
    document = json.loads(profile.read_text())
    assert document["models"]["target"]["source"] == folder_fingerprint(TARGET)
    assert document["models"]["draft"]["source"] == folder_fingerprint(DRAFT)
    plain_16 = next(p for p in document["plain_ms"] if (p["requests"], p["context"]) == (1, 16))
    assert plain_16["ms"] == pytest.approx([12.16, 12.16])

    shown = invoke("plan", run_file, "--costs", profile, "--json", "-")  # the profile's contexts, 16 and 64
    assert shown.exit_code == 0, shown.output
    verdicts = {(v["concurrency"], v["context"]): v for v in json.loads(shown.stdout)["verdicts"]}
    assert set(verdicts) == {(1, 16), (2, 16), (1, 64), (2, 64)}
    # rounds start at contexts 10, 14, ..., 106: 6 of each prompt lie below the edge sqrt(16 · 64) = 32
    assert (verdicts[1, 16]["verdict"], verdicts[1, 16]["rounds"], verdicts[1, 64]["rounds"]) == ("no data", 12, 38)

    shown = invoke("plan", run_file, "--costs", profile, "--context", "16", "--json", "-")  # every round near 16
    assert shown.exit_code == 0, shown.output
    one, two = json.loads(shown.stdout)["verdicts"]
    assert (one["concurrency"], one["verdict"], one["n"], one["threshold"]) == (1, "pays", 3, None)
    assert one["best"]["step_ms"] == pytest.approx(24.14) and one["best"]["speedup"] == pytest.approx(4 * 12.16 / 24.14)
    # C = 2: V(2, t) = 13 + 1.32t, Δ(n, 2) = 1 + 6n (13 below n = 2): steps 28.64, 29.96, 37.28, 44.6 for n = 1..4
    assert [p["step_ms"] for p in two["predictions"][:4]] == pytest.approx([28.64, 29.96, 37.28, 44.6])
    assert (two["verdict"], two["n"]) == ("pays", 3) and two["best"]["speedup"] == pytest.approx(4 * 14.32 / 37.28)
    assert "context 16, C = 1: pays: --spec-draft-n-max 3." in words(shown.stderr)

    plan = tmp_path / "plan.json"
    written = invoke("plan", run_file, "--costs", profile, "--concurrency", "1", "--context", "16", "-o", plan)
    assert written.exit_code == 0, written.output
    assert json.loads(plan.read_text())["speculative_config"] == {"num_speculative_tokens": 3}
    assert f"`dspark serve --engine llamacpp --from-plan {plan} -t TARGET -d DRAFT` serves it" in words(written.stdout)

    served = invoke("serve", "--engine", "llamacpp", "--from-plan", plan, "-t", TARGET, "-d", DRAFT, "--dry-run")
    assert served.exit_code == 0, served.output
    command = served.stdout.strip().splitlines()[-1]
    assert command == (f"llama-server -m {TARGET}.gguf -md {DRAFT}.gguf --spec-type draft-dspark "
                       "--spec-draft-n-max 3")

    vllm = invoke("serve", "--engine", "vllm", "--from-plan", plan, "-t", TARGET, "-d", DRAFT, "--dry-run")
    assert vllm.exit_code == 2 and vllm.stdout == ""
    assert words(vllm.stderr) == (f"error: the plan {plan} was made with llamacpp's cost profile, and its draft length "
                                  "and verdict hold for that engine only; serve it with --engine llamacpp, or plan "
                                  "with a profile of vllm.")


def slow_draft_profile(path, **sources):
    """The demo pair's profile (block 7, the demo folders' fingerprints) of a draft costing 80 ms a step."""
    doc = profile_doc(theta=lambda m, i: 10.0 + m, plain=lambda r, c, i: 22.0, delta=lambda n, r, c, i: 80.0, block=7,
                      concurrencies=[1], contexts=[16], draft_ns=[2, 7],
                      target_source=sources.get("target", folder_fingerprint(TARGET)),
                      draft_source=sources.get("draft", folder_fingerprint(DRAFT)))
    path.write_text(json.dumps(doc))
    return path


def test_a_plan_that_does_not_pay_serves_the_target_alone(run_file, tmp_path):
    profile, plan = slow_draft_profile(tmp_path / "profile.json"), tmp_path / "plan.json"
    written = invoke("plan", run_file, "--costs", profile, "-o", plan)
    assert written.exit_code == 0, written.output
    document = json.loads(plan.read_text())
    assert document["speculative_config"] == {"num_speculative_tokens": 0}
    (verdict,) = document["verdicts"]
    assert (verdict["verdict"], verdict["n"]) == ("does not pay", 0)
    # the fastest, n = 3: step = θ(4) + 22 - θ(1) + 80 = 105, speedup 4 · 22 / 105
    assert verdict["reason"] == ("the fastest draft length, n = 3, is predicted 0.84x plain decoding, interval "
                                 "0.84-0.84, below 1")
    assert verdict["best"]["speedup"] == pytest.approx(4 * 22 / 105)
    assert "context 16, C = 1: does not pay: serve without the draft." in words(written.stdout)

    served = invoke("serve", "--engine", "llamacpp", "--from-plan", plan, "-t", TARGET, "-d", DRAFT, "--dry-run")
    assert served.exit_code == 0, served.output
    assert served.stdout == f"llama-server -m {TARGET}.gguf\n"
    assert words(served.stderr) == (f"plain decoding: {verdict['reason']}; the plan's verdict is to serve the target "
                                    "without its draft.")
    as_json = invoke("serve", "--engine", "llamacpp", "--from-plan", plan, "-t", TARGET, "-d", DRAFT, "--port", "8090",
                     "--json", "-")
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout) == {"engine": "llamacpp", "speculate": False, "reason": verdict["reason"],
                                          "argv": ["llama-server", "-m", f"{TARGET}.gguf", "--port", "8090"],
                                          "command": f"llama-server -m {TARGET}.gguf --port 8090", "exit_code": 0}


def test_another_pairs_profile_is_refused_unless_other_pair(run_file, tmp_path):
    profile = slow_draft_profile(tmp_path / "profile.json", draft="s256:00000000000000000000000000000000")
    refused = invoke("plan", run_file, "--costs", profile)
    assert refused.exit_code == 2 and refused.stdout == ""
    assert words(refused.stderr) == (
        f"error: the engine profile {profile} cannot be used for these runs: its draft file /x/draft.gguf was "
        f"converted from another folder than the runs' draft {DRAFT}; profile this pair's engine with `dspark bench "
        "engine`, or pass --other-pair to plan with it anyway.")
    forced = invoke("plan", run_file, "--costs", profile, "--other-pair")
    assert forced.exit_code == 0, forced.output
    assert ("note: planned with another pair's engine profile: its draft file /x/draft.gguf was converted from another "
            f"folder than the runs' draft {DRAFT}.") in words(forced.stdout)


def test_what_plan_refuses_with_an_engine_profile(run_file, tmp_path):
    profile = slow_draft_profile(tmp_path / "profile.json")
    two_loads = invoke("plan", run_file, "--costs", profile, "--context", "16,64", "-o", tmp_path / "plan.json")
    assert two_loads.exit_code == 2 and "give one concurrency and one context with it" in words(two_loads.stderr)
    assert not (tmp_path / "plan.json").exists()
    unmeasured = invoke("plan", run_file, "--costs", profile, "--concurrency", "4")
    assert unmeasured.exit_code == 2 and "measured at concurrency 1, not 4" in words(unmeasured.stderr)
    calibrated = invoke("plan", run_file, "--costs", profile, "--scheduler", "vllm")
    assert calibrated.exit_code == 2 and "the calibration and scheduler options do not apply" in words(
        calibrated.stderr)
    without = invoke("plan", run_file, "--other-pair")
    assert without.exit_code == 2 and "judge an engine profile of `dspark bench engine`" in words(without.stderr)
    bad = invoke("plan", run_file, "--costs", profile, "--context", "16,x")
    assert bad.exit_code == 2 and "--context takes distinct token counts >= 1" in words(bad.stderr)
