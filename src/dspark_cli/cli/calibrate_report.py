"""`dspark calibrate`'s table: the fitted temperatures and the held-out scores before → after."""

from __future__ import annotations

from rich.table import Table

from dspark_cli.cli.render import number


def table(result) -> Table:
    table = Table(title=f"STS on {result.fit_prompts} prompts ({result.fit_rounds} rounds); scores of the survival "
                        f"on {result.heldout_prompts} held-out prompts, before → after", title_justify="left",
                  padding=(0, 1))
    for column in ("j", "T_j", "pairs", "ECE", "ECE floor", "AUROC", "Brier"):
        table.add_column(column, justify="right")
    rows = zip(result.temperatures, result.before, result.after, result.floor, strict=True)
    for j, (t, before, after, floor) in enumerate(rows):
        table.add_row(str(j), f"{t:.3f}", str(after.count), f"{number(before.ece, 3)} → {number(after.ece, 3)}",
                      number(floor, 3), f"{number(before.auroc, 3)} → {number(after.auroc, 3)}",
                      f"{number(before.brier, 3)} → {number(after.brier, 3)}")
    table.caption = ("ECE floor: the ECE a perfectly calibrated head would show on these held-out pairs "
                     "(finite samples); an ECE near it is as calibrated as the pairs can tell.")
    table.caption_justify = "left"
    return table
