"""Does speculation pay here? `dspark plan RUN.json --costs PROFILE.json`: a verdict per concurrency and context.

    plan = decide(runs, profile, concurrencies=[1, 2, 4], contexts=[64, 512])
    plan.verdicts[0].verdict        # "pays", "does not pay", "undecided" or "no data"
    plan.verdicts[0].n              # the draft length to serve: 0 = do not speculate, 1..block

Inputs: eval runs of the pair (`dspark eval --json`: which drafted tokens the target accepts, round by round) and
the engine's own cost profile (`dspark bench engine`, engine_profile.py). Nothing of dspark's own PyTorch timing
enters: the rounds give acceptance only, the profile every millisecond.

Acceptance by context: a round's context is its prompt's tokens plus the tokens emitted before it. The rounds are
bucketed by the contexts asked (bucket edges at the geometric midpoints between them), and each context is planned
with its own bucket's rounds; a bucket with fewer than MIN_ROUNDS rounds or MIN_PROMPTS prompts says "no data".

For each candidate (draft n tokens, n = 1..block; with `thresholds`, also cut at a confidence threshold X as
llama.cpp's p-min cuts: the first position whose confidence is below X and every later one are not verified; the
profile's servers draft fixed lengths, so a cut's saving is the cost model's extrapolation, which measured too
optimistic on the demo-large pair: docs/bench.md),
each bucket round is replayed exactly (replay.replay_round: the tokens it would emit verifying that many), giving
τ(n, X) with the bootstrap interval over prompts that `dspark eval` uses and the mean tokens verified per round t.
At R concurrent requests (each drafting and verifying its own block every step, as llama.cpp does):

    speculative tokens/s = R·τ / step(R, n, t, c)        plain tokens/s = R / D(R, c)
    speedup = τ · D / step, per repeat of the profile (the pair of figures measured together)

The point estimate takes the median over repeats; the interval is [τ low · 25th percentile, τ high · 75th
percentile] of the repeats' D / step, so it carries both the run's interval and the profile's spread. The chosen
candidate maximises the point tokens/s (not τ); the verdict is "pays" when its interval lies above 1, "does not
pay" when it lies below 1 (n = 0: serve without the draft), "undecided" otherwise (n: the point estimate's choice,
0 when its point does not beat plain decoding). Torch-free.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.fingerprint import folder_fingerprint
from dspark_cli.runtime.measure.engine_profile import EngineProfile
from dspark_cli.runtime.measure.evaluation import bootstrap_ratio, percentile
from dspark_cli.runtime.measure.replay import VERDICT_PLAN_FORMAT, Round, replay_round, rounds_of_result
from dspark_cli.runtime.rounds import scored_length, sigmoid

THRESHOLDS = tuple(round(0.1 * i, 1) for i in range(1, 10))
MIN_ROUNDS = 20
MIN_PROMPTS = 2
PAYS, LOSES, UNDECIDED, NO_DATA = "pays", "does not pay", "undecided", "no data"


@dataclass(frozen=True)
class Candidate:
    n: int
    threshold: float | None = None

    @property
    def label(self) -> str:
        return f"n = {self.n}" + ("" if self.threshold is None else f", p-min {self.threshold:g}")

    def verify_length(self, r: Round) -> int:
        """Draft tokens the target scores in round r: n, cut at the first confidence below the threshold."""
        if self.threshold is None or r.logits is None:
            return self.n
        return min(self.n, scored_length([sigmoid(l) for l in r.logits], self.threshold, "per-slot"))


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    tau: float
    tau_low: float
    tau_high: float
    verified_per_round: float  # tokens scored per round, the anchor included
    step_ms: float  # median over repeats
    tokens_per_s: float
    speedup: float
    speedup_low: float
    speedup_high: float

    def to_dict(self) -> dict:
        return {"n": self.candidate.n, "threshold": self.candidate.threshold, "label": self.candidate.label,
                "tau": self.tau, "tau_ci": [self.tau_low, self.tau_high],
                "verified_per_round": self.verified_per_round, "step_ms": self.step_ms,
                "tokens_per_s": self.tokens_per_s, "speedup": self.speedup,
                "speedup_interval": [self.speedup_low, self.speedup_high]}


@dataclass
class Verdict:
    concurrency: int
    context: int
    bucket: tuple[float, float]  # the rounds' context range [low, high)
    rounds: int
    prompts: int
    plain_step_ms: float
    plain_tokens_per_s: float
    draft_ms_per_step: dict[int, float]  # measured n -> median Δ at this concurrency and context
    verdict: str = NO_DATA
    n: int = 0
    threshold: float | None = None
    best: Prediction | None = None
    reason: str = ""
    predictions: list[Prediction] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"concurrency": self.concurrency, "context": self.context, "bucket": list(self.bucket),
                "rounds": self.rounds, "prompts": self.prompts, "verdict": self.verdict, "n": self.n,
                "threshold": self.threshold, "reason": self.reason, "plain_step_ms": self.plain_step_ms,
                "plain_tokens_per_s": self.plain_tokens_per_s,
                "draft_ms_per_step": {str(n): v for n, v in self.draft_ms_per_step.items()},
                "best": None if self.best is None else self.best.to_dict(),
                "predictions": [p.to_dict() for p in self.predictions]}


@dataclass
class VerdictPlan:
    runs: list[str]
    profile: EngineProfile
    block_size: int
    verdicts: list[Verdict]
    notes: list[str]

    def to_dict(self) -> dict:
        p = self.profile
        return {"format": VERDICT_PLAN_FORMAT, "runs": self.runs, "block_size": self.block_size,
                "costs": p.source, "engine": p.engine, "engine_version": p.engine_version, "hardware": p.hardware,
                "models": {"target": p.target.to_dict(), "draft": p.draft.to_dict()},
                "verdicts": [v.to_dict() for v in self.verdicts],
                "speculative_config": self.speculative_config(), "notes": self.notes}

    def speculative_config(self) -> dict | None:
        """What `dspark serve --from-plan` deploys: only a plan of one concurrency and one context decides one."""
        if len(self.verdicts) != 1 or self.verdicts[0].verdict == NO_DATA:
            return None
        v = self.verdicts[0]
        fields = {"num_speculative_tokens": v.n}
        if v.threshold is not None and v.n:
            fields["dspark_confidence_threshold"] = v.threshold
        return fields


def context_buckets(contexts: Sequence[int]) -> list[tuple[float, float]]:
    """[low, high) of each context's bucket: edges at the geometric midpoints between neighbours."""
    ordered = sorted(contexts)
    edges = [math.sqrt(max(a, 1) * max(b, 1)) for a, b in zip(ordered, ordered[1:])]
    lows, highs = [0.0] + edges, edges + [math.inf]
    by_context = {c: (lo, hi) for c, lo, hi in zip(ordered, lows, highs)}
    return [by_context[c] for c in contexts]


