"""`dspark plan --concurrency`: the recorded rounds through the engines' batch verify schedulers, a table per load."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rich.text import Text

from dspark_cli.cli import options, render
from dspark_cli.cli.plan_report import load_table, settings_list
from dspark_cli.errors import DsparkError

MAX_CONCURRENCY = 4096


def run(loaded: list, runs: list[Path], concurrency: str, scheduler: str, costs: Optional[Path],
        calibration: Optional[Path], out: Optional[Path], json_path: Optional[Path], force: bool) -> None:
    from dspark_cli.runtime.measure import schedule
    from dspark_cli.runtime.measure.calibration import load_temperatures
    from dspark_cli.runtime.measure.costs import read_cost_table

    loads = parse_concurrency(concurrency)
    names = schedule.SCHEDULERS if scheduler == "all" else (scheduler,)
    if scheduler != "all" and scheduler not in schedule.SCHEDULERS:
        raise DsparkError(f"the scheduler option takes one of {', '.join(schedule.SCHEDULERS)} or all, not "
                          f"{scheduler!r}.")
    if costs is None:
        raise DsparkError("the concurrency option needs a cost table of the batch sizes it replays: give one with "
                          "the costs option (an SGLang SPS table, a TensorRT-LLM cost table, or a first local estimate from "
                          "`dspark bench verify --batch 1,4,16 --json costs.json`).")
    if out is not None:
        raise DsparkError("the output option writes a plan for `dspark serve --from-plan`, which is for batch 1; "
                          "leave it out with the concurrency option and use the json option.")
    cost = read_cost_table(costs)
    temperatures = load_temperatures(calibration) if calibration is not None else None
    block, rows, notes = schedule.plan_loads(loaded, cost, loads, names, temperatures)
    plan = schedule.LoadPlan([str(p) for p in runs], block, str(costs), cost.kind,
                             None if calibration is None else str(calibration), rows, notes)
    if json_path is not None:
        render.emit_json(plan.to_dict(), json_path, force)
    console = render.err_console if options.to_stdout(json_path) else render.console
    for c, load in rows.items():
        console.print(render.fitted(console, lambda padding: load_table(c, load, block, cost.kind, padding)))
    console.print(settings_list(next(iter(rows.values()))))
    console.print(Text(f"exact per round: the tokens a chosen verify length emits; estimates: {schedule.ESTIMATES}.",
                       style="dim"))
    for note in notes:
        console.print(Text(f"note: {render.name_flags(note)}", style="yellow"))


def parse_concurrency(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]: distinct integers from 1 to MAX_CONCURRENCY, in the order given."""
    parts = [p.strip() for p in text.split(",")]
    values = [int(p) for p in parts if p.isdigit()]
    if (len(values) != len(parts) or not all(1 <= v <= MAX_CONCURRENCY for v in values)
            or len(set(values)) < len(values)):
        raise DsparkError(f"the concurrency option takes distinct integers from 1 to {MAX_CONCURRENCY} separated by "
                          f"commas, like 1,8,32; not {text!r}.")
    return values
