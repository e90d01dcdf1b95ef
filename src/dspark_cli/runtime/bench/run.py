"""The sequential Markov stage, measured method by method (`dspark bench markov`, docs/bench.md).

One draft step walks the N positions of a block for B requests (docs/format.md §3.1-3.2):

    e_i = W1[prev_i];  logits_i = base_i + alpha * W2 @ e_i;  d_i = pick(logits_i);  prev_i+1 = d_i + d2t[d_i]

Each method is a strategy of the runtime's walk (runtime.markov.markov_walk), timed exactly as `dspark generate`
runs it, batch-first, fed the same inputs:
  dense  per position: [B, r] x [r, Vd] + add + argmax / Gumbel-max over [B, Vd] fp32     (vLLM's default path)
  topk   per draft step: the top-k selection and a [B, N, Vd] fp32 buffer of -inf; per position: gather k W2 rows
         + bmm + scatter into the -inf row + argmax / Gumbel-max over it                 (`dspark_draft_topk`)
  nvfp4  as topk with the NVFP4 W2 (the `nvfp4_gathered_bias` kernel on CUDA, its torch twin elsewhere)
  fused  the top-k selection, then the whole walk in one kernel (`kernels.markov.markov_walk`)
The top-k selection that topk, nvfp4 and fused run first (once per draft step) is also timed alone
("select").

Inputs make the four agree: the base logits are -inf outside k candidates per position (the top-k of
random logits), so the dense path ranks the same tokens as the gathered ones. Before anything is
timed, every method's tokens are checked against the float32 reference walk; a token may differ from
the reference only where its score is within the rounding of the method's dtype of the best score
(bf16 weights round scores; see `check_tokens`).

This module runs the benchmark (`run_bench`: check, then time, every configuration); its parts live beside it:
inputs.py (configuration, heads, inputs, memory check), walks.py (the methods, the reference walk,
the token check), timer.py (the interleaved timer) and report.py (rows, bandwidth bounds, chart).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from dspark_cli.runtime.bench.inputs import BenchConfig, Head, WalkInputs, checkpoint_heads, make_inputs, random_heads
from dspark_cli.runtime.bench.report import METHODS, BenchReport, Row, resolve_peak, weight_bytes, write_latency_chart
from dspark_cli.runtime.bench.timer import (
    SPREAD_LIMIT,
    Timing,
    capture_graph,
    interleaved_order,
    measure_launch_us,
    time_interleaved,
)
from dspark_cli.runtime.bench.walks import check_tokens, merge_checks, method_walk, reference_walk
from dspark_cli.runtime.decode.markov import select_candidates

# The bench's library, importable from here: run_bench and the pieces its callers and tests use.
__all__ = [
    "SPREAD_LIMIT", "BenchConfig", "BenchReport", "Timing", "WalkInputs", "capture_graph", "check_tokens",
    "checkpoint_heads", "interleaved_order", "make_inputs", "method_walk", "random_heads", "reference_walk",
    "run_bench", "time_interleaved", "weight_bytes", "write_latency_chart",
]

# Triton-interpreter work allowed per kernel check: programs x positions (~5-15 ms each on a CPU core).
INTERPRETER_BUDGET = 64


@dataclass
class _Variant:
    method: str
    mode: str
    engine: str
    run: Callable[[], torch.Tensor]
    inputs: WalkInputs  # what it was fed (a subset of the requests for interpreter checks)
    timed: bool = True


def run_bench(
    config: BenchConfig, heads: dict[str, Head], progress: Callable[[str], None] | None = None
) -> BenchReport:
    """Check, then time, every method for every (format, temperature, batch, top-k)."""
    first = heads[config.formats[0]]
    with torch.inference_mode():
        peak, peak_source, device_name = resolve_peak(config.device, config.peak_gbps)
        report = BenchReport(
            device=config.device, device_name=device_name, peak_gbps=peak, peak_source=peak_source,
            launch_us=measure_launch_us(config.device), source=first.note, vocab=first.vocab,
            draft_vocab=first.draft_vocab, rank=first.rank, block=config.block, alpha=first.weights.scale,
            has_d2t=first.weights.d2t is not None, reps=config.reps, warmup=config.warmup,
            head_type=first.head_type, hidden_size=first.hidden_size,
        )
        report.notes += _notes(config, heads)
        for temperature in config.temperatures:
            for batch in config.batches:
                pending: list[tuple[Row, Callable[[], torch.Tensor]]] = []  # every format's rows of this (T, B)
                for fmt in config.formats:
                    if progress:
                        progress(f"{fmt}, T={temperature:g}, B={batch}")
                    rows, timed = _bench_batch(config, heads[fmt], temperature, batch, report)
                    report.rows += rows
                    pending += timed
                if progress:
                    progress(f"timing T={temperature:g}, B={batch}: {len(pending)} rows interleaved")
                timings = time_interleaved([run for _, run in pending], config.device, config.reps, config.warmup)
                for (row, _), timing in zip(pending, timings):
                    row.timing = timing
    report.rows.sort(key=lambda row: config.formats.index(row.fmt))  # stable: the order within a format is kept
    _add_speedups(report.rows)
    return report


def _notes(config: BenchConfig, heads: dict[str, Head]) -> list[str]:
    notes = [f"{head.fmt}: {head.note}" for head in heads.values()]
    head_type = next(iter(heads.values())).head_type
    if head_type != "vanilla":
        notes.append(f"{head_type} head: each position's latent u_k comes from the head's step over W1[prev] and "
                     "random hidden states (in the run's dtype); the fused walk runs vanilla heads only, so it has "
                     "no rows, and the reference is the gathered walk with the float32 torch bias.")
    if config.device == "cpu":
        if _interpreter_active():
            notes.append("CPU: the Triton kernels (nvfp4_gathered_bias, markov_walk_triton) run only under the "
                         "Triton interpreter: their tokens are checked (rows 'kernel*'), never timed; the timed "
                         "nvfp4 and fused rows are their torch twins ('twin').")
        else:
            notes.append("CPU: the Triton kernels are not checked here (no interpreter in this process); "
                         "the NVFP4 and fused rows are their torch twins.")
    else:
        notes.append("CUDA: speedups compare like with like (graph rows with graph rows, eager with eager).")
    notes.append(f"Every row of one (T, B) is timed interleaved with the others, both formats included (one call "
                 f"each per round, the order rotated every round); rows whose (p90 - min) / min exceeds "
                 f"{SPREAD_LIMIT:.0%} are marked '!': load made them too noisy to compare.")
    notes.append("Every row runs the code `dspark generate` runs; rows 2-4 include the top-k selection they share "
                 "(once per draft step), also timed alone as its own row. Bytes count reads of Markov weights only "
                 "(not logit rows or noise).")
    return notes


def _interpreter_active() -> bool:
    """True when the Triton kernels run under the interpreter in this process (dspark_cli.kernels decides)."""
    import importlib.util

    import dspark_cli.kernels  # noqa: F401  (chooses the interpreter when there is no CUDA)

    return os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def _bench_batch(
    config: BenchConfig, head: Head, temperature: float, batch: int, report: BenchReport
) -> tuple[list[Row], list[tuple[Row, Callable[[], torch.Tensor]]]]:
    """Rows of one (format, temperature, batch): dense once (checked on every k's inputs, timed on the first),
    then per k the shared selection and methods 2-4; and the (row, call) pairs to time, the checked ones only."""
    seed = (config.seed * 1_000_003 + batch * 1009 + round(temperature * 97)) % 2**64  # manual_seed takes 64 bits
    gen = torch.Generator(config.device).manual_seed(seed)
    dense_rows: dict[str, Row] = {}  # by mode
    dense_runs: list[_Variant] = []  # dense on the first k's inputs, timed once every k is checked
    rows: list[Row] = []
    timed: list[tuple[Row, Callable[[], torch.Tensor]]] = []
    for index, k in enumerate(config.topks):
        x = make_inputs(head, batch, config.block, k, temperature, gen)
        reference = reference_walk(head.weights, x)  # [B, N]
        variants = _variants(config, head, x, dense_graph=index == 0)
        checks = [check_tokens(head.weights, v.inputs, v.run(), reference[: v.inputs.batch]) for v in variants]
        selection = _selection_rows(config, head.fmt, x, temperature, batch)
        rows += [row for row, _ in selection]
        timed += selection
        for variant, check in zip(variants, checks):
            if variant.method == "dense":
                row = dense_rows.setdefault(variant.mode, Row(head.fmt, temperature, batch, None, "dense", variant.mode,
                                                              variant.engine, config.block, requests_checked=batch))
                row.check = check if row.check is None else merge_checks(row.check, check)
                if index == 0:
                    dense_runs.append(variant)
                continue
            row = Row(head.fmt, temperature, batch, k, variant.method, variant.mode, variant.engine, config.block,
                      check=check, requests_checked=variant.inputs.batch)
            if variant.timed and check.ok:
                timed.append((row, variant.run))
                _cost_row(row, head, report)
            rows.append(row)
    for variant in dense_runs:
        row = dense_rows[variant.mode]
        if row.check.ok:
            timed.append((row, variant.run))
            _cost_row(row, head, report)
    return list(dense_rows.values()) + rows, timed


def _variants(config: BenchConfig, head: Head, x: WalkInputs, dense_graph: bool) -> list[_Variant]:
    """Every way of walking x: eager (and CUDA-graph replays on CUDA), plus on CPU the Triton kernels under the
    interpreter on the first few requests (checked, not timed)."""
    w = head.weights
    cuda = config.device == "cuda"
    kernel = "Triton" if cuda else "torch twin"
    methods = [("dense", "torch"), ("topk", "torch")] + ([("nvfp4", kernel)] if head.fmt == "nvfp4" else [])
    fused = w.head is None  # the fused walk runs vanilla heads only
    variants = []
    for method, engine in methods + ([("fused", kernel)] if fused else []):
        run = functools.partial(method_walk, method, w, x)
        variants.append(_Variant(method, "eager", engine, run, x))
        if cuda and (method != "dense" or dense_graph):
            variants.append(_Variant(method, "graph", engine, capture_graph(run), x))
    if not cuda and _interpreter_active():
        sub = x.requests(_interpreter_requests(x))
        for method in (("nvfp4",) if head.fmt == "nvfp4" else ()) + (("fused",) if fused else ()):
            run = functools.partial(method_walk, method, w, sub, triton=True)
            variants.append(_Variant(method, "interpreter", "Triton", run, sub, timed=False))
    return variants


def _interpreter_requests(x: WalkInputs) -> int:
    """How many requests the interpreter checks: about INTERPRETER_BUDGET program-positions."""
    per_request = x.block * math.ceil(x.topk / 32)
    return max(1, min(x.batch, INTERPRETER_BUDGET // per_request))


def _selection_rows(
    config: BenchConfig, fmt: str, x: WalkInputs, temperature: float, batch: int
) -> list[tuple[Row, Callable[[], torch.Tensor]]]:
    """The shared top-k selection rows (eager, and graph on CUDA), with the calls that time them."""

    def select() -> torch.Tensor:
        return select_candidates(x.base, x.topk).ids

    runs = [("eager", select)] + ([("graph", capture_graph(select))] if config.device == "cuda" else [])
    return [(Row(fmt, temperature, batch, x.topk, "select", mode, "torch", x.block), run) for mode, run in runs]


def _cost_row(row: Row, head: Head, report: BenchReport) -> None:
    """The weight bytes a row reads and the bandwidth lower bound of its time."""
    row.weight_bytes = weight_bytes(row.method, head, row.batch, row.block, row.topk or 0)
    row.lower_bound_us = row.weight_bytes / (report.peak_gbps * 1e3) + report.launch_us


def _add_speedups(rows: list[Row]) -> None:
    """Speedup of each timed method over dense and over top-k bf16 at the same configuration and mode: the ratio of
    the min times, which interleaving keeps comparable (medians of rows doing the same work still differed up to
    2.7x under load on a shared CPU, their mins within 3 %)."""
    timed = {(r.fmt, r.temperature, r.batch, r.topk, r.method, r.mode): r for r in rows if r.timing is not None}
    for row in timed.values():
        if row.method not in METHODS:  # the shared selection
            continue
        dense = timed.get((row.fmt, row.temperature, row.batch, None, "dense", row.mode))
        topk = timed.get((row.fmt, row.temperature, row.batch, row.topk, "topk", row.mode))
        if dense is not None:
            row.speedup_vs_dense = dense.timing.min_us / row.timing.min_us
        if topk is not None:
            row.speedup_vs_topk = topk.timing.min_us / row.timing.min_us
