"""The acceptance guard of a ModelOpt-format draft (quantize): the unquantized and the quantized draft, each beside
the same target in dspark's runtime (float32, greedy), decode held-out prompts; τ is compared with intervals, paired
by prompt, and the quantized draft refused (or warned about) when τ fell by more than the user's threshold.

The verdict is the llama.cpp guard's (bench/quant_guard.judge), fed with dspark's own round counts: per prompt, the
rounds (verify steps), the drafted tokens and the accepted ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.bench.engine_metrics import SpecCounters
from dspark_cli.runtime.bench.quant_guard import GuardSettings, PairFigures, judge


def runtime_guard(target: str, prompts: Sequence[str], max_tau_drop: float, *, refuse: bool = True,
                  max_tokens: int = 64) -> Callable[[Path, Path], dict]:
    """check(unquantized draft folder, quantized draft folder) -> the guard's figures; GuardRefused on a drop."""
    if not prompts:
        raise DsparkError("the guard's prompt set is empty; give held-out prompts to measure acceptance on.")
    if max_tau_drop < 0:
        raise DsparkError(f"the maximum τ drop must be at least 0, got {max_tau_drop}.")
    settings = GuardSettings(Path(target), (), tuple(prompts), max_tau_drop, refuse=refuse, max_tokens=max_tokens)

    def check(unquantized: Path, quantized: Path) -> dict:
        from dspark_cli.runtime.pair import Pair

        pair = Pair.check(target, str(unquantized), device="cpu", dtype="float32", temperature=0.0).load(
            progress=False)
        reference = measure_draft(pair, settings, "unquantized")
        measured = measure_draft(pair.with_draft(quantized), settings, "quantized")  # the same target, loaded once
        return judge(reference, measured, settings)

    return check


def measure_draft(pair, settings: GuardSettings, label: str) -> PairFigures:
    """The prompts through dspark's runtime with the loaded `pair`: per prompt its rounds, drafted and accepted
    tokens."""
    figures = PairFigures(label)
    for prompt in settings.prompts:
        stats = pair.generate(prompt, max_new_tokens=settings.max_tokens).stats
        rounds = stats.rounds
        figures.per_prompt.append(SpecCounters(drafts=len(rounds), draft_tokens=sum(r.proposed for r in rounds),
                                               accepted=sum(r.accepted for r in rounds)))
        figures.tokens += stats.new_tokens
    return figures
