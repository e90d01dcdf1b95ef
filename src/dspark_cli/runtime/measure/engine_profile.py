"""An engine's own step costs, measured in place by `dspark bench engine`, read as input by `dspark plan`.

    profile = read_engine_profile(path)          # EngineProfile, checked; DsparkError in one sentence otherwise
    profile.plain_ms(requests, context)          # [repeats] ms of one plain decode step of R requests
    profile.step_ms(requests, context, n, t)     # [repeats] ms of one speculative step drafting n, verifying t

The document (format dspark-engine-costs/1) holds raw samples, one per repeat, taken in interleaved rounds (repeat
i of every point was measured in the same pass over all points, so a change of load on a shared machine hits them
alike and ratios within a repeat are paired):

- `verify_ms`: {tokens M, ms}: one target forward over M new tokens at context 0 (a fresh prompt's processing
  time, as the engine reports it).
- `plain_ms`: {requests R, context c, ms}: one decode step of R concurrent requests at context c (the engine's
  time per generated token of requests generating in lockstep).
- `spec_ms`: {draft_n n, requests R, context c, ms, acceptance}: one speculative step of R concurrent requests at
  context c, on a server drafting n tokens a round: the engine's generation time over its steps (tokens generated
  minus draft tokens accepted).

The cost model. The directly measured figures (D, S) are kept per repeat, so a prediction pairs figures taken
together; the model's structural terms are fitted to the medians over repeats, so one disturbed sample cannot be
multiplied into every prediction (ms, every figure the engine's own; nothing from dspark's PyTorch runtime):

    A(R, c)    = max(0, D(R, c) - D(R, 0))            the context's cost to one scored token of each of R sequences
                                                      (attention over c cached positions); D(R, 0) extrapolated
                                                      linearly from the two smallest contexts (0 with one context)
    V(R, t, c) = θ(R·t) + D(R, c) - θ(R) + (t - 1)·A(R, c)
                                                      verify: R sequences scoring t tokens each at context c (the
                                                      tokens' forward, what R sequences cost beyond one prompt of R
                                                      tokens, each further token's attention over the context)
    Δ_i(R, n, c) = S_i(R, n, c) - V(R, n + 1, c)      the draft's time and the speculation bookkeeping of a step,
                                                      measured per R (llama.cpp drafts each sequence's block and
                                                      injects its features separately, so it grows with R)
    step_i(R, n, t, c) = max(D_i(R, c), Δ_i(R, n, c) + V(R, t, c))
                                                      a step drafting n and verifying t tokens each; at a measured n
                                                      verifying all n it is S_i itself; never below the plain step
                                                      (it runs a target pass over at least one token per sequence)

θ is linear between measured token counts; Δ at an n no server drafted is linear between the measured n
between the measured n (held constant beyond them). Torch-free.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.io.reading import read_json_file

PROFILE_FORMAT = "dspark-engine-costs/1"
MAX_PROFILE_BYTES = 16 * 1024 * 1024
MAX_POINTS = 100_000


@dataclass(frozen=True)
class ModelFile:
    """A model file the engine served: its path, its fingerprint and that of the folder it was converted from."""

    path: str | None
    fingerprint: str | None
    source: str | None

    def to_dict(self) -> dict:
        return {"path": self.path, "fingerprint": self.fingerprint, "source": self.source}


@dataclass(frozen=True)
class EngineProfile:
    engine: str
    engine_version: str
    hardware: str
    target: ModelFile
    draft: ModelFile
    block_size: int
    repeats: int
    verify: dict[int, tuple[float, ...]]  # M -> [repeats] ms
    plain: dict[tuple[int, int], tuple[float, ...]]  # (R, c) -> [repeats] ms
    spec: dict[tuple[int, int, int], tuple[float, ...]]  # (n, R, c) -> [repeats] ms
    acceptance: dict[tuple[int, int, int], float | None]
    source: str = ""

    @property
    def concurrencies(self) -> list[int]:
        return sorted({r for r, _ in self.plain})

    @property
    def contexts(self) -> list[int]:
        return sorted({c for _, c in self.plain})

    @property
    def draft_ns(self) -> list[int]:
        return sorted({n for n, _, _ in self.spec})

    def plain_ms(self, requests: int, context: int) -> tuple[float, ...]:
        return self.plain[requests, context]

    def median_plain(self, requests: int, context: int) -> float:
        return statistics.median(self.plain[requests, context])

    def theta_ms(self, tokens: float) -> float:
        """θ at `tokens`, the median over repeats (linear between measured counts, clamped at both ends)."""
        probes = sorted(self.verify)
        if tokens <= probes[0]:
            return statistics.median(self.verify[probes[0]])
        if tokens >= probes[-1]:
            return statistics.median(self.verify[probes[-1]])
        hi = bisect.bisect_right(probes, tokens)
        a, b = probes[hi - 1], probes[hi]
        low, high = statistics.median(self.verify[a]), statistics.median(self.verify[b])
        return low + (tokens - a) / (b - a) * (high - low)

    def context_ms(self, requests: int, context: int) -> float:
        """A(R, c): what c cached positions add to one scored token of each of R sequences."""
        contexts = self.contexts
        if len(contexts) < 2:
            return 0.0
        c0, c1 = contexts[:2]
        d0, d1 = self.median_plain(requests, c0), self.median_plain(requests, c1)
        at_zero = d0 - c0 * (d1 - d0) / (c1 - c0)
        return max(0.0, self.median_plain(requests, context) - at_zero)

    def verify_ms(self, requests: int, tokens_each: float, context: int) -> float:
        """V(R, t, c): R sequences scoring t tokens each at context c."""
        return (self.theta_ms(requests * tokens_each) + self.median_plain(requests, context)
                - self.theta_ms(requests) + (tokens_each - 1) * self.context_ms(requests, context))

    def draft_ms(self, requests: int, n: int, context: int, repeat: int) -> float:
        """Δ_i(R, n, c): what a speculative step costs beyond its verify pass (linear between measured n)."""
        measured = {m: self.spec[m, requests, context][repeat] - self.verify_ms(requests, m + 1, context)
                    for m in self.draft_ns}
        ns = sorted(measured)
        if n <= ns[0]:
            return measured[ns[0]]
        if n >= ns[-1]:
            return measured[ns[-1]]
        hi = bisect.bisect_right(ns, n)
        a, b = ns[hi - 1], ns[hi]
        return measured[a] + (n - a) / (b - a) * (measured[b] - measured[a])

    def step_ms(self, requests: int, context: int, n: int, tokens_each: float) -> list[float]:
        """[repeats] ms of a speculative step: R requests drafting n tokens and verifying `tokens_each` tokens each
        (the anchor included), never below the plain step of the same repeat."""
        verify = self.verify_ms(requests, tokens_each, context)
        return [max(self.plain[requests, context][i], self.draft_ms(requests, n, context, i) + verify)
                for i in range(self.repeats)]

    def check_covers(self, concurrencies: list[int], contexts: list[int], path: str) -> None:
        """DsparkError naming the first concurrency or context the profile did not measure."""
        for c in concurrencies:
            if c not in self.concurrencies:
                raise DsparkError(f"{path} was measured at concurrency {_listed(self.concurrencies)}, not {c}; "
                                  f"profile the engine at {c} with `dspark bench engine` or ask for a measured one.")
        for c in contexts:
            if c not in self.contexts:
                raise DsparkError(f"{path} was measured at context {_listed(self.contexts)} tokens, not {c}; "
                                  f"profile the engine at {c} with `dspark bench engine` or ask for a measured one.")


def _listed(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def is_engine_profile(doc: object) -> bool:
    return isinstance(doc, dict) and doc.get("format") == PROFILE_FORMAT


def read_engine_profile(path: Path, doc: object = None) -> EngineProfile:
    """The checked profile at `path` (or its already-read document); DsparkError naming the file and key."""
    if doc is None:
        doc = read_json_file(path, "engine cost profile", MAX_PROFILE_BYTES, "give the JSON `dspark bench engine` "
                             "writes")
    return _Reader(path).profile(doc)


class _Reader:
    def __init__(self, path: Path):
        self.path = path

    def fail(self, key: str, problem: str) -> None:
        raise DsparkError(f"{self.path}: '{key}' {problem}; this is not a profile `dspark bench engine` writes "
                          "(edited or truncated?): measure it again.")

    def profile(self, doc: object) -> EngineProfile:
        if not is_engine_profile(doc):
            self.fail("format", f"must be {PROFILE_FORMAT!r}")
        repeats = doc.get("repeats")
        if not (isinstance(repeats, int) and not isinstance(repeats, bool) and 1 <= repeats <= 1000):
            self.fail("repeats", "must be an integer from 1 to 1000")
        block = doc.get("block_size")
        if not (isinstance(block, int) and not isinstance(block, bool) and 1 <= block <= 1024):
            self.fail("block_size", "must be an integer from 1 to 1024")
        verify = self.points(doc, "verify_ms", ("tokens",), repeats)
        plain = self.points(doc, "plain_ms", ("requests", "context"), repeats)
        spec = self.points(doc, "spec_ms", ("draft_n", "requests", "context"), repeats)
        if not verify or not plain or not spec:
            self.fail("verify_ms" if not verify else "plain_ms" if not plain else "spec_ms", "is empty")
        for (n, r, c) in spec:
            if (r, c) not in plain:
                self.fail("spec_ms", f"has a point at {r} requests and context {c} that plain_ms lacks")
        for (r, c) in plain:
            if any((n, r, c) not in spec for n in {n for n, _, _ in spec}):
                self.fail("spec_ms", f"lacks a point at {r} requests and context {c}")
            if r not in verify:
                self.fail("verify_ms", f"lacks {r} tokens (the plain step of {r} requests is compared with it)")
        if any(n < 1 or n > block for n, _, _ in spec):
            self.fail("spec_ms", f"has a draft_n outside 1..block_size ({block})")
        acceptance = {key: self.acceptance(doc, key) for key in spec}
        models = doc.get("models")
        if not isinstance(models, dict):
            self.fail("models", "must be an object with 'target' and 'draft'")
        return EngineProfile(self.text(doc, "engine"), self.text(doc, "engine_version"), self.text(doc, "hardware"),
                             self.model(models, "target"), self.model(models, "draft"), block, repeats, verify,
                             plain, spec, acceptance, str(self.path))

    def text(self, doc: dict, key: str) -> str:
        value = doc.get(key)
        if not isinstance(value, str) or not value or len(value) > 1000:
            self.fail(key, "must be a non-empty string")
        return value

    def model(self, models: dict, role: str) -> ModelFile:
        entry = models.get(role)
        if not isinstance(entry, dict):
            self.fail(f"models.{role}", "must be an object")
        values = [entry.get(k) for k in ("path", "fingerprint", "source")]
        if not all(v is None or (isinstance(v, str) and len(v) <= 4096) for v in values):
            self.fail(f"models.{role}", "must hold path, fingerprint and source as strings or null")
        return ModelFile(*values)

    def points(self, doc: dict, key: str, axes: tuple[str, ...], repeats: int) -> dict:
        points = doc.get(key)
        if not isinstance(points, list) or len(points) > MAX_POINTS:
            self.fail(key, f"must be a list of at most {MAX_POINTS} points")
        out = {}
        for number, point in enumerate(points):
            where = f"{key}[{number}]"
            if not isinstance(point, dict):
                self.fail(where, "must be an object")
            coords = tuple(point.get(axis) for axis in axes)
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= (0 if a == "context" else 1)
                       for v, a in zip(coords, axes)):
                self.fail(where, f"needs {', '.join(axes)} as integers (context >= 0, the others >= 1)")
            ms = point.get("ms")
            if not (isinstance(ms, list) and len(ms) == repeats
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                            for v in ms)):
                self.fail(f"{where}.ms", f"must hold {repeats} finite times above 0, one per repeat")
            key_ = coords[0] if len(coords) == 1 else coords
            if key_ in out:
                self.fail(where, "repeats another point")
            out[key_] = tuple(float(v) for v in ms)
        return out

    def acceptance(self, doc: dict, key: tuple[int, int, int]) -> float | None:
        point = next(p for p in doc["spec_ms"] if (p["draft_n"], p["requests"], p["context"]) == key)
        value = point.get("acceptance")
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and 0 <= value <= 1):
            self.fail("spec_ms.acceptance", "must be a number from 0 to 1 or null")
        return value
