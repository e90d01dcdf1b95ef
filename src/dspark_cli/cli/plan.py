"""`dspark plan`: the verify budget to deploy, from the rounds an eval run recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.text import Text

from dspark_cli.cli import options, plan_report, render

HELP = """Replay the rounds of `dspark eval --json` run files offline for every fixed verify length k = 1..N and a
sweep of confidence thresholds (survival and per-slot rules, raw and, with --calibration, calibrated): tau, accepted
and verified tokens per round, and with --costs (the table of `dspark bench verify`) the predicted tokens/s at batch
1. Runs of a smaller --block-size on the same prompts are measured, not replayed, and stand in for that k.
Recommends k or a threshold and prints the matching `vllm serve --speculative-config` fields; `dspark serve
--from-plan FILE` takes them. With --concurrency 1,8,32 the rounds are replayed instead at C requests at a time
through the engines' batch verify schedulers (--scheduler paper, paper-production, sglang, trtllm, vllm, fixed-k,
threshold or all; --costs an SGLang SPS table, a TensorRT-LLM cost table, or at concurrency 1 `bench verify`'s):
tokens/s, per-request tokens/s and verify tokens per step, and what to set in which engine. Which figures are
exact and which are estimates: docs/eval.md. With --costs an engine profile of `dspark bench engine`: a verdict
per concurrency and context (does speculation pay, which draft length n, 0 = serve without the draft, and
threshold), the predicted speedup with its interval; --context picks the contexts (docs/bench.md)."""


def read_profile_doc(costs: Optional[Path]) -> Optional[dict]:
    """The document of --costs when it is an engine profile (`dspark bench engine`), else None."""
    if costs is None:
        return None
    from dspark_cli.runtime.io.reading import read_json_file
    from dspark_cli.runtime.measure.engine_profile import MAX_PROFILE_BYTES, is_engine_profile

    doc = read_json_file(costs, "cost table", MAX_PROFILE_BYTES, "give a cost table or the JSON of `dspark bench "
                         "engine`")
    return doc if is_engine_profile(doc) else None


def register(app: typer.Typer) -> None:
    app.command("plan", help=HELP)(plan)


@render.handle_errors
def plan(
    runs: list[Path] = typer.Argument(..., metavar="RUN.json...", help="Run files of `dspark eval --json`: those "
                                      "of the largest block size are replayed; runs of a smaller --block-size on "
                                      "the same prompts add a measured row for that size."),
    costs: Optional[Path] = typer.Option(None, "--costs", metavar="COSTS.json", help="Milliseconds of a target "
                                         "pass over t tokens, t = 1..N+1 (`dspark bench verify --json`)."),
    calibration: options.calibration("Also replay the thresholds on STS-calibrated confidences (`dspark "
                                     "calibrate`).") = None,
    out: Optional[Path] = typer.Option(None, "--output", "-o", metavar="FILE", help="Write the plan (for `dspark "
                                       "serve --from-plan`)."),
    force: options.force("Replace FILE and the --json file if they exist.") = False,
    json_path: options.json_path("the plan") = None,
    concurrency: Optional[str] = typer.Option(None, "--concurrency", metavar="C,C...", help="Replay at these "
                                              "numbers of concurrent requests through the engines' schedulers."),
    scheduler: str = typer.Option("all", "--scheduler", metavar="NAME", help="With --concurrency: paper, "
                                  "paper-production, sglang, trtllm, vllm, fixed-k, threshold or all."),
    context: Optional[str] = typer.Option(None, "--context", metavar="T,T...", help="With an engine profile "
                                          "(`dspark bench engine`): the context lengths to judge (default: the "
                                          "profile's)."),
    other_pair: bool = typer.Option(False, "--other-pair", help="Use an engine profile measured on another pair's "
                                    "files (their fingerprints differ from the runs')."),
    thresholds: bool = typer.Option(False, "--thresholds", help="With an engine profile: also judge each draft "
                                    "length cut at a confidence threshold (priced from the fixed-length servers "
                                    "profiled, an extrapolation)."),
) -> None:
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.io.outputs import atomic_write_text, check_output_files, local_inputs
    from dspark_cli.runtime.measure import replay
    from dspark_cli.runtime.measure.calibration import load_temperatures
    from dspark_cli.runtime.measure.evaluation import EvalRun

    inputs = (local_inputs("run file", runs) + local_inputs("--costs table", [costs])
              + local_inputs("--calibration file", [calibration]))
    check_output_files([("--output file", out), ("--json file", json_path)], inputs, force)
    loaded = [EvalRun.load(path) for path in runs]
    profile_doc = read_profile_doc(costs)
    if profile_doc is not None:
        from dspark_cli.cli import plan_verdict

        if calibration is not None or scheduler != "all":
            raise DsparkError(f"{costs} is an engine profile, judged for the engine it measured: the calibration "
                              "and scheduler options do not apply; leave them out.")
        plan_verdict.run(loaded, runs, profile_doc, costs, concurrency, context, other_pair, thresholds, out,
                         json_path, force)
        return
    if context is not None or other_pair or thresholds:
        raise DsparkError("the context, other-pair and thresholds options judge an engine profile of `dspark bench "
                          "engine`; give one with the costs option.")
    if concurrency is not None:
        from dspark_cli.cli import plan_load

        plan_load.run(loaded, runs, concurrency, scheduler, costs, calibration, out, json_path, force)
        return
    table = replay.read_costs(costs) if costs is not None else None
    temperatures = load_temperatures(calibration) if calibration is not None else None
    block, rows, notes = replay.replay_runs(loaded, table, temperatures)
    if table is None:
        notes.append("no --costs table: tokens/s cannot be predicted, so nothing is recommended; measure one with "
                     "`dspark bench verify --target ... --json costs.json`.")
    recommended = replay.recommend(rows)
    notes += replay.recommendation_notes(recommended, block)
    result = replay.Plan([str(p) for p in runs], block, rows, recommended,
                         None if costs is None else str(costs), None if calibration is None else str(calibration),
                         notes)
    document = result.to_dict()
    if out is not None:
        atomic_write_text(out, json.dumps(document, indent=2) + "\n", replace=force)
    if json_path is not None:
        render.emit_json(document, json_path, force)
    console = render.err_console if options.to_stdout(json_path) else render.console
    console.print(plan_report.table(result))
    for note in notes:
        console.print(Text(f"note: {render.name_flags(note)}", style="yellow"))
    if result.recommended is not None:
        fixed, threshold = document["best_fixed"], document["best_threshold"]
        best = f"best fixed verify length: k = {int(fixed['value'])} ({fixed['tokens_per_s']:.1f} tokens/s)"
        if threshold is not None:
            best += f"; best survival threshold: {threshold['value']:g} ({threshold['tokens_per_s']:.1f} tokens/s)"
        console.print(Text(best, style="dim"))
        fields = document["speculative_config"]
        console.print(Text.assemble("recommended: ", (result.recommended.rule.label, "bold"),
                                    f" — {result.recommended.tokens_per_s:.1f} tokens/s predicted, τ "
                                    f"{result.recommended.tau:.2f}"))
        console.print(Text("vllm serve ... --speculative-config fields: ") + Text(json.dumps(fields), style="bold"))
        if out is not None:
            console.print(Text(f"`dspark serve --from-plan {out} -t TARGET -d DRAFT` serves with them", style="dim"))
