"""`dspark validate --probe`: τ measured with the pair; the demo draft passes, a draft whose vocabulary rows are
shifted by one id (no header rule can see it) is flagged "this draft will make decoding slower" (DSP608)."""

from __future__ import annotations

import functools
import json

import pytest
from misexport import DRAFT, SHIFTED, TARGET, build_folder
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.runtime import probe as probe_module
from dspark_cli.runtime.probe import PROBE_PROMPTS, SLOWER_TAU, probe, probe_findings

SHORT = {"prompts": PROBE_PROMPTS[:1], "max_new_tokens": 12}  # one prompt, a few rounds: enough to tell 1 from 3


def test_demo_draft_is_not_flagged_and_tau_is_tokens_per_round():
    result = probe(str(TARGET), str(DRAFT), device="cpu", **SHORT)
    # τ counts the tokens each round emits: at least those kept (all but the prefill's first, trimmed to the
    # length) and at most those plus one block a prompt cut by the length.
    kept = result.new_tokens - result.prompts
    assert kept / result.rounds <= result.tau <= (kept + result.prompts * result.block_size) / result.rounds
    assert result.tau > SLOWER_TAU and not result.slower and probe_findings(result) == []


def test_shifted_draft_is_flagged_slower(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_module, "probe", functools.partial(probe, device="cpu", **SHORT))
    draft = build_folder(SHIFTED, tmp_path / "shifted")
    result = CliRunner().invoke(app, ["validate", str(draft), "--target", str(TARGET), "--probe", "--json", "-"])
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    assert document["probe"]["slower"] and document["probe"]["tau"] == pytest.approx(1.0)
    finding = next(f for f in document["findings"] if f["code"] == "DSP608")
    assert "this draft will make decoding slower" in finding["message"] and finding["hint"]


def test_probe_needs_a_target():
    result = CliRunner().invoke(app, ["validate", str(DRAFT), "--probe"])
    assert result.exit_code == 2 and "target" in result.stderr
