"""The results of `dspark bench markov` (runtime/bench/run.py): one row per method and configuration, the report, the
bandwidth bound of a row (the Markov weight bytes it reads over the device's peak bandwidth), and the latency chart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from dspark_cli.runtime.bench.inputs import Head
from dspark_cli.runtime.bench.timer import Timing, time_call
from dspark_cli.runtime.bench.walks import TokenCheck

METHODS = ("dense", "topk", "nvfp4", "fused")
METHOD_TITLES = {
    "dense": "1 dense",
    "topk": "2 top-k bf16",
    "nvfp4": "3 top-k nvfp4",
    "fused": "4 fused walk",
    "select": "top-k select",
}
# Bandwidth of the device's memory in GB/s from its spec sheet, by device name (first match wins).
PEAK_GBPS = (
    (r"\bH200\b", 4800.0),
    (r"\bH100\b.*\bNVL\b", 3900.0),
    (r"\bH100\b.*\bPCIe\b", 2000.0),
    (r"\bH100\b", 3350.0),
    (r"\bB200\b", 8000.0),
    (r"\bA100\b.*\bPCIe\b.*80GB|\bA100\b.*80GB.*\bPCIe\b", 1935.0),
    (r"\bA100\b.*80GB", 2039.0),
    (r"\bA100\b", 1555.0),
    (r"\bL40S\b", 864.0),
    (r"\bL4\b", 300.0),
    (r"\bA10G\b", 600.0),
    (r"\bRTX 4090\b", 1008.0),
)


@dataclass
class Row:
    """One method (or the shared top-k selection) at one configuration."""

    fmt: str
    temperature: float
    batch: int
    topk: int | None  # None for dense, which does not depend on k (its check covers every k)
    method: str  # one of METHODS, or "select"
    mode: str  # "eager", "graph" (CUDA graph replay) or "interpreter" (Triton kernel checked on CPU, not timed)
    engine: str  # what ran: "torch", "torch twin", "Triton"
    block: int
    check: TokenCheck | None = None  # None for "select"
    requests_checked: int = 0
    timing: Timing | None = None
    weight_bytes: int | None = None
    lower_bound_us: float | None = None
    speedup_vs_dense: float | None = None
    speedup_vs_topk: float | None = None

    @property
    def title(self) -> str:
        return METHOD_TITLES[self.method]

    @property
    def us_per_position(self) -> float | None:
        return None if self.timing is None else self.timing.median_us / self.block

    @property
    def achieved_gbps(self) -> float | None:
        if self.timing is None or not self.weight_bytes:
            return None
        return self.weight_bytes / (self.timing.median_us * 1e3)

    def to_dict(self) -> dict:
        return {
            "format": self.fmt, "temperature": self.temperature, "batch": self.batch, "topk": self.topk,
            "method": self.method, "title": self.title, "mode": self.mode, "engine": self.engine,
            "tokens": None if self.check is None else self.check.to_dict(), "requests_checked": self.requests_checked,
            "timing": None if self.timing is None else self.timing.to_dict(),
            "us_per_step": None if self.timing is None else self.timing.median_us,
            "us_per_position": self.us_per_position, "weight_bytes": self.weight_bytes,
            "achieved_gbps": self.achieved_gbps, "lower_bound_us": self.lower_bound_us,
            "speedup_vs_dense": self.speedup_vs_dense, "speedup_vs_topk": self.speedup_vs_topk,
        }


@dataclass
class BenchReport:
    device: str  # "cuda" or "cpu"
    device_name: str
    peak_gbps: float
    peak_source: str
    launch_us: float  # one tiny kernel launch, measured in the run
    source: str  # "random weights" or the checkpoint
    vocab: int
    draft_vocab: int
    rank: int
    block: int
    alpha: float
    has_d2t: bool
    reps: int
    warmup: int
    head_type: str = "vanilla"
    hidden_size: int | None = None  # what a gated / RNN head reads
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every checked method emitted the reference tokens (up to rounding near-ties)."""
        return all(row.check is None or row.check.ok for row in self.rows)

    def to_dict(self) -> dict:
        return {
            "device": self.device, "device_name": self.device_name, "peak_gbps": self.peak_gbps,
            "peak_source": self.peak_source, "launch_us": self.launch_us, "source": self.source,
            "vocab": self.vocab, "draft_vocab": self.draft_vocab, "rank": self.rank, "block": self.block,
            "alpha": self.alpha, "d2t": self.has_d2t, "reps": self.reps, "warmup": self.warmup,
            "head_type": self.head_type, "hidden_size": self.hidden_size,
            "tokens_ok": self.ok, "notes": self.notes, "rows": [row.to_dict() for row in self.rows],
        }


