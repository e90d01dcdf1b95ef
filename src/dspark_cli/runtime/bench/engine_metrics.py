"""What a serving engine reports about its speculation, parsed: Prometheus text (vLLM, llama.cpp, SGLang), SGLang's
server info and llama.cpp's per-response timings. Torch-free, pure functions of the text or JSON the engine sent.

    before = spec_counters(metrics_text, "vllm")       # SpecCounters or None (no speculation counters)
    after = spec_counters(later_text, "vllm")
    after.since(before).acceptance                     # accepted / drafted tokens between the two scrapes

Names, read from each engine's source:
- vLLM (vllm/v1/spec_decode/metrics.py, SpecDecodingProm): counters `vllm:spec_decode_num_drafts`,
  `vllm:spec_decode_num_draft_tokens`, `vllm:spec_decode_num_accepted_tokens` and
  `vllm:spec_decode_num_accepted_tokens_per_pos` (label `position`, 0-based), exposed by prometheus_client with the
  `_total` suffix; every series carries `model_name` and `engine` (vllm/v1/metrics/loggers.py), so a server with
  several engines (data parallel) has one series per engine, summed here.
- llama.cpp b11434 (tools/server/server-task.cpp, with `--metrics`): the same four names under the `llamacpp:`
  prefix, `_total` included, no labels but `position`; and per response (server-common.cpp, server_slot_stats):
  `timings.draft_n` and `timings.draft_n_accepted`, present only when the slot drafted.
- SGLang (python/sglang/srt/metrics/collector.py): gauges `sglang:spec_accept_length` (mean tokens per verify step,
  bonus token included) and `sglang:spec_accept_rate` (accepted / drafted), the value of the latest logging
  interval, not totals; `/get_server_info` (`internal_states[i].avg_spec_accept_length`, one entry per
  data-parallel rank; python/sglang/srt/managers/scheduler.py get_internal_state: cum_spec_accept_length /
  cum_spec_accept_count, since the server started).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
SPEC_PREFIXES = ("vllm", "llamacpp")  # engines whose Prometheus text has the spec_decode_* counters


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition (comments, blank and malformed lines skipped; NaN kept)."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        samples.append(Sample(name, dict(LABEL.findall(labels or "")), number))
    return samples


@dataclass(frozen=True)
class SpecCounters:
    """An engine's speculation totals: verify steps that had drafts, drafted and accepted tokens, accepted per
    draft position (0-based)."""

    drafts: float
    draft_tokens: float
    accepted: float
    per_position: tuple[float, ...] = ()

    def since(self, before: "SpecCounters | None") -> "SpecCounters":
        """The counts between `before` and this scrape (a counter reset, e.g. a restarted server, reads as from 0)."""
        if before is None:
            return self
        width = max(len(self.per_position), len(before.per_position))
        mine, theirs = _padded(self.per_position, width), _padded(before.per_position, width)
        if self.draft_tokens < before.draft_tokens:
            return self
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, tuple(a - b for a, b in zip(mine, theirs)))

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens > 0 else None

    @property
    def accept_length(self) -> float | None:
        """Mean tokens per verify step, the bonus token included (vLLM's and SGLang's convention)."""
        return 1.0 + self.accepted / self.drafts if self.drafts > 0 else None

    @property
    def position_rates(self) -> list[float]:
        """Per draft position: the share of verify steps that accepted it."""
        return [a / self.drafts for a in self.per_position] if self.drafts > 0 else []

    def to_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
                "accepted_per_position": list(self.per_position), "acceptance": self.acceptance,
                "accept_length": self.accept_length, "position_rates": self.position_rates}


def _padded(values: tuple[float, ...], width: int) -> list[float]:
    return list(values) + [0.0] * (width - len(values))


def spec_counters(text: str, prefix: str) -> SpecCounters | None:
    """The `PREFIX:spec_decode_*_total` counters of a Prometheus text, summed over label sets (one per engine)
    except `position`; None when the text has none of them (no speculation, or metrics turned off)."""
    totals: dict[str, float] = {}
    positions: dict[int, float] = {}
    for sample in parse_prometheus(text):
        if not sample.name.startswith(f"{prefix}:spec_decode_num_") or not math.isfinite(sample.value):
            continue
        key = sample.name.removeprefix(f"{prefix}:spec_decode_num_").removesuffix("_total")
        if key == "accepted_tokens_per_pos":
            position = sample.labels.get("position", "")
            if position.isdigit():
                positions[int(position)] = positions.get(int(position), 0.0) + sample.value
        elif key in ("drafts", "draft_tokens", "accepted_tokens"):
            totals[key] = totals.get(key, 0.0) + sample.value
    if not totals:
        return None
    per_position = tuple(positions.get(i, 0.0) for i in range(max(positions) + 1)) if positions else ()
    return SpecCounters(totals.get("drafts", 0.0), totals.get("draft_tokens", 0.0),
                        totals.get("accepted_tokens", 0.0), per_position)


@dataclass(frozen=True)
class SglangSpec:
    """SGLang's speculation figures: the gauges of its latest logging interval and the mean since it started."""

    accept_length_gauge: float | None  # sglang:spec_accept_length, mean over series (data-parallel ranks)
    accept_rate_gauge: float | None  # sglang:spec_accept_rate
    avg_accept_length: float | None = None  # /get_server_info, mean over internal_states

    def to_dict(self) -> dict:
        return {"spec_accept_length_gauge": self.accept_length_gauge,
                "spec_accept_rate_gauge": self.accept_rate_gauge,
                "avg_spec_accept_length_since_start": self.avg_accept_length}


def sglang_gauges(text: str) -> SglangSpec:
    """`sglang:spec_accept_length` and `sglang:spec_accept_rate` from SGLang's Prometheus text (mean of the series)."""
    samples = parse_prometheus(text)

    def mean(name: str) -> float | None:
        values = [s.value for s in samples if s.name == name and math.isfinite(s.value)]
        return sum(values) / len(values) if values else None

    return SglangSpec(mean("sglang:spec_accept_length"), mean("sglang:spec_accept_rate"))


def sglang_avg_accept_length(info: object) -> float | None:
    """The mean of `avg_spec_accept_length` over SGLang's server info `internal_states` (or its `decode` servers'
    in a prefill/decode split), None when absent."""
    if not isinstance(info, dict):
        return None
    if isinstance(info.get("decode"), list) and info["decode"]:
        info = info["decode"][0]
    states = info.get("internal_states") if isinstance(info, dict) else None
    if not isinstance(states, list):
        return None
    values = [s.get("avg_spec_accept_length") for s in states if isinstance(s, dict)]
    values = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def llamacpp_draft_counts(timings: object) -> tuple[int, int]:
    """(draft_n, draft_n_accepted) of one llama.cpp response's `timings`; (0, 0) when the slot drafted nothing."""
    if not isinstance(timings, dict):
        return 0, 0
    drafted, accepted = timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (drafted, accepted)):
        return 0, 0
    return drafted, accepted
