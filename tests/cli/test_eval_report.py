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
