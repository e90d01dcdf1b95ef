"""Step-cost tables of the engines' verify schedulers, read as input (`dspark plan --concurrency --costs TABLE`).

    cost = read_cost_table(path)          # any of the four shapes below, told apart by their keys
    cost.seconds(requests, tokens)        # one verify step of `requests` requests scoring `tokens` tokens in all

- SGLang's 1-D table (`SpsCostTable` in python/sglang/srt/speculative/dspark_components/dspark_sps.py, verified):
  `sample_batch_tokens` (strictly increasing), `sample_steps_per_sec`, `max_batch_tokens`; steps/s at x tokens is
  the value of the largest probe <= x (the first probe below it); a step takes 1 / that.
- SGLang's additive table (`SpsAdditiveCostTable`, same file, verified; SGLang picks it when the text holds
  "bias_seconds"): `bias_seconds` + interp(`bs_probes`, `alpha_seconds`, requests) + interp(`m_probes`,
  `theta_seconds`, tokens), linear between probes and clamped at both ends.
- TensorRT-LLM's table (its open PRs' `compute_verify_token_budget`; the field names and the additive form come from
  this project's brief, not a source read here): `fixed_overhead_ms` + interp(`batch_sizes`, `batch_overhead_ms`,
  requests) + interp(`token_counts`, `step_time_ms`, tokens), and `minimum_predicted_gain` (default 0.01, the
  default of a TensorRT-LLM fork's `plan_dynamic_verifier_budget`).
- dspark's own `bench verify --json` table (`tokens`, `ms`): a target pass over t tokens at batch 1 only;
  `sps_table_of` turns it into SGLang's 1-D table at batch 1, exactly (the same times at the same probes).
- dspark's batch sweep (`bench verify --batch 1,4,16 --json`, format dspark-verify-costs/2: `batches`, `tokens`,
  `ms` one row per batch): B requests scoring t tokens each. A step of R requests scoring M tokens in all costs the
  row interpolation at t = M / R (linear between probes, clamped), then linear between the batch rows around R
  (clamped): R requests of equal length. dspark's PyTorch measurement, not an engine's table (its `kind` says so;
  a table of this shape derived from an engine's own timings says so in `measured_by`, which its `kind` names).
  Its batch-1 row is also what plain `dspark plan --costs` reads.

Every table is checked as input: bounded, finite, probes strictly increasing integers >= 1, values > 0 (overheads
>= 0); a problem is one sentence naming the file and the key. Torch-free.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.io.reading import read_json_file

MAX_TABLE_BYTES = 1024 * 1024
MAX_PROBES = 65536
DEFAULT_MINIMUM_GAIN = 0.01


def _floor_value(probes: Sequence[int], values: Sequence[float], x: float) -> float:
    return values[max(0, bisect.bisect_right(probes, x) - 1)]


def _interp_clamped(probes: Sequence[int], values: Sequence[float], x: float) -> float:
    if x <= probes[0]:
        return values[0]
    if x >= probes[-1]:
        return values[-1]
    hi = bisect.bisect_right(probes, x)
    frac = (x - probes[hi - 1]) / (probes[hi] - probes[hi - 1])
    return values[hi - 1] + frac * (values[hi] - values[hi - 1])


@dataclass(frozen=True)
class SpsTable:
    """SGLang's 1-D table: steps per second by tokens in the step (floor lookup)."""

    tokens: tuple[int, ...]
    steps_per_s: tuple[float, ...]
    max_batch_tokens: int
    batch_one: bool = False  # converted from dspark's batch-1 table: only one request per step is measured
    kind: str = "SGLang 1-D SPS table"

    def seconds(self, requests: int, tokens: int) -> float:
        return 1.0 / _floor_value(self.tokens, self.steps_per_s, tokens)

    @property
    def largest_probe(self) -> int:
        return self.tokens[-1]


@dataclass(frozen=True)
class AdditiveTable:
    """SGLang's additive table: bias + alpha(requests) + theta(tokens) seconds."""

    bias_s: float
    bs_probes: tuple[int, ...]
    alpha_s: tuple[float, ...]
    m_probes: tuple[int, ...]
    theta_s: tuple[float, ...]
    batch_one: bool = False
    kind: str = "SGLang additive table"

    def seconds(self, requests: int, tokens: int) -> float:
        return (self.bias_s + _interp_clamped(self.bs_probes, self.alpha_s, requests)
                + _interp_clamped(self.m_probes, self.theta_s, tokens))

    @property
    def largest_probe(self) -> int:
        return self.m_probes[-1]