def positioned_rounds(results: list) -> list[list[tuple[int, Round]]]:
    """Per prompt, each round with its context: the prompt's tokens plus the tokens emitted before it."""
    prompts = []
    for result in results:
        position, rounds = result.prompt_tokens, []
        for record, r in zip(result.rounds, rounds_of_result(result)):
            rounds.append((position, r))
            position += record["emitted"]
        prompts.append(rounds)
    return prompts


def rounds_in_bucket(prompts: list[list[tuple[int, Round]]], bucket: tuple[float, float]) -> list[list[Round]]:
    """Per prompt (positioned_rounds), its rounds whose context lies in the bucket; prompts without one left out."""
    kept = [[r for position, r in rounds if bucket[0] <= position < bucket[1]] for rounds in prompts]
    return [rounds for rounds in kept if rounds]


def replayed_tau(prompts: list[list[Round]], candidate: Candidate) -> tuple[float, float, float, float]:
    """(τ, its low and high bound, tokens verified per round with the anchor) of the candidate over the rounds."""
    emitted, counts, verified = [], [], 0
    for rounds in prompts:
        outcomes = [replay_round(r, candidate.verify_length(r)) for r in rounds]
        emitted.append(float(sum(o.emitted for o in outcomes)))
        counts.append(float(len(rounds)))
        verified += sum(o.verified + 1 for o in outcomes)
    tau = bootstrap_ratio(emitted, counts)
    return tau.estimate, tau.low, tau.high, verified / sum(counts)


def predict(profile: EngineProfile, replayed: tuple[float, float, float, float], candidate: Candidate,
            requests: int, context: int) -> Prediction:
    """The candidate at R requests and context c, from its replayed (τ, low, high, verified) (module docstring)."""
    tau, low, high, verified = replayed
    steps = profile.step_ms(requests, context, candidate.n, verified)
    plain = profile.plain_ms(requests, context)
    ratios = sorted(d / s for d, s in zip(plain, steps))
    step = statistics.median(steps)
    return Prediction(candidate, tau, low, high, verified, step, 1000.0 * requests * tau / step,
                      tau * statistics.median(ratios), low * percentile(ratios, 0.25), high * percentile(ratios, 0.75))


def candidates_for(block: int, has_logits: bool, thresholds: bool) -> list[Candidate]:
    """n = 1..block, and with the runs' confidence logits and an engine that cuts by a threshold, n × THRESHOLDS."""
    out = [Candidate(n) for n in range(1, block + 1)]
    if has_logits and thresholds:
        out += [Candidate(n, x) for n in range(1, block + 1) for x in THRESHOLDS]
    return out


def judge(verdict: Verdict, predictions: list[Prediction]) -> None:
    """Fill in the verdict from the candidates' predictions (module docstring)."""
    verdict.predictions = predictions
    best = max(predictions, key=lambda p: p.tokens_per_s)
    verdict.best = best
    if best.speedup_low > 1.0:
        verdict.verdict, verdict.n, verdict.threshold = PAYS, best.candidate.n, best.candidate.threshold
        verdict.reason = (f"{best.candidate.label} is predicted {best.speedup:.2f}x plain decoding, interval "
                          f"{best.speedup_low:.2f}-{best.speedup_high:.2f}, above 1")
    elif best.speedup_high < 1.0:
        verdict.verdict, verdict.n = LOSES, 0
        verdict.reason = (f"the fastest draft length, {best.candidate.label}, is predicted {best.speedup:.2f}x plain "
                          f"decoding, interval {best.speedup_low:.2f}-{best.speedup_high:.2f}, below 1")
    else:
        verdict.verdict = UNDECIDED
        if best.speedup > 1.0:
            verdict.n, verdict.threshold = best.candidate.n, best.candidate.threshold
        verdict.reason = (f"{best.candidate.label} is predicted {best.speedup:.2f}x plain decoding, but its interval "
                          f"{best.speedup_low:.2f}-{best.speedup_high:.2f} contains 1: measure more repeats or "
                          "more prompts to decide")


