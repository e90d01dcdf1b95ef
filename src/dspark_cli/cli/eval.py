"""`dspark eval`: DeepSpec's acceptance table for any draft, per prompt set, with confidence intervals."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from dspark_cli.cli import eval_report, options, render

HELP = """Evaluate a DSpark draft against its target on prompt sets (JSONL in DeepSpec's eval_datasets layout, or
.txt): per set and for all, tau (incl. bonus) with a 95% bootstrap interval, per-position acceptance, confidence
calibration in both definitions, and with --baseline the speedup. Without arguments: the shipped demo pair on its two
shipped prompt sets, offline (--pair demo-hybrid: the hybrid pair on the same sets). --json saves the run as
prompts finish; --resume continues it. docs/eval.md."""

# The options that decide what a prompt produces: a resumed run must use the values stored in its file. The run file
# keeps them twice: as requested (settings.requested, what --resume compares the command line with) and resolved.
RUN_KEYS = ("target", "draft", "device", "dtype", "block_size", "markov", "temperature", "confidence_threshold",
            "confidence_rule", "max_new_tokens", "seed", "chat", "thinking", "baseline", "limit", "draft_topk",
            "top_p", "top_k")


def register(app: typer.Typer) -> None:
    app.command("eval", help=HELP)(eval_command)


@render.handle_errors
def eval_command(
    ctx: typer.Context,
    target: options.target() = None,
    draft: options.draft() = None,
    pair_name: options.pair() = None,
    data: Optional[list[Path]] = typer.Option(None, "--data", help="Prompt set: .jsonl ('turns' list, first turn; "
                                              "or 'prompt') or .txt (paragraphs, else lines). Repeat for more."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="At most N prompts per set (DeepSpec's "
                                        "choice: the first N after a seeded shuffle)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Wrap prompts in the chat template "
                                        "(default: when the tokenizer has one)."),
    thinking: bool = typer.Option(False, "--thinking/--no-thinking", help="enable_thinking for the chat template "
                                  "(DeepSpec's evaluator: off)."),
    temperature: options.temperature() = 0.0,
    top_p: options.top_p() = 1.0,
    top_k: options.top_k() = 0,
    block_size: options.block_size() = None,
    draft_topk: options.draft_topk() = None,
    markov: options.markov() = "auto",
    confidence_threshold: options.confidence_threshold() = None,
    confidence_rule: options.confidence_rule() = "survival",
    baseline: bool = typer.Option(False, "--baseline", help="Also decode plainly: tokens/s and speedup."),
    seed: options.seed("Prompt i of a set draws with seed + i (DeepSpec); the seed itself") = 0,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1, help="Tokens per prompt."),
    device: options.device() = "auto",
    dtype: options.dtype() = "auto",
    json_path: Optional[Path] = typer.Option(None, "--json", help="Run file: every number and every round, saved "
                                             "atomically as prompts finish (and on Ctrl-C)."),
    markdown_path: Optional[Path] = typer.Option(None, "--markdown", help="Write the table as Markdown."),
    force: options.force("Replace existing --json / --markdown files (the --resume file is always updated).")
    = False,
    compare: Optional[Path] = typer.Option(None, "--compare", help="An earlier run file: print the τ difference "
                                           "with its 95% interval, and whether it is significant."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue this run file: finished prompts are "
                                          "kept, only missing ones run (saved back to it unless --json)."),
    calibration: options.calibration() = None,
    dist_timeout: float = typer.Option(600.0, "--dist-timeout", help="Under torchrun: seconds a process waits for "
                                       "the others (a prompt on each rank) before the run fails."),
) -> None:
    from dspark_cli.runtime import distributed

    dist = distributed.context_from_env()
    with distributed.on_ranks(dist, options.torch_device(device), dist_timeout, render.quiet) as backend:
        if backend is not None:
            render.console.print(Text(f"eval on {dist.world_size} processes (torchrun)", style="dim"))
        _evaluate(ctx, dist)


def _evaluate(ctx, dist) -> None:
    """eval_command on one rank: inputs and the pair (checked on every rank together), the prompts (rank i runs
    prompt i mod N; rank 0 merges and saves), then rank 0's report. The options are ctx.params."""
    out = render.console
    o = SimpleNamespace(**ctx.params)
    given = {name: value for name, value in ctx.params.items()
             if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"}
    run, sets, settings, session, json_path, old = dist.together(lambda: _prepare(given, o, out, dist),
                                                                 "reading the inputs and loading the pair")
    replace = _run_everywhere(dist, run, sets, settings, session, json_path, out,
                              o.force or _in_place(json_path, o.resume))
    if dist.is_main:
        _report(run, sets, settings, old, o.compare, json_path, o.markdown_path, out, replace, o.force)


def _prepare(given: dict, o: SimpleNamespace, out: Console, dist):
    """-> (run, sets, settings, session, json_path, the --compare run): every check before work, then the pair."""
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.measure import evaluation as ev
    from dspark_cli.runtime.session import open_session

    if o.pair_name is not None:  # the shipped pair's folders stand for --target and --draft, resumed runs included
        o.target, o.draft = options.pair_paths(o.pair_name, o.target, o.draft)
        given.update(target=o.target, draft=o.draft)
        if o.resume is None:
            o.data = o.data or list(ev.SHIPPED_SETS)
    old = ev.EvalRun.load(o.compare) if o.compare is not None else None
    json_path = o.json_path
    if o.resume is not None:
        run = ev.EvalRun.load(o.resume)
        _check_resume(run.settings, given, o.resume)
        _check_resume_calibration(run.settings["calibration"], o.calibration, o.resume)
        settings = dict(run.settings)
        if o.data:  # Typer gives an empty list when --data is not passed
            given_sets = [ev.read_prompt_set(p, settings["limit"], settings["seed"]) for p in o.data]
            _check_resumed_sets(run, given_sets, o.resume)
            run.sets = given_sets
        sets = run.sets
        json_path = json_path or o.resume
    else:
        target, draft, data = o.target, o.draft, o.data
        if (target is None) != (draft is None):
            raise DsparkError("pass both --target and --draft, or neither to use the demo pair.")
        if target is None:
            from dspark_cli.runtime.demo import demo_pair

            target, draft = map(str, demo_pair())
            data = data or list(ev.SHIPPED_SETS)
        if not data:
            raise DsparkError("give at least one prompt set with --data FILE.")
        sets = [ev.read_prompt_set(path, o.limit, o.seed) for path in data]
        requested = {"target": target, "draft": draft,
                     **{key: getattr(o, key) for key in RUN_KEYS if key not in ("target", "draft")}}
        settings = {**requested, "calibration": _calibration_setting(o.calibration), "requested": requested}
        run = ev.EvalRun(settings, sets)
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise DsparkError(f"two prompt sets share the name {_duplicate(names)!r} (the file name); rename one.")
    _check_outputs(settings, sets, o.compare, json_path, o.markdown_path, o.force, o.resume)
    session = open_session(settings, sets, dist, warn=lambda warnings: _warn(out, warnings), loading=out.status,
                           resumed=o.resume is not None)
    run.settings = settings
    return run, sets, settings, session, json_path, old


def _run_everywhere(dist, run, sets, settings, session, json_path, out: Console, replace: bool) -> bool:
    """Run the missing prompts (one process, or this rank's share), rank 0 saving as they finish (the first save
    exclusive unless `replace`); Ctrl-C keeps what finished and says how to resume. -> whether the run file may be
    replaced now (it has been saved, or `replace`)."""
    from dspark_cli.errors import Terminated
    from dspark_cli.runtime.measure import evaluation as ev

    path = json_path if dist.is_main else None
    save = ev.RunSaver(run, path, replace)
    try:
        if dist.enabled:
            pending = ev.pending_prompts(run, sets)
            dist.same_everywhere([len(pending), _crc(pending)], "prompts to run (prompt sets, --limit, seed)")
            _run_shared(dist, run, sets, pending, session, save, out)
        else:
            _run_sets(run, sets, session, save, out)
    except BaseException as stop:
        save.flush()  # what finished is kept whatever stopped the run
        if (isinstance(stop, (KeyboardInterrupt, Terminated)) and path is not None and run.results
                and Path(path).is_file()):  # render.handle_errors says what was kept
            stop.kept = (f"the {len(run.results)} finished prompts are saved in {path}; continue with `dspark eval "
                         f"--resume {path}` (with any number of processes)")
        raise
    return save.replace


def _crc(items: list) -> int:
    """A checksum of JSON-ready items (the same on every rank when they run the same prompts)."""
    import json
    import zlib

    return zlib.crc32(json.dumps(items).encode())


def _run_shared(dist, run, sets, pending, session, save, out: Console) -> None:
    """Under torchrun: prompt i of the pending list runs on rank i mod N; after each step every rank's result
    reaches rank 0, which appends and saves them (a failure on any rank stops all, naming it)."""
    from dspark_cli.runtime.measure import evaluation as ev

    mine = ev.shard(pending, dist.rank, dist.world_size)
    steps = -(-len(pending) // dist.world_size)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=out, transient=False) as progress:
        tasks = {s.name: progress.add_task(s.name, total=len(s.prompts), completed=len(run.results_of(s)))
                 for s in sets}
        for step in range(steps):
            item = mine[step] if step < len(mine) else None
            what = f"prompt {item[1] + 1} of {item[0]}" if item else "an idle step"
            results = dist.exchange(lambda: None if item is None else vars(session(*item)), what)
            for result in results:
                if result is not None:
                    run.results.append(ev.PromptResult(**result))
                    save()
                    progress.advance(tasks[result["set_name"]])


def _report(run, sets, settings, old, compare, json_path, markdown_path, out: Console, replace: bool,
            force: bool) -> None:
    from dspark_cli.runtime.measure import evaluation as ev

    block = settings["block_size"]
    rows = [(s.name, ev.set_statistics(run.results_of(s), block, settings["max_new_tokens"])) for s in sets]
    everything = [r for s in sets for r in run.results_of(s)]
    rows.append(("all", ev.set_statistics(everything, block, settings["max_new_tokens"])))
    statistics = {name: stats for name, stats in rows}
    if old is not None:
        statistics["compare"] = _compare(run, old, sets)
    eval_report.print_report(out, settings, rows)
    if old is not None:
        differing = [f"{k} {settings.get(k)!r} vs {old.settings.get(k)!r}" for k in RUN_KEYS
                     if k not in ("baseline", "limit", "device") and settings.get(k) != old.settings.get(k)]
        eval_report.print_compare(out, statistics["compare"], compare, differing)
    if json_path is not None:
        run.save(json_path, statistics, replace)
    if markdown_path is not None:
        from dspark_cli.runtime.io.outputs import atomic_write_text

        atomic_write_text(markdown_path, ev.markdown_table(rows, block, settings), replace=force)


def _run_sets(run, sets, session, save, out: Console) -> None:
    """Run the missing prompts of every set, one progress bar per set, `save` after each prompt."""
    from dspark_cli.runtime.measure import evaluation as ev

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=out, transient=False) as progress:
        for prompt_set in sets:
            finished = len(run.results_of(prompt_set))
            task = progress.add_task(prompt_set.name, total=len(prompt_set.prompts), completed=finished)

            def done(result, task=task) -> None:
                save(result)
                progress.advance(task)

            ev.run_set(run, prompt_set, lambda i, text, name=prompt_set.name: session(name, i, text), done)


def _check_outputs(settings: dict, sets, compare, json_path, markdown_path, force: bool, resume) -> None:
    """Refuse, before any work, a --json or --markdown path that would overwrite an input (a prompt set, the
    pair, the --compare run), cannot be written, or exists (unless --force). The --resume file is meant to be
    updated."""
    from dspark_cli.runtime.io.outputs import check_output_files, local_inputs

    inputs = (local_inputs("prompt set", [s.path for s in sets]) + local_inputs("target", [settings["target"]])
              + local_inputs("draft", [settings["draft"]]) + local_inputs("--compare run", [compare])
              + local_inputs("--calibration file", [(settings["calibration"] or {}).get("path")]))
    outputs = [("--json file", json_path), ("--markdown file", markdown_path)]
    check_output_files(outputs, inputs)
    check_output_files([(what, path) for what, path in outputs if not (path == json_path and _in_place(path, resume))],
                       [], force)


def _in_place(json_path, resume) -> bool:
    """The run file is the --resume file itself: updated in place, not a new output."""
    from dspark_cli.runtime.io.outputs import real_path

    return resume is not None and json_path is not None and real_path(json_path) == real_path(resume)


def _duplicate(names: list[str]) -> str:
    return next(name for name in names if names.count(name) > 1)


def _calibration_setting(path: Path | None) -> dict | None:
    """The run file's record of --calibration: the file and its temperatures (a resumed run uses these)."""
    if path is None:
        return None
    from dspark_cli.runtime.measure.calibration import load_temperatures

    return {"path": str(path), "temperatures": load_temperatures(path)}


def _check_resume_calibration(stored: dict | None, given: Path | None, path: Path) -> None:
    from dspark_cli.errors import DsparkError

    if given is not None and (stored is None or stored["path"] != str(given)):
        was = "without --calibration" if stored is None else f"with --calibration {stored['path']}"
        raise DsparkError(f"{path} was run {was}, not with --calibration {given}; drop --calibration to resume with "
                          "the stored temperatures, or start a new run.")


def _check_resumed_sets(run, given: list, path: Path) -> None:
    """--data on a resumed run may add prompt sets, never drop or change one with finished prompts: their results
    would no longer belong to any set of the run file."""
    from dspark_cli.errors import DsparkError

    by_name = {s.name: s for s in given}
    for prompt_set in run.sets:
        if not run.results_of(prompt_set):
            continue
        now = by_name.get(prompt_set.name)
        if now is None or now.prompts != prompt_set.prompts:
            how = "is not among the given prompt sets" if now is None else "holds other prompts now"
            raise DsparkError(f"{path} has finished prompts of the set {prompt_set.name} ({prompt_set.path}), which "
                              f"{how}; give it again with the other sets, or drop --data to resume on the "
                              "stored sets.")


def _check_resume(settings: dict, given: dict, path: Path) -> None:
    """The command line against the run's settings: a flag resumes when it repeats the value requested, or the value
    the run resolved that request to (--block-size 7 where the default resolved to 7, --device cpu where auto chose
    cpu; a run file before dspark 0.2 has only the resolved ones); a different one is named, a default as such."""
    from dspark_cli.errors import DsparkError

    requested = settings.get("requested", settings)
    for key in RUN_KEYS:
        if key not in given:
            continue
        asked, resolved = requested.get(key), settings.get(key)
        if _same_request(key, given[key], asked) or _same_request(key, given[key], resolved):
            continue
        flag = "--" + key.replace("_", "-")
        was = f"the default {flag}" if asked is None else f"{flag} {asked!r}"
        if resolved != asked:
            was += f" (resolved to {resolved!r})"
        raise DsparkError(f"{path} was run with {was}, not {flag} {given[key]!r}; drop {flag} to resume with the "
                          "stored settings, or start a new run.")


def _same_request(key: str, given, stored) -> bool:
    """Equal requests; a target or draft path names the same place however it is spelled (a trailing slash)."""
    if key in ("target", "draft") and isinstance(given, str) and isinstance(stored, str):
        return given == stored or Path(given) == Path(stored)
    return given == stored


def _warn(out: Console, warnings: list[str]) -> None:
    for warning in warnings:
        out.print(Text(f"warning: {warning}", style="yellow"))


def _compare(run, old, sets) -> dict:
    from dspark_cli.runtime.measure import evaluation as ev

    by_name = {s.name: s for s in old.sets}
    comparison = {}
    for prompt_set in sets:
        if prompt_set.name in by_name:
            earlier = old.results_of(by_name[prompt_set.name])
            comparison[prompt_set.name] = ev.compare_tau(run.results_of(prompt_set), earlier)
    everything = [r for s in sets for r in run.results_of(s)]
    before = [r for s in old.sets for r in old.results_of(s)]
    comparison["all"] = ev.compare_tau(everything, before)
    return comparison
