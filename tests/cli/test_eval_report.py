"""`dspark eval`'s tables stay readable where rich has 80 columns (a pipe: `dspark eval | cat`): every header word
whole, where they once printed as "datas…", "promp…", "speed…"."""

from __future__ import annotations

from io import StringIO

from rich.console import Console

from dspark_cli.cli.eval_report import main_table
from dspark_cli.cli.render import fitted

HEADERS = ("dataset", "prompts", "rounds", "τ", "95% CI", "verify", "tok/s", "speedup")


def _stats() -> dict:
    return {"prompts": 80, "tau": 3.4567, "tau_ci": (3.1234, 3.8765), "tau_within_limit": 3.2, "verify_rate": 0.912,
            "summary": {"rounds": 12345, "tokens_per_s": 1234.5, "baseline": {"speedup": 2.34}}}


def _render(width: int) -> str:
    out = Console(width=width, file=StringIO(), color_system=None)
    rows = [("mt_bench_long_name", _stats()), ("eval_prose", _stats()), ("all", _stats())]
    out.print(fitted(out, lambda padding: main_table(rows, padding)))
    return out.file.getvalue()


def test_the_main_table_keeps_its_headers_whole_at_80_columns():
    text = _render(80)
    for header in HEADERS:
        assert header in text, text
    assert "limit" in text and "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_a_wide_console_keeps_the_padded_table():
    text = _render(160)
    assert "│ mt_bench_long_name │" in text and "│ 95% CI │" not in text
    assert "τ ≤ limit" in text


def test_plan_at_load_keeps_its_headers_whole_at_80_columns_and_lists_the_settings_once():
    from dspark_cli.cli.plan_report import load_table, settings_list
    from dspark_cli.runtime.measure.schedule import LoadRow, schedulers_for

    rows = [LoadRow(s, 8, 1234.5, 156.7, 42.0, 3.21, 0, 100) for s in schedulers_for(["paper-production", "trtllm"], 7)]
    out = Console(width=80, file=StringIO(), color_system=None)
    out.print(fitted(out, lambda padding: load_table(8, rows, 7, "SGLang 1-D SPS table", padding)))
    out.print(settings_list(rows))
    text = out.file.getvalue()
    for header in ("scheduler", "tok/s per request", "verify tokens/step", "censored", "paper-production"):
        assert header in text, text
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    assert text.count("TensorRT-LLM: enable_confidence_scheduling") == 1  # below the table, not in each row


def _heading(**changes) -> str:
    from dspark_cli.cli.eval_report import print_report

    settings = {"draft_kind": "DSpark draft, vanilla Markov head", "block_size": 7, "markov": "topk", "draft_topk": 16,
                "confidence_threshold": None, "confidence_rule": "survival", "calibration": None, "temperature": 0.0,
                "max_new_tokens": 64, "seed": 0, "chat": False, "device": "cpu", "dtype": "float32", **changes}
    out = Console(width=200, file=StringIO(), color_system=None)
    print_report(out, settings, [])
    return out.file.getvalue().splitlines()[1]


def test_the_heading_names_the_stage_a_dflash2_draft_runs():
    """A DFlash2 run file (markov "selector", draft_topk its selector_top_k) is headed by its path selector, a
    DSpark one by its Markov strategy and top-k."""
    assert "block 7, markov topk (top-16), T=0.0" in _heading()
    assert "block 7, markov dense, T=0.0" in _heading(markov="dense", draft_topk=None)
    dflash2 = _heading(draft_kind="DFlash2 draft, path selector", markov="selector", draft_topk=4)
    assert "DFlash2 draft, path selector, block 7, selector top-4, T=0.0" in dflash2 and "markov" not in dflash2
