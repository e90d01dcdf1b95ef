"""`dspark eval`'s tables stay readable where rich has 80 columns (a pipe: `dspark eval | cat`): every header word
whole, where they once printed as "datas…", "promp…", "speed…"."""

from __future__ import annotations

from io import StringIO

from rich.console import Console

from dspark_cli.cli.eval_report import fitted, main_table

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
