"""`dspark calibrate`: Sequential Temperature Scaling of the confidence head from eval runs."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.text import Text

from dspark_cli.cli import calibrate_report, options, render
from dspark_cli.runtime.settings import SELECTOR

HELP = """Fit the confidence head's Sequential Temperature Scaling (one temperature per draft position, fitted left to
right so that the survival prod c_i is calibrated) on `dspark eval --json` run files, score it on held-out prompts
(ECE, AUROC, Brier per position, before and after), and write the one JSON file SGLang
(--speculative-dspark-confidence-sts-path) and TensorRT-LLM (confidence_sts_path) read for a DSpark draft.
`dspark generate` and `dspark eval` take it with --calibration (for a DFlash2 draft, whose selector score no engine
calibrates, they alone read it). docs/eval.md."""


def register(app: typer.Typer) -> None:
    app.command("calibrate", help=HELP)(calibrate)


@render.handle_errors
def calibrate(
    runs: list[Path] = typer.Argument(..., metavar="RUN.json...", help="Run files of `dspark eval --json`."),
    out: Path = typer.Option(..., "--output", "-o", metavar="FILE", help="The STS file to write."),
    holdout: float = typer.Option(0.3, "--holdout", min=0.01, max=0.99, help="Fraction of each prompt set's "
                                  "prompts held out to score the fit (split by prompt, seeded)."),
    seed: options.seed("Seed of the held-out split") = 0,
    force: options.force("Replace FILE and the --json file if they exist.") = False,
    json_path: options.json_path("the fit and its held-out scores") = None,
) -> None:
    import json

    from dspark_cli.runtime.io.outputs import atomic_write_text, check_output_files, local_inputs
    from dspark_cli.runtime.measure.calibration import fit_runs
    from dspark_cli.runtime.measure.evaluation import EvalRun

    inputs = local_inputs("run file", runs)
    check_output_files([("--output file", out), ("--json file", json_path)], inputs, force)
    loaded = [EvalRun.load(path) for path in runs]
    result = fit_runs(loaded, [str(path) for path in runs], fraction=holdout, seed=seed)
    document = result.to_json()
    atomic_write_text(out, json.dumps(document, indent=2) + "\n", replace=force)
    if json_path is not None:
        render.emit_json(document, json_path, force)
    console = render.err_console if options.to_stdout(json_path) else render.console
    console.print(calibrate_report.table(result))
    for note in result.notes:
        console.print(Text(f"note: {render.name_flags(note)}", style="yellow"))
    selector = any(run.settings["markov"] == SELECTOR for run in loaded)
    console.print(Text.assemble("written to ", (str(out), "bold"), f" ({_readers(selector)})"))


def _readers(selector: bool) -> str:
    """Who reads the STS file: for a DFlash2 draft's selector score dspark alone (SGLang serves such a draft with its
    DFLASH algorithm, which takes no STS file; runtime/engines/sglang.py), else SGLang and TensorRT-LLM too."""
    if selector:
        return ("dspark: --calibration; no engine reads an STS file for a DFlash2 draft: SGLang's DFLASH algorithm and "
                "llama.cpp take none, TensorRT-LLM refuses the draft")
    return "SGLang: --speculative-dspark-confidence-sts-path; TensorRT-LLM: confidence_sts_path; dspark: --calibration"