@dataclass(frozen=True)
class TrtTable:
    """TensorRT-LLM's table: fixed + batch(requests) + step(tokens) milliseconds, and its fallback margin."""

    fixed_ms: float
    batch_sizes: tuple[int, ...]
    batch_ms: tuple[float, ...]
    token_counts: tuple[int, ...]
    step_ms: tuple[float, ...]
    minimum_predicted_gain: float = DEFAULT_MINIMUM_GAIN
    batch_one: bool = False
    kind: str = "TensorRT-LLM cost table"

    def seconds(self, requests: int, tokens: int) -> float:
        return (self.fixed_ms + _interp_clamped(self.batch_sizes, self.batch_ms, requests)
                + _interp_clamped(self.token_counts, self.step_ms, tokens)) / 1000.0

    @property
    def largest_probe(self) -> int:
        return self.token_counts[-1]


@dataclass(frozen=True)
class GridTable:
    """dspark's batch sweep: milliseconds of B requests x t tokens each, read as R requests of equal length."""

    batches: tuple[int, ...]
    tokens: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]  # [batch][tokens]
    kind: str = "dspark bench verify batch table (dspark's PyTorch forward, not the engine's)"

    @property
    def batch_one(self) -> bool:
        return self.batches == (1,)

    def seconds(self, requests: int, tokens: int) -> float:
        per_request = tokens / max(requests, 1)
        rows = [_interp_clamped(self.tokens, row, per_request) for row in self.ms]
        return _interp_clamped(self.batches, rows, requests) / 1000.0

    @property
    def largest_probe(self) -> int:
        return self.batches[-1] * self.tokens[-1]


CostTable = SpsTable | AdditiveTable | TrtTable | GridTable


def sps_table_of(ms_by_tokens: dict[int, float]) -> SpsTable:
    """dspark's batch-1 table (`bench verify`: t -> ms) as SGLang's 1-D table at batch 1 (exact at its probes)."""
    tokens = tuple(sorted(ms_by_tokens))
    return SpsTable(tokens, tuple(1000.0 / ms_by_tokens[t] for t in tokens), tokens[-1], batch_one=True,
                    kind="dspark bench verify table (batch 1)")


def read_cost_table(path: Path) -> CostTable:
    """Any of the four tables (module docstring) from `path`; DsparkError in one sentence naming file and key."""
    doc = read_json_file(path, "cost table", MAX_TABLE_BYTES, "give an SGLang SPS table, a TensorRT-LLM cost "
                         "table or the JSON of `dspark bench verify`")
    if not isinstance(doc, dict):
        raise DsparkError(f"{path} is not a cost table: its JSON is not an object; give an SGLang SPS table, a "
                          "TensorRT-LLM cost table or the JSON of `dspark bench verify`.")
    if "bias_seconds" in doc:
        return _additive(doc, path)
    if "sample_batch_tokens" in doc:
        return _sps(doc, path)
    if "token_counts" in doc:
        return _trt(doc, path)
    if "batches" in doc:
        return _grid(doc, path)
    if "tokens" in doc:
        return sps_table_of(batch_one_ms(doc, path))
    raise DsparkError(f"{path} is not a cost table: it has none of the keys 'sample_batch_tokens', 'bias_seconds' "
                      "(SGLang), 'token_counts' (TensorRT-LLM) or 'tokens' (`dspark bench verify`).")


def batch_one_ms(doc, path: Path) -> dict[int, float]:
    """dspark's `bench verify` table: tokens -> ms, distinct tokens >= 1 and times above 0 (a batch sweep: its batch-1
    row)."""
    if isinstance(doc, dict) and "batches" in doc:
        grid = _grid(doc, path)
        if grid.batches[0] != 1:
            raise DsparkError(f"{path} holds no batch-1 row ('batches' starts at {grid.batches[0]}); measure one with "
                              "`dspark bench verify` and a batch option that includes 1.")
        return dict(zip(grid.tokens, grid.ms[0]))
    tokens = doc.get("tokens") if isinstance(doc, dict) else None
    ms = doc.get("ms") if isinstance(doc, dict) else None
    good = (isinstance(tokens, list) and isinstance(ms, list) and 0 < len(tokens) <= MAX_PROBES
            and len(tokens) == len(ms) and all(_is_int(t) and t >= 1 for t in tokens)
            and len(set(tokens)) == len(tokens) and all(_is_number(m) and m > 0 for m in ms))
    if not good:
        raise DsparkError(f"{path} needs 'tokens' (distinct integers >= 1) and 'ms' (one time above 0 per entry) "
                          "lists of the same length, as `dspark bench verify` writes with the json option.")
    return dict(zip(tokens, (float(m) for m in ms)))


