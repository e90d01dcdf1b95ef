"""`dspark plan --costs PROFILE`: an engine's cost profile (`dspark bench engine`) turned into a verdict per
concurrency and context: does speculation pay, with which draft length."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from rich.text import Text

from dspark_cli.cli import options, render
from dspark_cli.cli.plan_load import parse_concurrency
from dspark_cli.cli.plan_report import verdict_table
from dspark_cli.errors import DsparkError


def run(loaded: list, runs: list[Path], doc: dict, costs: Path, concurrency: Optional[str], context: Optional[str],
        other_pair: bool, thresholds: bool, out: Optional[Path], json_path: Optional[Path], force: bool) -> None:
    from dspark_cli.runtime.io.outputs import atomic_write_text
    from dspark_cli.runtime.measure.engine_profile import read_engine_profile
    from dspark_cli.runtime.engines import ENGINES
    from dspark_cli.runtime.measure.verdict import check_pair, decide

    profile = read_engine_profile(costs, doc)
    notes = check_pair(loaded, profile, other_pair)
    loads = parse_concurrency(concurrency) if concurrency else profile.concurrencies
    contexts = parse_contexts(context) if context else profile.contexts
    if out is not None and (len(loads) != 1 or len(contexts) != 1):
        raise DsparkError("the output option writes the plan `dspark serve --from-plan` deploys, which holds for one "
                          "load: give one concurrency and one context with it.")
    served = ENGINES.get(profile.engine)
    length_flag = served.draft_length_setting if served else "the draft length"
    threshold_flag = served.threshold_setting if served else None
    if thresholds and threshold_flag is None:
        raise DsparkError(f"{profile.engine} cuts no drafted block at a confidence threshold; leave out the thresholds "
                          "option.")
    plan = decide(loaded, profile, loads, contexts, [str(p) for p in runs], thresholds=thresholds)
    plan.notes[:0] = notes
    document = {**plan.to_dict(), "draft_length_setting": length_flag, "threshold_setting": threshold_flag}
    if out is not None:
        atomic_write_text(out, json.dumps(document, indent=2) + "\n", replace=force)
    if json_path is not None:
        render.emit_json(document, json_path, force)
    console = render.err_console if options.to_stdout(json_path) else render.console
    console.print(render.fitted(console, lambda padding: verdict_table(plan, padding)))
    for v in plan.verdicts:
        setting = f"{length_flag} {v.n}" + ("" if v.threshold is None else f", {threshold_flag} {v.threshold:g}")
        if v.n == 0:
            setting = "no recommendation" if v.verdict == "no data" else "serve without the draft"
        console.print(Text(f"context {v.context}, C = {v.concurrency}: {v.verdict}: {setting}. "
                           f"{render.name_flags(v.reason)}.", style="dim"), highlight=False)
    console.print(Text(f"costs: {profile.engine} {profile.engine_version} on {profile.hardware} ({costs}); "
                       "acceptance: the runs' rounds near each context, replayed.", style="dim"), highlight=False)
    for note in plan.notes:
        console.print(Text(f"note: {render.name_flags(note)}", style="yellow"), highlight=False)
    if out is not None:
        console.print(Text(f"`dspark serve --engine {profile.engine} --from-plan {out} -t TARGET -d DRAFT` serves "
                           "it", style="dim"), highlight=False)


def parse_contexts(text: str) -> list[int]:
    """'64,512' -> [64, 512]: distinct token counts >= 1, in the order given."""
    parts = [p.strip() for p in text.split(",")]
    values = [int(p) for p in parts if p.isdigit()]
    if len(values) != len(parts) or min(values, default=0) < 1 or len(set(values)) < len(values):
        raise DsparkError(f"the context option takes distinct token counts >= 1 separated by commas, like 64,512; "
                          f"not {text!r}.")
    return values
