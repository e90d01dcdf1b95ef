"""Speculative decoding statistics: what each round did, and the figures computed from them.

The speculative loop gives one `RoundRecord` per round (draft, score, accept, commit) and its
section timer's milliseconds per step and round to the prompt's `GenerationStats`; `summarize` turns a run's stats into a `Summary` (plain numbers, lists and
None, JSON-serialisable through `Summary.to_dict()`). docs/metrics.md defines every figure; the
definitions follow DeepSpec's evaluator (τ, accept_rate@j) and the DSpark paper (conditional
acceptance, confidence calibration). Positions j are 0-based: j = 0 is the first draft token
after the anchor. Pure Python: no torch needed.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

from dspark_cli.runtime.rounds import GenerationStats, RoundRecord

ECE_BINS = 20


@dataclass
class Calibration:
    """Predicted probabilities against 0/1 outcomes. Scores are None when there are no pairs
    (AUROC also when all outcomes are equal)."""

    count: int
    positives: int
    mean_predicted: float | None
    observed_rate: float | None
    ece: float | None
    auroc: float | None
    brier: float | None


@dataclass
class ConfidenceCalibration:
    """survival: Π_{i<=j} c_i against "positions 0..j all accepted", over verified positions
    (j < proposed). per_slot: c_j against "j accepted", over rounds where 0..j-1 were accepted and
    j was verified. Pooled over positions, and per position (block_size entries)."""

    survival: Calibration
    survival_per_position: list[Calibration]
    per_slot: Calibration
    per_slot_per_position: list[Calibration]


@dataclass
class RoundBreakdown:
    """Mean milliseconds per round of each stage, and each stage's share of their sum: draft_backbone = the
    draft section, markov = markov, verify = score + accept, rollback = snapshot + rollback, other = commit +
    advance (see GenerationStats.sections)."""

    draft_backbone_ms: float
    markov_ms: float
    verify_ms: float
    rollback_ms: float
    other_ms: float
    total_ms: float
    draft_backbone_share: float | None
    markov_share: float | None
    verify_share: float | None
    rollback_share: float | None
    other_share: float | None


@dataclass
class BaselineComparison:
    """Plain autoregressive decoding of the same target on the same prompts, in the same run."""

    tokens_per_s: float | None
    tpot_ms: float | None
    ttft_ms: float | None
    speedup: float | None  # speculative tokens/s divided by baseline tokens/s


@dataclass
class Summary:
    """Every figure `dspark generate` prints; docs/metrics.md defines each one."""

    prompts: int
    rounds: int
    new_tokens: int
    block_size: int
    tau: float | None  # "τ incl. bonus": Σ emitted / rounds
    target_forwards_per_token: float | None  # 1 / τ
    mean_proposed: float | None
    draft_acceptance_rate: float | None  # Σ accepted / Σ proposed
    accepted_histogram: list[int]  # rounds with accepted == a, a = 0..block_size
    acceptance_unconditional: list[float | None]  # rounds with accepted > j / rounds
    accept_rate: list[float | None]  # DeepSpec: rounds with accepted > j / rounds with proposed > j
    acceptance_conditional: list[float | None]  # P(j accepted | 0..j-1 accepted, j proposed)
    calibration: ConfidenceCalibration | None
    calibration_unavailable: str | None  # why calibration is None although rounds carry confidences
    ttft_ms: float | None
    tpot_ms: float | None
    tokens_per_s: float | None
    round_breakdown: RoundBreakdown | None
    baseline: BaselineComparison | None

    def to_dict(self) -> dict:
        return asdict(self)


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def expected_calibration_error(predicted: list[float], outcomes: list[bool], bins: int = ECE_BINS) -> float | None:
    """Σ_b (n_b / n) |mean predicted_b - observed rate_b| over equal-width bins [b/bins, (b+1)/bins)
    of the predicted probability (1.0 falls in the last bin)."""
    if not predicted:
        return None
    predicted_sum, outcome_sum, count = [0.0] * bins, [0.0] * bins, [0] * bins
    for p, y in zip(predicted, outcomes, strict=True):
        b = min(int(p * bins), bins - 1)
        predicted_sum[b] += p
        outcome_sum[b] += y
        count[b] += 1
    return sum(abs(predicted_sum[b] - outcome_sum[b]) for b in range(bins)) / len(predicted)


def auroc(scores: list[float], outcomes: list[bool]) -> float | None:
    """P(score of a random positive > score of a random negative), ties counting 1/2
    (Mann-Whitney U with average ranks). None unless both classes occur."""
    positives = sum(outcomes)
    negatives = len(outcomes) - positives
    if positives == 0 or negatives == 0:
        return None
    pairs = sorted(zip(scores, outcomes, strict=True))
    rank_sum, rank = 0.0, 0
    for _, group in itertools.groupby(pairs, key=lambda pair: pair[0]):
        tied = [y for _, y in group]
        average_rank = rank + (len(tied) + 1) / 2  # ranks rank+1 .. rank+len(tied)
        rank_sum += average_rank * sum(tied)
        rank += len(tied)
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def brier_score(predicted: list[float], outcomes: list[bool]) -> float | None:
    """Mean squared error (p - y)^2."""
    if not predicted:
        return None
    return sum((p - y) ** 2 for p, y in zip(predicted, outcomes, strict=True)) / len(predicted)


def calibration(predicted: list[float], outcomes: list[bool]) -> Calibration:
    return Calibration(
        count=len(predicted),
        positives=sum(outcomes),
        mean_predicted=_ratio(sum(predicted), len(predicted)),
        observed_rate=_ratio(sum(outcomes), len(outcomes)),
        ece=expected_calibration_error(predicted, outcomes),
        auroc=auroc(predicted, outcomes),
        brier=brier_score(predicted, outcomes),
    )


def calibration_problem(rounds: list[RoundRecord]) -> str | None:
    """Why the confidences of these rounds cannot be scored (a value that is not a probability), or None."""
    scored = [r for r in rounds if r.confidences is not None]
    broken = [r for r in scored if not all(math.isfinite(c) and 0.0 <= c <= 1.0 for c in r.confidences)]
    if not broken:
        return None
    bad = next(c for c in broken[0].confidences if not (math.isfinite(c) and 0.0 <= c <= 1.0))
    return (f"the confidence head gave values that are not probabilities (e.g. {bad}) in {len(broken)} of "
            f"{len(scored)} rounds; its weights are probably corrupt (NaN or inf)")


def _confidence_calibration(rounds: list[RoundRecord], block_size: int) -> ConfidenceCalibration | None:
    survival_pairs: list[list[tuple[float, bool]]] = [[] for _ in range(block_size)]
    per_slot_pairs: list[list[tuple[float, bool]]] = [[] for _ in range(block_size)]
    scored = [r for r in rounds if r.confidences is not None]
    if not scored or calibration_problem(scored) is not None:
        return None
    for r in scored:
        survival = 1.0
        for j in range(r.proposed):  # only verified positions have an outcome
            survival *= r.confidences[j]
            survival_pairs[j].append((survival, r.accepted > j))
            if r.accepted >= j:  # 0..j-1 accepted: slot j was judged on its own
                per_slot_pairs[j].append((r.confidences[j], r.accepted > j))

    def from_pairs(pairs: list[tuple[float, bool]]) -> Calibration:
        return calibration([p for p, _ in pairs], [y for _, y in pairs])

    return ConfidenceCalibration(
        survival=from_pairs([pair for position in survival_pairs for pair in position]),
        survival_per_position=[from_pairs(position) for position in survival_pairs],
        per_slot=from_pairs([pair for position in per_slot_pairs for pair in position]),
        per_slot_per_position=[from_pairs(position) for position in per_slot_pairs],
    )


# The report's five round stages, each the sum of these loop sections (GenerationStats.sections).
STAGE_SECTIONS = {"draft_backbone": ("draft",), "markov": ("markov",), "verify": ("score", "accept"),
                  "rollback": ("rollback", "snapshot"), "other": ("commit", "advance")}


def stage_seconds(sections: dict[str, float]) -> dict[str, float]:
    """One round's sections (ms) -> its five stages in seconds (the keys of an eval run file's rounds)."""
    return {stage: sum(sections.get(name, 0.0) for name in names) / 1000.0 for stage, names in STAGE_SECTIONS.items()}


def stage_sections(stages: dict[str, float]) -> dict[str, float]:
    """The inverse of stage_seconds (a two-section stage is given to its first section): seconds -> ms."""
    return {names[0]: 1000.0 * stages[stage] for stage, names in STAGE_SECTIONS.items() if stage in stages}


def round_dicts(stats: GenerationStats) -> list[dict]:
    """The rounds of one prompt as JSON objects: RoundRecord's fields plus its five stages in seconds."""
    return [asdict(r) | stage_seconds(t) for r, t in zip(stats.rounds, stats.sections, strict=True)]


