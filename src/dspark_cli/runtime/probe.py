"""`dspark validate --probe`: a few short greedy prompts through dspark's own runtime (the Pair API), so that a draft
that loads but drafts nothing useful is caught from measured acceptance, not from its headers.

A round always emits one token (the correction or bonus) plus the accepted drafted ones, so τ (Σ emitted / rounds,
measure/metrics.py) is 1 for a draft whose proposals are never accepted. Such a round still pays a draft pass and a
target pass over the whole block, more than a plain decoding step, so below `SLOWER_TAU` speculation only costs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.rules.codes import CODES, Finding

# Short and generic: code, prose and a list, so that any draft trained on text or code accepts some of each.
PROBE_PROMPTS = (
    "def read_config(path):\n    \"\"\"Return the settings stored in the file at path.\"\"\"\n",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, key):\n",
    "The history of the printing press begins",
    "Steps to make a cup of tea:\n1.",
)
PROBE_TOKENS = 32  # new tokens per prompt: several rounds at any block size, a few seconds on a CPU for the demo pair
SLOWER_TAU = 1.3  # τ below this: under one accepted token in three rounds, the draft and verify cost are not paid back


@dataclass(frozen=True)
class ProbeResult:
    prompts: int
    rounds: int
    new_tokens: int
    block_size: int
    tau: float  # Σ emitted / rounds: tokens per target forward
    draft_acceptance_rate: float | None  # Σ accepted / Σ proposed

    @property
    def slower(self) -> bool:
        return self.tau < SLOWER_TAU

    def to_dict(self) -> dict:
        return {**asdict(self), "slower": self.slower, "slower_below_tau": SLOWER_TAU}


def probe(target: str, draft: str, *, device: str = "auto", prompts: tuple[str, ...] = PROBE_PROMPTS,
          max_new_tokens: int = PROBE_TOKENS) -> ProbeResult:
    """Greedy speculative decoding of `prompts` with the pair in float32 (lossless, so only acceptance is measured)."""
    from dspark_cli.runtime.measure.metrics import summarize
    from dspark_cli.runtime.pair import Pair

    pair = Pair.check(target, draft, device=device, dtype="float32", temperature=0.0).load(progress=False)
    stats = [pair.generate(prompt, max_new_tokens=max_new_tokens).stats for prompt in prompts]
    summary = summarize(stats, None, pair.block_size)
    if summary.tau is None:
        raise DsparkError("the probe ran no speculative round: every probe prompt ended at its first token.")
    return ProbeResult(prompts=len(prompts), rounds=summary.rounds, new_tokens=summary.new_tokens,
                       block_size=pair.block_size, tau=summary.tau,
                       draft_acceptance_rate=summary.draft_acceptance_rate)


def probe_findings(result: ProbeResult) -> list[Finding]:
    """DSP608 when the measured acceptance is near zero."""
    if not result.slower:
        return []
    return [Finding("DSP608", CODES["DSP608"][0],
                    f"the probe measured τ {result.tau:.2f} over {result.rounds} rounds of {result.prompts} greedy "
                    f"prompts (block {result.block_size}): acceptance is near zero, so this draft will make "
                    "decoding slower.",
                    "Check that the draft was trained for this target and exported whole (validate with the deep "
                    "option finds untrained norms and zero weights); otherwise serve the target without it.")]