# --- bandwidth bounds ---------------------------------------------------------------------------------------


def measure_copy_gbps(device: str) -> float:
    """Memory bandwidth of a large copy in GB/s, counting bytes read + bytes written (STREAM's convention)."""
    n_bytes = (256 if device == "cuda" else 64) * 2**20
    src = torch.ones(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timing = time_call(lambda: dst.copy_(src), device, reps=10, warmup=2)
    return 2 * n_bytes / (timing.median_us * 1e3)


def resolve_peak(device: str, requested: float | None) -> tuple[float, str, str]:
    """-> (peak GB/s, where it comes from, device name)."""
    name = torch.cuda.get_device_name() if device == "cuda" else _cpu_name()
    if requested is not None:
        return requested, "the peak-gbps option", name
    if device == "cuda":
        for pattern, gbps in PEAK_GBPS:
            if re.search(pattern, name, flags=re.IGNORECASE):
                return gbps, f"spec sheet of {name}", name
    return measure_copy_gbps(device), "copy bandwidth measured in this run", name


def _cpu_name() -> str:
    from dspark_cli.runtime.bench.engine import cpu_model

    threads = torch.get_num_threads()
    return f"CPU {cpu_model()}, {threads} thread{'s' if threads != 1 else ''}"


def weight_bytes(method: str, head: Head, batch: int, block: int, topk: int) -> int:
    """Bytes one draft step reads from the Markov weights: W1 rows of the previous tokens, and all of W2
    (dense, bf16) or the k gathered W2 rows per request and position (bf16, or NVFP4 nibbles + e4m3 scales); a
    gated / RNN head's projections once per position as well."""
    r = head.rank
    w1 = block * batch * r * head.weights.w1.element_size() + block * _projection_bytes(head)
    if method == "dense":
        return w1 + block * head.draft_vocab * r * head.weights.w2.element_size()
    if method == "nvfp4" or (method == "fused" and head.fmt == "nvfp4"):
        return w1 + block * batch * topk * (r // 2 + r // 16)
    return w1 + block * batch * topk * r * head.weights.w2.element_size()


def _projection_bytes(head: Head) -> int:
    """The bytes of a gated / RNN head's projections (its 1-row markov_w1 / markov_w2 stand-ins left out)."""
    if head.weights.head is None:
        return 0
    return sum(p.numel() * p.element_size() for name, p in head.weights.head.named_parameters()
               if not name.startswith("markov_"))


# --- the chart ----------------------------------------------------------------------------------------------


def write_latency_chart(report: BenchReport, path) -> None:
    """PNG of µs per draft step against batch size: one panel per (format, temperature), one line per method
    and k (CUDA-graph replays on CUDA, eager calls on CPU; the shared top-k selection is left out)."""
    from dspark_cli.runtime.bench.lineplot import Panel, Series, write_line_chart

    mode = "graph" if report.device == "cuda" else "eager"
    panels: dict[tuple[str, float], dict[str, list[tuple[float, float]]]] = {}
    for row in report.rows:
        if row.timing is None or row.mode != mode or row.method == "select":
            continue
        label = row.title + (" twin" if row.engine == "torch twin" else "")
        label += ("" if row.topk is None else f" k={row.topk}") + (" graph" if mode == "graph" else "")
        series = panels.setdefault((row.fmt, row.temperature), {})
        series.setdefault(label, []).append((row.batch, row.timing.median_us))
    chart = [
        Panel(f"{fmt} Markov head  T={temperature:g}  V={report.vocab} r={report.rank} N={report.block}  "
              f"{report.device}",
              [Series(label, points) for label, points in series.items()])
        for (fmt, temperature), series in panels.items()
    ]
    write_line_chart(path, chart, x_label="batch size", y_label="us per draft step (median)")