def _round_breakdown(sections: list[dict[str, float]]) -> RoundBreakdown | None:
    if not sections:
        return None
    per_round = [stage_seconds(r) for r in sections]
    stages = [1000.0 * sum(r[stage] for r in per_round) / len(per_round) for stage in STAGE_SECTIONS]
    total = sum(stages)
    shares = [_ratio(stage, total) for stage in stages]
    return RoundBreakdown(*stages, total, *shares)


def _wall_clock(stats: list[GenerationStats]) -> tuple[float | None, float | None, float | None]:
    """(mean TTFT ms, pooled time per output token after the first in ms, pooled tokens/s)."""
    ttft_ms = _ratio(1000.0 * sum(s.ttft_s for s in stats), len(stats))
    decoding = [s for s in stats if s.new_tokens >= 2]
    tpot_ms = _ratio(1000.0 * sum(s.total_s - s.ttft_s for s in decoding), sum(s.new_tokens - 1 for s in decoding))
    tokens_per_s = _ratio(sum(s.new_tokens for s in stats), sum(s.total_s for s in stats))
    return ttft_ms, tpot_ms, tokens_per_s


def summarize(
    stats: list[GenerationStats], baseline: list[GenerationStats] | None, block_size: int
) -> Summary:
    """All figures of a run; rounds are pooled over prompts. `baseline`, when given, must hold the
    same prompts in the same order (checked by prompt length)."""
    rounds = [r for s in stats for r in s.rounds]
    if any(r.proposed > block_size for r in rounds):
        raise ValueError(f"a round proposes more than block_size = {block_size} tokens")
    emitted = sum(r.emitted for r in rounds)
    proposed = sum(r.proposed for r in rounds)
    accepted_more = [sum(r.accepted > j for r in rounds) for j in range(block_size)]

    ttft_ms, tpot_ms, tokens_per_s = _wall_clock(stats)
    comparison = None
    if baseline is not None:
        if [s.prompt_tokens for s in baseline] != [s.prompt_tokens for s in stats]:
            raise ValueError("the baseline must run the same prompts, in the same order, as the speculative run")
        base_ttft_ms, base_tpot_ms, base_tokens_per_s = _wall_clock(baseline)
        speedup = _ratio(tokens_per_s, base_tokens_per_s) if tokens_per_s is not None else None
        comparison = BaselineComparison(base_tokens_per_s, base_tpot_ms, base_ttft_ms, speedup)

    return Summary(
        prompts=len(stats),
        rounds=len(rounds),
        new_tokens=sum(s.new_tokens for s in stats),
        block_size=block_size,
        tau=_ratio(emitted, len(rounds)),
        target_forwards_per_token=_ratio(len(rounds), emitted),
        mean_proposed=_ratio(proposed, len(rounds)),
        draft_acceptance_rate=_ratio(sum(r.accepted for r in rounds), proposed),
        accepted_histogram=[sum(r.accepted == a for r in rounds) for a in range(block_size + 1)],
        acceptance_unconditional=[_ratio(accepted_more[j], len(rounds)) for j in range(block_size)],
        accept_rate=[
            _ratio(accepted_more[j], sum(r.proposed > j for r in rounds)) for j in range(block_size)
        ],
        acceptance_conditional=[
            _ratio(accepted_more[j], sum(r.accepted >= j and r.proposed > j for r in rounds))
            for j in range(block_size)
        ],
        calibration=_confidence_calibration(rounds, block_size),
        calibration_unavailable=calibration_problem(rounds),
        ttft_ms=ttft_ms,
        tpot_ms=tpot_ms,
        tokens_per_s=tokens_per_s,
        round_breakdown=_round_breakdown([r for s in stats for r in s.sections]),
        baseline=comparison,
    )
