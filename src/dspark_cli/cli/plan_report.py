"""`dspark plan`'s tables: the replayed verify rules (the recommended one in bold green), and with --concurrency one
table per load and what to set in each engine."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from dspark_cli.cli.render import columns, number


def table(result) -> Table:
    table = Table(title=f"replay of {sum(1 for _ in result.runs)} run file(s), block {result.block_size}: per round, "
                        "exact for the recorded rounds; τ of a real run and tokens/s are estimates",
                  title_justify="left", padding=(0, 1))
    for column in ("rule", "τ", "95% CI", "accepted", "verified", "censored", "ms/round", "tok/s"):
        table.add_column(column, justify="left" if column == "rule" else "right")
    shown = [row for row in result.rows if row.rule.kind in ("fixed", "measured") or _shown_threshold(row.rule.value)
             or row is result.recommended]
    for row in shown:
        low, high = row.tau_ci
        style = "bold green" if row is result.recommended else None
        table.add_row(row.rule.label, number(row.tau), f"[{number(low)}, {number(high)}]", number(row.accepted_per_round),
                      number(row.verified_per_round), str(row.censored_rounds), number(row.round_ms, 1),
                      number(row.tokens_per_s, 1), style=style)
    return table


def _shown_threshold(value: float) -> bool:
    """The table shows every tenth threshold (the JSON and the recommendation have the whole sweep)."""
    return abs(value * 10 - round(value * 10)) < 1e-9


def load_table(concurrency: int, rows: list, block: int, kind: str, padding: tuple[int, int] = (0, 1)) -> Table:
    """One load: each scheduler's predicted tokens/s, per request, verify tokens per step; the best in bold green."""
    best = max(rows, key=lambda row: row.tokens_per_s)
    out = Table(title=f"concurrency {concurrency}, block {block}, {kind}: the best in bold green",
                title_justify="left", padding=padding)
    columns(out, ("scheduler", "tok/s", "tok/s per request", "verify tokens/step", "τ", "censored"))
    for row in rows:
        out.add_row(row.scheduler.label, number(row.tokens_per_s, 1), number(row.per_request_tokens_per_s, 1),
                    number(row.verify_tokens_per_step, 1), number(row.tau), str(row.censored_rounds),
                    style="bold green" if row is best else None)
    return out


def settings_list(rows: list) -> Text:
    """What to set in which engine for each scheduler, once (it does not depend on the load)."""
    lines = [f"  {row.scheduler.label}: {row.scheduler.setting}" for row in rows]
    return Text("what to set:\n" + "\n".join(lines), style="dim")


VERDICT_STYLES = {"pays": "bold green", "does not pay": "bold red", "undecided": "yellow", "no data": "dim"}


def verdict_table(plan, padding: tuple[int, int] = (0, 1)) -> Table:
    """One row per (context, concurrency): the verdict, the draft length and threshold to serve, the best candidate's
    predicted speedup with its interval, τ and tokens/s, the engine's plain tokens/s and the draft's ms per step (at
    each draft length the profile measured)."""
    profile = plan.profile
    out = Table(title=f"does speculation pay? {profile.engine} {profile.engine_version}, block {plan.block_size}; "
                      "speedup over plain decoding (interval: the runs' τ interval × the profile's spread)",
                title_justify="left", padding=padding)
    columns(out, ("context", "C", "verdict", "n (p-min)", "speedup [interval]", "τ", "plain tok/s", "spec tok/s",
                  "draft ms"))
    previous = None
    for v in plan.verdicts:
        if previous is not None and v.context != previous:
            out.add_section()
        previous = v.context
        best = v.best
        drafts = ", ".join(f"{ms:.1f}" for ms in v.draft_ms_per_step.values())
        chosen = str(v.n) + ("" if v.threshold is None else f" ({v.threshold:g})")
        speedup = "" if best is None else f"{best.speedup:.2f} [{best.speedup_low:.2f}, {best.speedup_high:.2f}]"
        out.add_row(str(v.context), str(v.concurrency), Text(v.verdict, style=VERDICT_STYLES[v.verdict]), chosen,
                    speedup, "" if best is None else number(best.tau), number(v.plain_tokens_per_s, 0),
                    "" if best is None else number(best.tokens_per_s, 0), drafts)
    return out