def decide(runs: list, profile: EngineProfile, concurrencies: Sequence[int], contexts: Sequence[int],
           run_names: Sequence[str] = (), thresholds: bool = False) -> VerdictPlan:
    """A verdict per (concurrency, context) from eval runs (evaluation.EvalRun) and an engine profile; `thresholds`:
    whether the engine cuts a drafted block at a confidence threshold (then those candidates are judged too)."""
    profile.check_covers(list(concurrencies), list(contexts), profile.source)
    block = max(run.settings["block_size"] for run in runs)
    if block != profile.block_size:
        raise DsparkError(f"the runs drafted blocks of {block} tokens but the engine profile {profile.source} was "
                          f"measured with a draft of block size {profile.block_size}; give runs and a profile of "
                          "the same draft.")
    results = [result for run in runs if run.settings["block_size"] == block for result in run.results]
    positioned = positioned_rounds(results)
    has_logits = all(r.logits is not None for rounds in positioned for _, r in rounds)
    notes = []
    if not has_logits:
        notes.append("the runs carry no raw confidence logits: only fixed draft lengths are planned.")
    if any(run.settings.get("confidence_threshold") is not None for run in runs):
        notes.append("the runs were cut by a confidence threshold, so longer verification than recorded is censored "
                     "(a lower bound); plan runs without the confidence-threshold option.")
    if len(profile.draft_ns) == 1:
        notes.append(f"the profile measured one draft length ({profile.draft_ns[0]}): the draft's cost at other "
                     "lengths is taken as the same; profile a second server drafting fewer tokens to price it.")
    candidates = candidates_for(block, has_logits, thresholds)
    verdicts = []
    for context, bucket in zip(contexts, context_buckets(contexts)):
        prompts = rounds_in_bucket(positioned, bucket)
        rounds = sum(len(p) for p in prompts)
        enough = rounds >= MIN_ROUNDS and len(prompts) >= MIN_PROMPTS
        replayed = {c: replayed_tau(prompts, c) for c in candidates} if enough else {}
        for requests in concurrencies:
            plain = profile.plain_ms(requests, context)
            median_plain = statistics.median(plain)
            drafts = {n: statistics.median(profile.draft_ms(requests, n, context, i) for i in range(profile.repeats))
                      for n in profile.draft_ns}
            verdict = Verdict(requests, context, bucket, rounds, len(prompts), median_plain,
                              1000.0 * requests / median_plain, drafts)
            if not enough:
                verdict.reason = (f"the runs hold {rounds} rounds from {len(prompts)} prompts at contexts "
                                  f"{_range(bucket)}; at least {MIN_ROUNDS} rounds from {MIN_PROMPTS} prompts are "
                                  "needed: evaluate prompts that reach this context")
            else:
                judge(verdict, [predict(profile, replayed[c], c, requests, context) for c in candidates])
            verdicts.append(verdict)
    return VerdictPlan(list(run_names), profile, block, verdicts, notes)


def check_pair(runs: list, profile: EngineProfile, other_pair: bool) -> list[str]:
    """Notes when the profile's model files were converted from the runs' target and draft folders (their
    fingerprints, recorded by dspark convert); DsparkError otherwise, unless `other_pair` (then a note says so)."""
    notes = []
    for role in ("target", "draft"):
        recorded = getattr(profile, role).source
        for folder in sorted({str(run.settings.get(role)) for run in runs}):
            actual = folder_fingerprint(folder)
            if recorded is not None and recorded == actual:
                continue
            if recorded is None:
                problem = (f"its {role} file {getattr(profile, role).path} records no source folder (not written "
                           f"by `dspark convert`), so it cannot be matched to the runs' {role} {folder}")
            elif actual is None:
                problem = f"the runs' {role} {folder} is not a local checkpoint folder to compare with"
            else:
                problem = (f"its {role} file {getattr(profile, role).path} was converted from another folder than "
                           f"the runs' {role} {folder}")
            if not other_pair:
                raise DsparkError(f"the engine profile {profile.source} cannot be used for these runs: {problem}; "
                                  "profile this pair's engine with `dspark bench engine`, or pass the other-pair "
                                  "option to plan with it anyway.")
            notes.append(f"planned with another pair's engine profile: {problem}.")
    return notes


def _range(bucket: tuple[float, float]) -> str:
    high = "and above" if math.isinf(bucket[1]) else f"to {bucket[1]:.0f}"
    return f"{bucket[0]:.0f} {high}"
