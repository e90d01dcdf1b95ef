"""`dspark bench markov`: the sequential Markov stage, every method side by side (docs/bench.md)."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from dspark_cli.cli import options, render
from dspark_cli.cli.render import console, emit_json, err_console, handle_errors, name_flags
from dspark_cli.errors import EXIT_FINDINGS, DsparkError
from dspark_cli.runtime.units import format_bytes

bench_app = typer.Typer(no_args_is_help=True, help="Profile the parts of DSpark drafting.")

DEFAULT_VOCAB = 151936  # Qwen3
DEFAULT_RANK = 256
DEFAULT_HIDDEN = 4096  # random gated / RNN heads: the draft hidden size their projections read
TABLE_WIDTH = 170  # columns of the output when it goes to a file or pipe (a terminal uses its own width)


def register(app: typer.Typer) -> None:
    from dspark_cli.cli import bench_audit

    bench_audit.register(bench_app)
    app.add_typer(bench_app, name="bench")


@bench_app.callback()
def _bench() -> None:
    """Profile the parts of DSpark drafting."""


@bench_app.command("markov")
@handle_errors
def markov(
    draft: options.draft("Draft checkpoint (folder or hub id): use its Markov head.") = None,
    vocab: int = typer.Option(None, "--vocab", min=1,
                              help=f"Random weights: target vocabulary V (default {DEFAULT_VOCAB})."),
    draft_vocab: int = typer.Option(None, "--draft-vocab", min=1, help="Random weights: draft vocabulary Vd; Vd < V "
                                    "adds a d2t map (default V)."),
    rank: int = typer.Option(None, "--rank", min=1, help=f"Random weights: Markov rank r (default {DEFAULT_RANK})."),
    head_type: str = typer.Option(None, "--head-type", help="Random weights: Markov head type, vanilla, gated or "
                                  "rnn (default vanilla)."),
    hidden: int = typer.Option(None, "--hidden", min=1, help=f"Random weights: the hidden size a gated / RNN head "
                               f"reads (default {DEFAULT_HIDDEN})."),
    block: int = typer.Option(7, "--block", min=1, help="Positions N per draft step."),
    batch: str = typer.Option(None, "--batch", help="Batch sizes (default 1,8,32,128 on CUDA, 1,8 on CPU)."),
    topk: str = typer.Option("16,64,256", "--topk", help="Candidates k per position."),
    formats: str = typer.Option("bf16,nvfp4", "--format", help="Markov W2 formats: bf16, nvfp4."),
    temperature: str = typer.Option("0,1", "--temperature", help="Temperatures (0 = greedy; > 0 Gumbel-max)."),
    device: options.device("auto (cuda if available, else cpu), cpu or cuda.") = "auto",
    reps: int = typer.Option(None, "--reps", min=1, help="Timed repetitions (default 100 on CUDA, 10 on CPU)."),
    warmup: int = typer.Option(None, "--warmup", min=0,
                               help="Untimed repetitions first (default 10 on CUDA, 2 on CPU)."),
    peak_gbps: float = typer.Option(None, "--peak-gbps", min=0.001, help="Memory bandwidth for the lower bound, "
                                    "GB/s (default: spec sheet of known GPUs, else a copy measured in the run)."),
    seed: options.seed("Seed of the random weights and inputs") = 0,
    json_out: options.json_path("the results (the tables then go to stderr)") = None,
    plot: Path = typer.Option(None, "--plot", help="Write a PNG of latency against batch size to FILE."),
    force: options.force("Replace existing --json / --plot files.") = False,
) -> None:
    """Time the sequential Markov stage: dense, top-k bf16, top-k NVFP4 and the fused walk (vanilla heads; gated
    and RNN heads run the first three).

    Every method is first checked to emit the reference walk's tokens (greedy, and with the same Gumbel
    noise); exit code 1 if one does not.
    """
    if peak_gbps is not None and not math.isfinite(peak_gbps):
        raise DsparkError(f"--peak-gbps must be a finite number of GB/s, got {peak_gbps}.")
    from dspark_cli.runtime.bench.run import BenchConfig, checkpoint_heads, random_heads, run_bench, write_latency_chart

    if plot is not None and options.to_stdout(plot):
        raise DsparkError("--plot writes a PNG file; give a file name, not -.")
    _check_outputs(json_out, plot, draft, force)
    device_name = _bench_device(device)
    cuda = device_name == "cuda"
    config = BenchConfig(
        block=block,
        batches=_ints(batch or ("1,8,32,128" if cuda else "1,8"), "--batch"),
        topks=_ints(topk, "--topk"),
        formats=_choices(formats, "--format", ("bf16", "nvfp4")),
        temperatures=_temperatures(temperature),
        device=device_name,
        reps=reps or (100 if cuda else 10),
        warmup=(10 if cuda else 2) if warmup is None else warmup,
        peak_gbps=peak_gbps,
        seed=seed,
    )
    if draft is not None:
        if vocab or draft_vocab or rank or head_type or hidden:
            raise DsparkError("--draft takes the shapes and the head type from the checkpoint; drop "
                              "--vocab/--draft-vocab/--rank/--head-type/--hidden.")
        heads = checkpoint_heads(config, draft)
    else:
        vocab = vocab or DEFAULT_VOCAB
        if hidden is not None and head_type in (None, "vanilla"):
            raise DsparkError("--hidden sizes the hidden states of a gated or RNN head; add --head-type gated or rnn, "
                              "or drop --hidden.")
        heads = random_heads(config, vocab, draft_vocab or vocab, rank or DEFAULT_RANK, head_type or "vanilla",
                             hidden or DEFAULT_HIDDEN)
    with err_console.status("checking tokens, then timing") as status:
        report = run_bench(config, heads, progress=lambda text: status.update(f"checking, then timing: {text}"))
    out = err_console if options.to_stdout(json_out) else console
    if not out.is_terminal:  # a file or pipe: wide rows rather than wrapped cells
        out = Console(width=TABLE_WIDTH, stderr=out.stderr)
    for fmt in config.formats:
        for temp in config.temperatures:
            out.print(_table(report, fmt, temp))
    for note in report.notes:
        out.print(Text(f"• {name_flags(note)}", style="dim"), highlight=False)
    if json_out is not None:
        emit_json(report.to_dict(), json_out, force)
    if plot is not None:
        _write_exclusive(plot, force, lambda path: write_latency_chart(report, path))
        out.print(Text(f"plot written to {plot}"), highlight=False)
    if not report.ok:
        raise DsparkError("a method emitted tokens that differ from the reference walk (rows marked MISMATCH); "
                          "its timing was skipped. Run with --json for the position.", EXIT_FINDINGS)


def _bench_device(name: str) -> str:
    """The shared --device, limited to what the bench times: the current CUDA device or the CPU."""
    device = options.torch_device(name)
    if device.index is not None:
        raise DsparkError(f"--device {name}: bench markov runs on the current CUDA device; pass --device cuda and "
                          "pick the GPU with CUDA_VISIBLE_DEVICES.")
    return device.type


def _check_outputs(json_out: Path | None, plot: Path | None, draft: str | None, force: bool) -> None:
    """Refuse, before the run, --json / --plot paths that would overwrite an input, cannot be written or exist
    (unless --force)."""
    from dspark_cli.runtime.io.outputs import local_inputs

    _check_exclusive([("--json file", json_out), ("--plot file", plot)], local_inputs("draft checkpoint", [draft]),
                     force)


def _table(report, fmt: str, temperature: float) -> Table:
    from dspark_cli.runtime.bench.run import SPREAD_LIMIT

    mode = "greedy" if temperature == 0 else "Gumbel-max"
    table = Table(
        title=Text(f"Markov stage · {fmt} W2 · T={temperature:g} ({mode}) · V={report.vocab} "
                   f"Vd={report.draft_vocab} r={report.rank} N={report.block}"
                   + ("" if report.head_type == "vanilla" else f" · {report.head_type} head H={report.hidden_size}")
                   + f" · {report.device_name}"),
        caption=Text(f"bound = weight bytes / {report.peak_gbps:.0f} GB/s ({name_flags(report.peak_source)}) + one launch "
                     f"({report.launch_us:.1f} µs) · ×1, ×2 = speedup over 1 dense, 2 top-k bf16 in the same mode · "
                     f"spread = (p90 - min) / min, ! = over {SPREAD_LIMIT:.0%}: too noisy to compare"
                     + (" · * Triton kernel under the interpreter: tokens checked, not timed"
                        if _interpreted(report) else "")),
        title_justify="left",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("B", "k"):
        table.add_column(name, justify="right")
    table.add_column("method")
    for name in ("µs/step", "min µs", "µs/pos", "p10–p90", "spread", "weights", "GB/s", "bound µs", "×1", "×2"):
        table.add_column(name, justify="right")
    table.add_column("tokens")
    previous_batch = None
    for row in report.rows:
        if row.fmt != fmt or row.temperature != temperature:
            continue
        if previous_batch is not None and row.batch != previous_batch:
            table.add_section()
        previous_batch = row.batch
        timing = row.timing
        table.add_row(
            str(row.batch),
            "all" if row.topk is None else str(row.topk),
            _method_cell(row),
            "*" if row.mode == "interpreter" else _num(timing and timing.median_us),
            _num(timing and timing.min_us),
            _num(row.us_per_position),
            f"{_num(timing.p10_us)}–{_num(timing.p90_us)}" if timing else "",
            _spread_cell(timing),
            format_bytes(row.weight_bytes) if row.weight_bytes else "",
            _num(row.achieved_gbps),
            _num(row.lower_bound_us),
            _ratio(row.speedup_vs_dense),
            _ratio(row.speedup_vs_topk),
            _tokens_cell(row),
        )
    return table


def _spread_cell(timing) -> str:
    if timing is None:
        return ""
    return f"[yellow]{timing.spread:.0%} ![/]" if timing.too_noisy else f"{timing.spread:.0%}"


def _interpreted(report) -> bool:
    return any(row.mode == "interpreter" for row in report.rows)


def _method_cell(row) -> str:
    text = row.title
    if row.mode == "graph":
        text += " · graph"
    elif row.mode == "interpreter":
        text += " · kernel*"
    elif row.engine == "torch twin":
        text += " · twin"
    return f"[dim]{text}[/]" if row.method == "select" else text


def _tokens_cell(row) -> str:
    if row.check is None:
        return ""
    label = row.check.label()
    if row.requests_checked < row.batch:
        label += f" ({row.requests_checked}/{row.batch} req.)"
    return f"[red]{label}[/]" if not row.check.ok else f"[green]{label}[/]"


def _num(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}×"


def _numbers(text: str, option: str, cast: type, minimum: float, what: str, example: str) -> tuple:
    """A comma-separated option value -> a tuple of finite numbers >= minimum, or one clear error."""
    try:
        values = tuple(cast(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or not all(math.isfinite(value) and value >= minimum for value in values):
        raise DsparkError(f"{option} takes {what} separated by commas (e.g. {example}), got {text!r}.")
    return values


def _ints(text: str, option: str) -> tuple[int, ...]:
    return _numbers(text, option, int, 1, "positive integers", "1,8,32")


def _temperatures(text: str) -> tuple[float, ...]:
    return _numbers(text, "--temperature", float, 0, "finite numbers >= 0", "0,1")


def _choices(text: str, option: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    values = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    unknown = [v for v in values if v not in allowed]
    if not values or unknown:
        raise DsparkError(f"{option} takes {' and/or '.join(allowed)} separated by commas, got {text!r}.")
    return values


@bench_app.command("verify")
@handle_errors
def verify(
    target: options.target("Target causal LM: folder or hub id (default: the demo pair's).") = None,
    draft: options.draft("Its DSpark draft: capture the hidden states the draft reads, as a round does (default: the "
                         "demo draft with the demo target, else one layer).") = None,
    tokens: int = typer.Option(8, "--tokens", min=1, help="Time passes over t = 1..TOKENS tokens (block size + 1 "
                               "covers every verify length)."),
    context: int = typer.Option(512, "--context", min=1, help="Cached positions before the scored tokens."),
    batch: str = typer.Option("1", "--batch", metavar="B,B...", help="Requests per pass: more than batch 1 times B "
                              "sequences of t tokens each, the table `dspark plan --concurrency` reads."),
    device: options.device() = "auto",
    dtype: options.dtype() = "auto",
    reps: int = typer.Option(None, "--reps", min=1, help="Timed repetitions per length (default 50 on CUDA, 10 on "
                             "CPU)."),
    warmup: int = typer.Option(None, "--warmup", min=0, help="Untimed rounds first (default 5 on CUDA, 2 on CPU)."),
    json_out: options.json_path("the cost table (`dspark plan --costs`; the table then goes to stderr)") = None,
    force: options.force("Replace an existing --json file.") = False,
) -> None:
    """Time the target's verify pass over t tokens (and B requests) on this device: the cost table `dspark plan
    --costs` reads."""
    from dspark_cli.runtime.bench.verify import batch_verify_costs, verify_costs
    from dspark_cli.runtime.demo import demo_pair
    from dspark_cli.runtime.devices import resolve_dtype
    from dspark_cli.runtime.io.outputs import local_inputs

    batches = tuple(sorted(set(_ints(batch, "--batch"))))
    if target is None:
        if draft is not None:
            raise DsparkError("--draft needs its --target; give both, or neither for the demo pair.")
        target, draft = map(str, demo_pair())
    _check_exclusive([("--json file", json_out)], local_inputs("target", [target]) + local_inputs("draft", [draft]),
                     force)
    torch_device = options.torch_device(device)
    try:
        torch_dtype = resolve_dtype(dtype, torch_device)
    except ValueError as error:
        raise DsparkError(f"--dtype {error}.") from None
    cuda = torch_device.type == "cuda"
    reps, warmup = reps or (50 if cuda else 10), (5 if cuda else 2) if warmup is None else warmup
    with err_console.status("loading the target, then timing"):
        if batches == (1,):
            costs = verify_costs(target, draft, torch_device, torch_dtype, context, tokens, reps, warmup)
            timings = {(1, t): timing for t, timing in costs.timings.items()}
        else:
            costs = batch_verify_costs(target, draft, torch_device, torch_dtype, context, tokens, batches, reps,
                                       warmup)
            timings = costs.timings
    out = err_console if options.to_stdout(json_out) else console
    title = f"target score pass after {context} cached positions · {costs.device} {costs.dtype}"
    if batches != (1,):
        title += " · B requests of t tokens each (dspark's PyTorch forward, not an engine's)"
    table = Table(title=Text(title), title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("B", "tokens", "median ms", "min ms", "p10–p90 ms", "ms/token"):
        table.add_column(name, justify="right")
    previous = None
    for (b, t), timing in sorted(timings.items()):
        if previous is not None and b != previous:
            table.add_section()
        previous = b
        table.add_row(str(b), str(t), f"{timing.median_us / 1000:.3f}", f"{timing.min_us / 1000:.3f}",
                      f"{timing.p10_us / 1000:.3f}–{timing.p90_us / 1000:.3f}",
                      f"{timing.median_us / 1000 / (b * t):.3f}")
    out.print(table)
    if json_out is not None:
        emit_json(costs.to_dict(), json_out, force)


@bench_app.command("serve")
@handle_errors
def serve(
    url: str = typer.Argument(..., metavar="URL", help="The engine serving the target with its draft, e.g. "
                              "http://127.0.0.1:8000."),
    prompts: Path = typer.Option(None, "--prompts", metavar="FILE", help="Prompts: .jsonl (DeepSpec's `turns`, or "
                                 "`prompt`) or .txt (default: the demo's code and prose sets)."),
    concurrency: str = typer.Option("1,2,4", "--concurrency", metavar="C,C...", help="Requests in flight at a "
                                    "time, one measurement each."),
    baseline: str = typer.Option(None, "--baseline", metavar="URL", help="The same target without a draft: the "
                                 "speedup's denominator."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, max=1_000_000, help="Tokens generated per request "
                                   "(the end-of-text token is ignored)."),
    requests: int = typer.Option(None, "--requests", min=1, max=10_000, help="Send only the first N prompts (each "
                                 "once per concurrency and server)."),
    timeout: float = typer.Option(120.0, "--timeout", min=0.001, help="Seconds one request may take in all; a "
                                  "slower one is cut and counted as timed out."),
    engine: str = typer.Option("auto", "--engine", help="auto, llamacpp, vllm, sglang or openai: where acceptance "
                               "is read (auto: told from the server)."),
    model: str = typer.Option(None, "--model", help="The model name sent with each request (default: the server's "
                              "first /v1/models entry)."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Send one short untimed request to each server "
                                "first."),
    json_out: options.json_path("the measurements (the tables then go to stderr)") = None,
    plot: Path = typer.Option(None, "--plot", help="Write a PNG of tokens/s against concurrency to FILE."),
    force: options.force("Replace existing --json / --plot files.") = False,
) -> None:
    """Measure a running engine with and without its draft: throughput, TTFT, inter-token latency, tokens/s per
    request and the acceptance the engine reports, at each concurrency.

    Greedy (temperature 0) streamed /v1/completions. Exit code 2 when a URL is malformed, a server cannot be
    reached or fails the warm-up request, 1 when a request failed, timed out or produced no tokens (a server that
    does not stream, or streams another event schema; the message says why), 130 on Ctrl-C and 143 on SIGTERM
    (after printing what was measured).
    """
    from dspark_cli.cli.plan_load import parse_concurrency
    from dspark_cli.runtime.bench.serve import ServeConfig, has_chart, run_serve_bench, write_serve_chart
    from dspark_cli.runtime.measure.evaluation import SHIPPED_SETS, read_prompt_set

    if not math.isfinite(timeout):
        raise DsparkError(f"--timeout must be a finite number of seconds, got {timeout}.")
    if plot is not None and options.to_stdout(plot):
        raise DsparkError("--plot writes a PNG file; give a file name, not -.")
    inputs = [] if prompts is None else [("prompts file", prompts)]
    _check_exclusive([("--json file", json_out), ("--plot file", plot)], inputs, force)
    texts = [p for path in ([prompts] if prompts else SHIPPED_SETS) for p in read_prompt_set(path).prompts]
    config = ServeConfig(url=url, prompts=texts[:requests], concurrencies=tuple(parse_concurrency(concurrency)),
                         max_tokens=max_tokens, baseline=baseline, timeout_s=timeout, engine=engine, model=model,
                         warmup=warmup)
    out = err_console if options.to_stdout(json_out) else console
    total = len(config.prompts) * len(config.concurrencies) * (2 if baseline else 1)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as progress:
        task = progress.add_task("requests", total=total)
        report = run_serve_bench(config, on_request=lambda result: progress.advance(task))
    out.print(render.fitted(out, lambda padding: _serve_table(report, padding)))
    for note in _serve_notes(report):
        out.print(Text(f"• {name_flags(note)}", style="dim"), highlight=False)
    if json_out is not None:
        emit_json(report.to_dict(), json_out, force)
    if plot is not None and not has_chart(report):
        out.print(Text(f"• no plot written to {plot}: no level finished a request.", style="dim"), highlight=False)
    elif plot is not None:
        _write_exclusive(plot, force, lambda path: write_serve_chart(report, path))
    if report.interrupted:
        raise report.stop  # Ctrl-C or SIGTERM, so that its exit code is 130 or 143
    if report.failures:
        first = report.failed[0]
        raise DsparkError(f"{report.failures} request(s) failed or timed out (the table's req column); their "
                          "tokens are not in the figures. The first: "
                          f"{'timed out' if first.timed_out else first.error}.", EXIT_FINDINGS)


@bench_app.command("engine")
@handle_errors
def engine(
    plain: str = typer.Argument(..., metavar="PLAIN_URL", help="llama-server serving the target alone, e.g. "
                                "http://127.0.0.1:8080."),
    spec: list[str] = typer.Option(..., "--spec", metavar="N=URL", help="A llama-server serving the target with "
                                   "the draft, started with --spec-draft-n-max N; repeat for other N (two N price "
                                   "the draft length)."),
    draft_file: Path = typer.Option(..., "--draft-file", metavar="DRAFT.gguf", help="The draft GGUF the "
                                    "speculative servers load: its block size, fingerprint and source folder."),
    target_file: Path = typer.Option(None, "--target-file", metavar="TARGET.gguf", help="The target GGUF (default: "
                                     "the plain server's model_path, when that file is on this machine)."),
    concurrency: str = typer.Option("1,2,4", "--concurrency", metavar="C,C...", help="Requests in flight at a "
                                    "time."),
    context: str = typer.Option("64,512", "--context", metavar="T,T...", help="Context lengths in tokens (two or "
                                "more: the draft's and the target's attention grow with it)."),
    repeats: int = typer.Option(5, "--repeats", min=1, max=1000, help="Interleaved passes over every point."),
    generate: int = typer.Option(32, "--generate", min=4, max=4096, help="Tokens each timed request generates."),
    prompts: Path = typer.Option(None, "--prompts", metavar="FILE", help="Text the prompts are cut from: .jsonl "
                                 "or .txt (default: the demo's code and prose sets)."),
    timeout: float = typer.Option(300.0, "--timeout", min=0.001, help="Seconds one request may take."),
    engine_version: str = typer.Option(None, "--engine-version", help="The engine's version in the profile's label "
                                       "(default: the server's build_info; a build from a source archive reports "
                                       "b0-unknown)."),
    json_out: options.json_path("the profile (`dspark plan --costs`; the table then goes to stderr)") = None,
    force: options.force("Replace an existing --json file.") = False,
) -> None:
    """Profile a running llama.cpp engine in place: its plain decode step at R requests, its verify pass over M
    tokens and its speculative step (the draft's cost per round as a function of R), at each context, in repeated
    interleaved samples: the cost profile `dspark plan --costs` turns into a verdict. Read from llama-server's own
    per-request timings; labelled with its build, this machine and the model files' fingerprints."""
    from dspark_cli.cli.plan_load import parse_concurrency
    from dspark_cli.runtime.bench.engine import ProfileConfig, profile_engine
    from dspark_cli.runtime.measure.engine_profile import read_engine_profile
    from dspark_cli.runtime.measure.evaluation import SHIPPED_SETS, read_prompt_set

    if not math.isfinite(timeout):
        raise DsparkError(f"--timeout must be a finite number of seconds, got {timeout}.")
    inputs = [("draft file", draft_file)] + ([] if target_file is None else [("target file", target_file)])
    inputs += [] if prompts is None else [("prompts file", prompts)]
    _check_exclusive([("--json file", json_out)], inputs, force)
    text = "\n\n".join(p for path in ([prompts] if prompts else SHIPPED_SETS) for p in read_prompt_set(path).prompts)
    config = ProfileConfig(plain=plain, spec=[_spec_server(s) for s in spec],
                           concurrencies=tuple(parse_concurrency(concurrency)),
                           contexts=tuple(_ints(context, "--context")), text=text, draft_file=str(draft_file),
                           target_file=None if target_file is None else str(target_file), repeats=repeats,
                           generate=generate, timeout_s=timeout, engine_version=engine_version)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as progress:
        task = progress.add_task("samples (the first pass is a warm-up)", total=None)
        document = profile_engine(config, on_sample=lambda job, repeat, ms: progress.advance(task))
    profile = read_engine_profile(Path("<profile>"), document)
    out = err_console if options.to_stdout(json_out) else console
    out.print(render.fitted(out, lambda padding: _engine_table(profile, padding)))
    for note in _engine_notes(profile):
        out.print(Text(f"• {name_flags(note)}", style="dim"), highlight=False)
    if json_out is not None:
        emit_json(document, json_out, force)


def _spec_server(text: str) -> tuple[int, str]:
    n, sep, url = text.partition("=")
    if not sep or not n.strip().isdigit() or int(n) < 1 or not url.strip():
        raise DsparkError(f"--spec takes N=URL (the server drafts N tokens a round), like 7=http://127.0.0.1:8081; "
                          f"not {text!r}.")
    return int(n), url.strip()


def _engine_table(profile, padding: tuple[int, int]) -> Table:
    table = Table(title=Text(f"bench engine · {profile.engine} {profile.engine_version} · median ms (min–max of "
                             f"{profile.repeats})"), title_justify="left", box=box.SIMPLE_HEAD, padding=padding)
    render.columns(table, ("context", "R", "plain step", "verify n+1", "spec step", "draft + bookkeeping",
                           "n", "accept"))
    for c in profile.contexts:
        for r in profile.concurrencies:
            for n in profile.draft_ns:
                plain, spec = profile.plain_ms(r, c), profile.spec[n, r, c]
                verify = profile.verify_ms(r, n + 1, c)
                draft = [profile.draft_ms(r, n, c, i) for i in range(profile.repeats)]
                accept = profile.acceptance[n, r, c]
                table.add_row(str(c), str(r), _spread(plain), f"{verify:.2f}", _spread(spec), _spread(draft), str(n),
                              "" if accept is None else f"{accept:.3f}")
        table.add_section()
    return table


def _spread(values) -> str:
    import statistics

    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def _engine_notes(profile) -> list[str]:
    return ["plain step: one decode step of R requests; verify n+1: the target's pass over n + 1 tokens of each of R "
            "requests (the model of docs/bench.md, from the medians); spec step: one speculative step of R requests "
            "drafting n; draft + bookkeeping: spec step - verify, the draft's time per step at R requests.",
            f"engine {profile.engine} {profile.engine_version}; hardware {profile.hardware}; target "
            f"{profile.target.path} ({profile.target.fingerprint}), draft {profile.draft.path} "
            f"({profile.draft.fingerprint})."]


def _check_exclusive(outputs: list[tuple[str, Path | None]], inputs: list, force: bool) -> None:
    """The output check, an existing file refused unless --force: before any request is sent."""
    from dspark_cli.runtime.io.outputs import check_output_files

    check_output_files(outputs, inputs, force)


def _write_exclusive(path: Path | None, force: bool, write) -> None:
    """Written through a temporary file beside `path`, published without replacing one that appeared meanwhile
    (unless --force); `-` is stdout."""
    from dspark_cli.runtime.io.outputs import write_output_file

    write_output_file(path, write, force)


def _serve_table(report, padding: tuple[int, int]) -> Table:
    table = Table(title=Text(f"bench serve · {report.servers['speculative'].endpoint.url} "
                             f"({report.servers['speculative'].engine}) · max tokens {report.config.max_tokens}"),
                  title_justify="left", box=box.SIMPLE_HEAD, padding=padding)
    render.columns(table, ("C", "server", "req ok", "tok/s", "speedup", "tok/s per req", "TTFT ms", "ITL ms",
                           "accept"))
    previous = None
    for level in report.levels:
        if previous is not None and level.concurrency != previous:
            table.add_section()
        previous = level.concurrency
        s = level.summary()
        speedup = report.speedup(level.concurrency) if level.server == "speculative" else None
        table.add_row(str(level.concurrency), "spec" if level.server == "speculative" else "base",
                      f"{s['ok']}/{s['requests']}" + ("" if level.complete else "*"), _num(s["tokens_per_s"]),
                      _ratio(speedup), _num(s["per_request_tokens_per_s"]), _ms(s["ttft_s"]["median"]),
                      _ms(s["itl_s"]["median"]), "" if level.acceptance is None else f"{level.acceptance:.3f}")
    return table


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else _num(seconds * 1000)


def _serve_notes(report) -> list[str]:
    notes = ["tok/s: generated tokens of the level over its wall time; TTFT, ITL: medians; accept: accepted / "
             "drafted tokens as the engine reports them" + {
                 "llamacpp": " (llama.cpp: each response's timings.draft_n_accepted / draft_n)",
                 "vllm": " (vLLM: its spec_decode counters, /metrics before and after the level)",
                 "sglang": " (SGLang: its spec_accept_rate gauge, the latest logging interval)",
             }.get(report.servers["speculative"].engine, "")]
    if report.servers["speculative"].engine == "openai":
        notes.append("the engine was not recognised (no llama.cpp header, no vllm: or sglang: metrics), so no "
                     "acceptance is read; pass the engine option if it is one of them.")
    if report.interrupted:
        notes.append("interrupted: * marks a level cut short; the figures hold the requests that finished.")
    return notes