def _grid(doc: dict, path: Path) -> GridTable:
    batches = _probes(doc, "batches", path)
    tokens = _probes(doc, "tokens", path)
    ms = doc.get("ms")
    good = (isinstance(ms, list) and len(ms) == len(batches)
            and all(isinstance(row, list) and len(row) == len(tokens) and all(_is_number(v) and v > 0 for v in row)
                    for row in ms))
    if not good or len(batches) * len(tokens) > MAX_PROBES:
        raise DsparkError(f"{path}: 'ms' must hold one row per batch size ({len(batches)}), each with one time above "
                          f"0 per token count ({len(tokens)}), as `dspark bench verify` writes with the batch option.")
    return GridTable(batches, tokens, tuple(tuple(float(v) for v in row) for row in ms), _grid_kind(doc))


def _grid_kind(doc: dict) -> str:
    """What plan prints for a batch table: dspark's own PyTorch measurement, or what its `measured_by` names first
    (a table derived from an engine's timings, written in this format)."""
    source = doc.get("measured_by")
    if not isinstance(source, str) or source.startswith("dspark bench verify"):
        return GridTable.kind
    return "batch table: " + source.split(" (")[0].split(":")[0].strip()[:80]


def _sps(doc: dict, path: Path) -> SpsTable:
    tokens = _probes(doc, "sample_batch_tokens", path)
    steps = _values(doc, "sample_steps_per_sec", path, len(tokens), positive=True)
    largest = doc.get("max_batch_tokens", tokens[-1])
    if not _is_int(largest) or largest < tokens[-1]:
        raise DsparkError(f"{path}: 'max_batch_tokens' must be an integer >= the largest sample_batch_tokens "
                          f"({tokens[-1]}), not {largest!r}.")
    return SpsTable(tokens, steps, largest)


def _additive(doc: dict, path: Path) -> AdditiveTable:
    bias = _number(doc, "bias_seconds", path, positive=True)
    bs = _probes(doc, "bs_probes", path)
    m = _probes(doc, "m_probes", path)
    return AdditiveTable(bias, bs, _values(doc, "alpha_seconds", path, len(bs)), m,
                         _values(doc, "theta_seconds", path, len(m)))


def _trt(doc: dict, path: Path) -> TrtTable:
    counts = _probes(doc, "token_counts", path)
    steps = _values(doc, "step_time_ms", path, len(counts), positive=True)
    batches = _probes(doc, "batch_sizes", path)
    return TrtTable(_number(doc, "fixed_overhead_ms", path, default=0.0), batches,
                    _values(doc, "batch_overhead_ms", path, len(batches)), counts, steps,
                    _number(doc, "minimum_predicted_gain", path, default=DEFAULT_MINIMUM_GAIN))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _probes(doc: dict, key: str, path: Path) -> tuple[int, ...]:
    probes = doc.get(key)
    good = (isinstance(probes, list) and 0 < len(probes) <= MAX_PROBES and all(_is_int(p) and p >= 1 for p in probes)
            and all(a < b for a, b in zip(probes, probes[1:])))
    if not good:
        raise DsparkError(f"{path}: '{key}' must be a list of 1 to {MAX_PROBES} strictly increasing integers >= 1.")
    return tuple(probes)


def _values(doc: dict, key: str, path: Path, count: int, positive: bool = False) -> tuple[float, ...]:
    values = doc.get(key)
    bound = "above 0" if positive else ">= 0"
    good = (isinstance(values, list) and len(values) == count
            and all(_is_number(v) and (v > 0 if positive else v >= 0) for v in values))
    if not good:
        raise DsparkError(f"{path}: '{key}' must be a list of {count} finite numbers {bound}, one per probe.")
    return tuple(float(v) for v in values)


def _number(doc: dict, key: str, path: Path, positive: bool = False, default: float | None = None) -> float:
    value = doc.get(key, default)
    if not _is_number(value) or value < 0 or (positive and value == 0):
        raise DsparkError(f"{path}: '{key}' must be a finite number {'above 0' if positive else '>= 0'}, "
                          f"not {value!r}.")
    return float(value)
