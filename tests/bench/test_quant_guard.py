"""The acceptance guard of convert --outtype: the verdict on made-up counts (refuse, warn, pass, against the
unquantized draft), and in the real llama.cpp a deliberately broken quantization (every Q8_0 scale zero) refused
with nothing written while a Q8_0 draft passes."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.runtime.bench import quant_guard
from dspark_cli.runtime.bench.engine_metrics import SpecCounters
from dspark_cli.runtime.bench.quant_guard import GuardRefused, GuardSettings, PairFigures, acceptance_guard, judge
from dspark_cli.runtime.demo import DEMO_DIR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from llama_server import demo_ggufs, needs_llamacpp  # noqa: E402, F401 (demo_ggufs is a fixture)

DRAFT, TARGET = DEMO_DIR / "draft", DEMO_DIR / "target"


def _figures(label: str, tau: float, prompts: int = 6) -> PairFigures:
    """Prompts of 10 verify steps each whose τ is `tau` (accepted = (τ - 1) x steps), 7 drafted per step."""
    steps = 10.0
    return PairFigures(label, [SpecCounters(steps, 7 * steps, (tau - 1) * steps) for _ in range(prompts)])


def _settings(max_drop: float = 0.1, refuse: bool = True) -> GuardSettings:
    return GuardSettings(Path("target.gguf"), (), ("a prompt",), max_tau_drop=max_drop, refuse=refuse)


def test_waiting_for_the_server_rides_out_answers_that_are_not_http(tmp_path):
    """/health answered first with a line that is not HTTP, then with 200: the wait goes on, then returns (an
    http.client.BadStatusLine escaped it as a traceback)."""
    from loopback import JsonHandler, LoopbackServer

    calls = []

    class Handler(JsonHandler):
        def do_GET(self):
            calls.append(self.path)
            if len(calls) == 1:
                self.wfile.write(b"garbage\r\n")
                self.close_connection = True
            else:
                self._send(200, {"status": "ok"})

    class Running:
        returncode = None

        def poll(self):
            return None

    with LoopbackServer(Handler, poll_interval=0.05) as server, open(tmp_path / "log", "w+") as log:
        quant_guard._wait_healthy(server.url, Running(), log)
    assert calls == ["/health", "/health"]


def test_a_drop_beyond_the_threshold_is_refused_with_both_figures():
    with pytest.raises(GuardRefused) as refused:
        judge(_figures("unquantized", 3.0), _figures("quantized", 2.5), _settings(0.1))
    message = str(refused.value)
    assert "2.500" in message and "3.000" in message and "nothing was written" in message


def test_a_small_drop_passes_and_a_warning_keeps_the_figures():
    passed = judge(_figures("unquantized", 3.0), _figures("quantized", 2.95), _settings(0.1))
    assert passed["passed"] and passed["tau_drop"]["estimate"] == pytest.approx(0.05)
    assert passed["unquantized"]["tau"] == pytest.approx(3.0) and passed["quantized"]["tau_ci"][0] is not None
    warned = judge(_figures("unquantized", 3.0), _figures("quantized", 2.0), _settings(0.1, refuse=False))
    assert not warned["passed"] and warned["tau_drop"]["estimate"] == pytest.approx(1.0)


def test_the_guard_measures_the_unquantized_draft_as_its_reference(monkeypatch):
    """check(unquantized, quantized) serves each file: a quantized draft worse than the unquantized one is refused
    (comparing the quantized draft with itself would always pass)."""
    taus = {Path("unq.gguf"): 3.0, Path("q.gguf"): 2.0}
    served = []

    def measure(settings, draft, label):
        served.append((draft, label))
        return _figures(label, taus[draft])

    monkeypatch.setattr(quant_guard, "measure_pair", measure)
    with pytest.raises(GuardRefused):
        acceptance_guard(_settings(0.5))(Path("unq.gguf"), Path("q.gguf"))
    assert served == [(Path("unq.gguf"), "unquantized"), (Path("q.gguf"), "quantized")]


@pytest.fixture
def guard_args(tmp_path, demo_ggufs):
    prompts = tmp_path / "held_out.jsonl"
    lines = (DEMO_DIR / "eval_prose.jsonl").read_text().splitlines()[-3:]
    prompts.write_text("\n".join(lines) + "\n")
    return ["--to", "gguf", "--target", str(TARGET), "--guard-prompts", str(prompts), "--guard-target",
            str(demo_ggufs[0]), "--guard-tokens", "24", "--max-tau-drop", "0.3"]


@needs_llamacpp
def test_real_guard_passes_q8_0_and_refuses_zero_scales(tmp_path, guard_args, monkeypatch):
    from dspark_cli.runtime.convert import gguf_quant

    good, summary = tmp_path / "q8.gguf", tmp_path / "q8.json"
    result = CliRunner().invoke(app, ["convert", str(DRAFT), "-o", str(good), "--outtype", "q8_0", "--json",
                                      str(summary), *guard_args])
    assert result.exit_code == 0, result.output
    guard = json.loads(summary.read_text())["guard"]
    assert guard["passed"] and guard["unquantized"]["tau"] > 1.5
    assert abs(guard["tau_drop"]["estimate"]) <= 0.3 and good.is_file()

    def zero_scales(rows):  # the F16 scale of every block set to 0: a broken quantization
        blocks = gguf_quant.quantize_q8_0(rows).reshape(-1, 34).copy()
        blocks[:, :2] = 0
        return blocks.reshape(rows.shape[0], -1)

    monkeypatch.setitem(gguf_quant.QUANTIZERS, "q8_0", zero_scales)
    broken = tmp_path / "broken.gguf"
    result = CliRunner().invoke(app, ["convert", str(DRAFT), "-o", str(broken), "--outtype", "q8_0", *guard_args])
    assert result.exit_code == 2, result.output
    assert "lost too much acceptance" in result.output and "unquantized" in result.output
    assert not broken.exists() and not list(tmp_path.glob(".broken*"))


@needs_llamacpp
def test_the_output_may_not_replace_the_guards_target(tmp_path, demo_ggufs):
    """Refused before any work (the guard would pass and --force would replace the target it served)."""
    target_gguf = tmp_path / "target.gguf"
    shutil.copyfile(demo_ggufs[0], target_gguf)
    prompts = tmp_path / "p.txt"
    prompts.write_text("def main():\n")
    result = CliRunner().invoke(app, ["convert", str(DRAFT), "-o", str(target_gguf), "--to", "gguf", "--target",
                                      str(TARGET), "--outtype", "q8_0", "--force", "--guard-prompts", str(prompts),
                                      "--guard-target", str(target_gguf), "--guard-tokens", "4"])
    assert result.exit_code == 2, result.output
    assert target_gguf.read_bytes() == demo_ggufs[0].read_bytes()


@needs_llamacpp
def test_real_guard_on_a_quantized_target(tmp_path, guard_args, demo_ggufs):
    """A target's guard: the Q8_0 target and the unquantized one, each with the draft beside --guard-draft."""
    draft_folder = tmp_path / "draft"
    shutil.copytree(DRAFT, draft_folder)
    shutil.copyfile(demo_ggufs[1], tmp_path / "draft.gguf")  # FOLDER.gguf, as dspark serve plans llama.cpp
    prompts = guard_args[guard_args.index("--guard-prompts") + 1]
    out, summary = tmp_path / "target-q8.gguf", tmp_path / "s.json"
    result = CliRunner().invoke(app, ["convert", str(TARGET), "-o", str(out), "--to", "gguf", "--outtype", "q8_0",
                                      "--guard-prompts", prompts, "--guard-draft", str(draft_folder),
                                      "--guard-tokens", "24", "--json", str(summary)])
    assert result.exit_code == 0, result.output
    guard = json.loads(summary.read_text())["guard"]
    assert guard["passed"] and guard["unquantized"]["verify_steps"] > 0 and out.is_file()
