"""What one speculative round did, and the rules that decide a round's length: below both the loop (decode/) and
the measurements (measure/), pure Python (no torch).

RoundRecord is one round's counts and confidences; GenerationStats one prompt's rounds and timings;
scored_length how many drafted positions a confidence threshold keeps (the loop applies it, `dspark plan`
replays it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

CONFIDENCE_RULES = ("survival", "per-slot")
LENGTH_RULES = ("stop", "deepspec")


def scored_length(confidences: Sequence[float], threshold: float, rule: str = "survival") -> int:
    """How many drafted positions the target scores, from their confidences c_1..c_N (floats or a [N] tensor).

    survival (vLLM's capacity rule): the positions whose survival Π_{i<=j} c_i >= threshold (survival never
    increases, so they form a prefix), multiplied in float64. per-slot (DeepSpec's evaluator): the positions
    before the first slot whose own c_j < threshold."""
    values = [float(c) for c in confidences]
    if rule == "per-slot":
        return next((j for j, c in enumerate(values) if c < threshold), len(values))
    survival, count = 1.0, 0
    for c in values:
        survival *= c
        count += survival >= threshold
    return count



def sigmoid(x: float) -> float:
    """The logistic function of a raw confidence logit, without overflow for large |x|."""
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


@dataclass
class RoundRecord:
    """One round of one sequence (its timings are in GenerationStats.sections).

    proposed: draft tokens the target scored (n_scored; may be < drafted after a confidence cut, or
        the stop token's index + 1 when an accepted draft token is a stop token).
    accepted: draft tokens accepted, 0..proposed.
    emitted: tokens the round commits: accepted + 1 (correction or bonus), or accepted when the
        round ends on an accepted stop token (DeepSpec's rule). Counted before the output is
        trimmed to the length limit.
    drafted: positions the draft produced (block size); None means equal to proposed.
    confidences: per-slot confidence c_j in [0, 1] for each drafted position, or None (with an STS calibration,
        c_j = sigmoid(logit_j / T_j)).
    confidence_logits: the confidence head's raw logits for each drafted position (before any temperature), or
        None; what `dspark calibrate` fits and `dspark plan` replays.
    """

    proposed: int
    accepted: int
    emitted: int
    drafted: int | None = None
    confidences: list[float] | None = None
    confidence_logits: list[float] | None = None

    def __post_init__(self) -> None:
        if self.drafted is None:
            self.drafted = self.proposed
        if not 0 <= self.accepted <= self.proposed <= self.drafted:
            raise ValueError(
                f"need 0 <= accepted <= proposed <= drafted, got {self.accepted}, {self.proposed}, {self.drafted}"
            )
        if self.emitted not in (self.accepted, self.accepted + 1) or self.emitted < 1:
            raise ValueError(
                f"emitted must be accepted + 1, or accepted >= 1 after an accepted stop token; "
                f"got emitted {self.emitted} for accepted {self.accepted}"
            )
        if self.confidences is not None:
            if len(self.confidences) != self.drafted:
                raise ValueError(
                    f"need one confidence per drafted position ({self.drafted}), got {len(self.confidences)}"
                )
            if not all(0.0 <= c <= 1.0 for c in self.confidences):
                raise ValueError(f"confidences must be probabilities in [0, 1], got {self.confidences}")


@dataclass
class GenerationStats:
    """One prompt: token counts, wall clock (seconds from the start of prefill), and its rounds.

    new_tokens counts generated tokens after trimming, the first token (sampled from the prefill
    logits, in no round) included. ttft_s: until that first token; total_s: until the last one.
    sections: per round, wall-clock ms per step of the loop (runtime/timing.SectionTimer): draft (the
    draft's parallel pass), markov (Markov walk, confidence head, q), score (the target forward over the
    block), accept (the accept/reject decision), commit (output, streaming), snapshot (a stateful target's
    states copied before the score pass), rollback (target cache crop; a stateful target's states restored and
    re-advanced) and advance (draft context append); rollback and advance are absent in the last round.
    """

    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    total_s: float
    rounds: list[RoundRecord] = field(default_factory=list)
    sections: list[dict[str, float]] = field(default_factory=list)


