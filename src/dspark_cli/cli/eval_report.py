"""`dspark eval`'s report: the heading line, the τ table, the per-position table, the calibration table, and the
--compare table. Column headers stay whole at 80 columns (a pipe, a narrow terminal)."""

from __future__ import annotations

from pathlib import Path
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dspark_cli.cli.render import columns, drafting_stage, fitted, number

def print_report(out: Console, settings: dict, rows: list[tuple[str, dict]]) -> None:
    s = settings
    cut = ""
    if s["confidence_threshold"] is not None:
        cut = f", confidence {s['confidence_rule']} >= {s['confidence_threshold']}"
    kind = f"{s['draft_kind']}, " if s.get("draft_kind") else ""
    if s["calibration"] is not None:
        cut += f", STS {s['calibration']['path']}"
    out.print(Text("\ndspark eval", style="bold") + Text(
        f"  {kind}block {s['block_size']}, {drafting_stage(s)}{cut}, T={s['temperature']}, {s['max_new_tokens']} new "
        f"tokens, seed {s['seed']}, chat {'on' if s['chat'] else 'off'}, {s['device']} {s['dtype']}", style="dim"))
    out.print(fitted(out, lambda padding: main_table(rows, padding)))
    out.print(_positions_table(rows, s["block_size"]))
    if any(stats["summary"]["calibration"] for _, stats in rows):
        out.print(fitted(out, lambda padding: _calibration_table(rows, padding)))


def main_table(rows, padding: tuple[int, int] = (0, 1)) -> Table:
    table = Table(title="τ per prompt set (docs/eval.md)", title_justify="left", padding=padding)
    columns(table, ("dataset", "prompts", "rounds", "τ", "95% CI", "τ ≤ limit", "verify", "tok/s", "speedup"))
    for name, stats in rows:
        summary = stats["summary"]
        low, high = stats["tau_ci"]
        base = summary["baseline"]
        table.add_row(name, str(stats["prompts"]), str(summary["rounds"]), number(stats["tau"]), f"[{number(low)}, {number(high)}]",
                      number(stats["tau_within_limit"]), number(stats["verify_rate"], 3), number(summary["tokens_per_s"], 1),
                      f"{number(base['speedup'])}×" if base and base["speedup"] else "-")
    return table


def _positions_table(rows, block: int) -> Table:
    """Per position j: DeepSpec's accept_rate@j / the conditional rate; then the accepted-count histogram."""
    table = Table(title="per position j: accept_rate@j / conditional@j; histogram: rounds accepting a drafts",
                  title_justify="left", padding=(0, 1))
    table.add_column("j or a", justify="right")
    for name, _ in rows:
        table.add_column(name, justify="right")
    for j in range(block):
        table.add_row(f"j={j}", *(f"{number(st['summary']['accept_rate'][j])} / "
                                  f"{number(st['summary']['acceptance_conditional'][j])}" for _, st in rows))
    for a in range(block + 1):
        table.add_row(f"a={a}", *(str(st["summary"]["accepted_histogram"][a]) for _, st in rows),
                      end_section=a == block)
    return table


def _calibration_table(rows, padding: tuple[int, int]) -> Table:
    table = Table(title="calibration of Π c_i: per-position mean (DeepSpec) and pooled (docs/metrics.md)",
                  title_justify="left", padding=padding)
    columns(table, ("dataset", "pairs", "ECE", "AUROC", "Brier", "pooled ECE", "pooled AUROC", "pooled Brier"))
    for name, stats in rows:
        calibration = stats["summary"]["calibration"]
        if calibration is None:
            continue
        pooled, mean = calibration["survival"], stats["calibration_per_position_mean"]
        table.add_row(name, str(pooled["count"]), number(mean["ece"], 3), number(mean["auroc"], 3), number(mean["brier"], 3),
                      number(pooled["ece"], 3), number(pooled["auroc"], 3), number(pooled["brier"], 3))
    return table


def print_compare(out: Console, comparison: dict, path: Path, differing: list[str]) -> None:
    """The τ difference against the --compare run, then the settings in which the two runs differ."""
    table = Table(title=f"τ difference: this run − {path.name} (95% bootstrap interval)", title_justify="left",
                  padding=(0, 1))
    for column in ("dataset", "Δτ", "95% CI", "pairing", "verdict"):
        table.add_column(column, justify="left" if column in ("dataset", "verdict", "pairing") else "right")
    for name, c in comparison.items():
        low, high = c["ci"]
        verdict = "-" if c["significant"] is None else ("significant" if c["significant"] else "not significant")
        table.add_row(name, number(c["difference"], 3), f"[{number(low, 3)}, {number(high, 3)}]",
                      "paired by prompt" if c["paired"] else "unpaired", verdict)
    out.print(table)
    if differing:
        out.print(Text("the two runs differ in: " + "; ".join(differing), style="yellow"))
