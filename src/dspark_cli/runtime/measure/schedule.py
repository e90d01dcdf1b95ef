"""The verify budget at concurrency C (`dspark plan --concurrency`): an eval run's recorded rounds replayed through
the engines' batch schedulers.

    rows = [simulate(prompts, s, 8, read_cost_table(path), temperatures) for s in schedulers_for(names, block, True)]

C requests run at a time; each walks its prompt's recorded rounds in order, and when one finishes the next prompt
joins (survival 1, no history). Each step the scheduler chooses ℓ_r draft tokens per active request; round r then
emits min(ℓ_r, a_r) + 1 (replay.replay_round: exact per round, censored past a fully accepted shorter record) and
the step costs the run's mean draft + Markov + bookkeeping seconds of the active rounds plus cost.seconds(C,
Σ(ℓ_r + 1)). Estimates: the block order after a different commit (a real run's rounds would start elsewhere), the
draft time of a batched draft pass (the batch-1 record), and the cost table. Deterministic.

Survival of position j: s_j = Π_{i<=j} sigmoid(l_i / T_i), STS applied to each logit before the product. Candidates
(request r, position j) are ranked by survival, ties by position then request. With budget n (draft tokens beyond
each request's floor), Θ(n) = τ(n) / T(R, R·(1 + floor) + n), τ(n) = R + the floor's survivals + the top n others:

- paper (DSpark Algorithm 1; from the brief): current confidences, admit while Θ grows, stop at the first
  non-improving candidate.
- paper-production (the paper's production variant; from the brief): the budget from confidences two steps old
  (lag 2), global argmax (no early stop), the top-n allocation on the current ones.
- sglang (python/sglang/srt/speculative/dspark_components/dspark_planner.py, verified): `compute_verify_token_budget`
  takes the global argmax of Θ (first on ties) over n = 0..all, floor 0 (`min_verify_len` 1 counts the anchor),
  from survivals `SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS` (default 2) steps old, requests newer than that at 1
  (`_two_steps_prior_survival`); `schedule_verify_lens_topk_from_survival` allocates the budget on the current
  survivals (python/sglang/kernels/ops/speculative/dspark/dspark_schedule.py). SGLang also drops candidates
  below 1e-6; not here.
- trtllm (a TensorRT-LLM fork's `plan_dynamic_verifier_budget`, read: argmax preferring the larger budget on ties,
  the full block kept unless the best Θ >= Θ(full)·(1 + minimum_predicted_gain), current confidences inside the
  draft graph, so lag 0); the floor of one draft token per request comes from the brief.
- vllm (`enable_adaptive_verification`; from the brief): τ / (draft seconds + verify seconds), raw confidences even
  with an STS file, lag 1.
- fixed-k: ℓ = k. threshold: ℓ = the positions whose raw survival >= X (vLLM's dspark_confidence_threshold).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.measure import replay
from dspark_cli.runtime.measure.costs import CostTable
from dspark_cli.runtime.measure.replay import Round, replay_round
from dspark_cli.runtime.rounds import scored_length, sigmoid

SCHEDULERS = ("paper", "paper-production", "sglang", "trtllm", "vllm", "fixed-k", "threshold")
CONFIDENCE_SCHEDULERS = SCHEDULERS[:5]
THRESHOLDS = tuple(round(0.1 * i, 1) for i in range(1, 10))
SGLANG_LAG = 2  # SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS = EnvInt(2) in python/sglang/srt/environ.py
SGLANG_SETTING = ("SGLang: SGLANG_RAGGED_VERIFY_MODE=compact; ServerArgs speculative_dspark_sps_table_path = TABLE, "
                  "speculative_dspark_confidence_sts_path = STS")


@dataclass(frozen=True)
class Scheduler:
    name: str
    rule: str  # "early-stop", "argmax", "fallback" (TensorRT-LLM), "fixed" or "threshold"
    lag: int = 0
    floor: int = 0  # draft tokens every request verifies before the rest compete
    calibrated: bool = True  # STS temperatures applied, when given
    with_draft: bool = False  # the draft's seconds in Θ's denominator (vLLM)
    value: float = 0.0  # k or X
    setting: str = ""

    @property
    def label(self) -> str:
        if self.rule == "fixed":
            return f"fixed k = {int(self.value)}"
        if self.rule == "threshold":
            return f"threshold {self.value:g}"
        return self.name


def schedulers_for(names: Sequence[str], block: int) -> list[Scheduler]:
    """The schedulers named (SCHEDULERS), fixed-k for k = 1..block and threshold for X in THRESHOLDS."""
    table = {
        "paper": [Scheduler("paper", "early-stop", setting="none: the paper's Algorithm 1 (no engine runs it)")],
        "paper-production": [Scheduler("paper-production", "argmax", lag=2, setting=SGLANG_SETTING)],
        "sglang": [Scheduler("sglang", "argmax", lag=SGLANG_LAG, setting=SGLANG_SETTING)],
        "trtllm": [Scheduler("trtllm", "fallback", floor=1, setting="TensorRT-LLM: enable_confidence_scheduling, "
                             "confidence_sps_table_path TABLE, confidence_sts_path STS")],
        "vllm": [Scheduler("vllm", "argmax", lag=1, calibrated=False, with_draft=True,
                           setting="vLLM: enable_adaptive_verification (no STS file)")],
        "fixed-k": [Scheduler("fixed-k", "fixed", value=k, setting=f"any engine: num_speculative_tokens = {k}")
                    for k in range(1, block + 1)],
        "threshold": [Scheduler("threshold", "threshold", calibrated=False, value=x, setting="vLLM: "
                                f"num_speculative_tokens = {block}, dspark_confidence_threshold = {x:g}")
                      for x in THRESHOLDS],
    }
    return [s for name in SCHEDULERS if name in names for s in table[name]]


def survivals(logits: Sequence[float], temperatures: Sequence[float] | None) -> list[float]:
    """s_j = Π_{i<=j} sigmoid(l_i / T_i): STS on each logit, then the cumulative product."""
    out, s = [], 1.0
    for j, logit in enumerate(logits):
        s *= sigmoid(logit / (temperatures[j] if temperatures else 1.0))
        out.append(s)
    return out


def ranked(rows: list[list[float]], floor: int) -> list[tuple[float, int, int]]:
    """(survival, position, request) of the candidates past each request's floor: survival descending, then
    position, then request (SGLang's and TensorRT-LLM's tie order)."""
    order = sorted((-s, j, r) for r, row in enumerate(rows) for j, s in enumerate(row) if j >= floor)
    return [(-s, j, r) for s, j, r in order]


def thetas(rows: list[list[float]], floor: int, cost: CostTable, draft_s: float) -> list[float]:
    """Θ(n) for n = 0..all candidates past the floors."""
    requests = len(rows)
    tau = requests + sum(s for row in rows for s in row[:floor])
    base = sum(1 + min(floor, len(row)) for row in rows)
    out = [tau / (draft_s + cost.seconds(requests, base))]
    for n, (s, _, _) in enumerate(ranked(rows, floor), start=1):
        tau += s
        out.append(tau / (draft_s + cost.seconds(requests, base + n)))
    return out


def budget(scheduler: Scheduler, rows: list[list[float]], cost: CostTable, draft_s: float) -> int:
    """The draft tokens past the floors that the scheduler verifies this step."""
    theta = thetas(rows, scheduler.floor, cost, draft_s if scheduler.with_draft else 0.0)
    if scheduler.rule == "early-stop":
        return next((n for n in range(len(theta) - 1) if theta[n + 1] <= theta[n]), len(theta) - 1)
    if scheduler.rule == "argmax":
        return theta.index(max(theta))
    best = len(theta) - 1 - theta[::-1].index(max(theta))  # TensorRT-LLM: the larger budget on ties
    gain = getattr(cost, "minimum_predicted_gain", 0.0)
    return best if theta[best] >= theta[-1] * (1.0 + gain) else len(theta) - 1


def allocate(rows: list[list[float]], n: int, floor: int) -> list[int]:
    """ℓ_r: the floor plus request r's share of the top n candidates (a prefix: survival never increases)."""
    lengths = [min(floor, len(row)) for row in rows]
    for _, _, r in ranked(rows, floor)[:n]:
        lengths[r] += 1
    return lengths


def verify_lengths(scheduler: Scheduler, current: list[Round], lagged: list[Round | None], cost: CostTable,
                   temperatures: Sequence[float] | None = None, draft_s: float = 0.0) -> list[int]:
    """ℓ_r for each active request, from this step's rounds and the rounds `scheduler.lag` steps before (None: the
    request is newer than that, survival 1)."""
    if scheduler.rule == "fixed":
        return [min(int(scheduler.value), r.drafted) for r in current]
    if scheduler.rule == "threshold":
        return [scored_length([sigmoid(l) for l in r.logits], scheduler.value) for r in current]
    temps = temperatures if scheduler.calibrated else None
    now = [survivals(r.logits, temps) for r in current]
    then = [survivals(old.logits, temps) if old else [1.0] * r.drafted for r, old in zip(current, lagged)]
    return allocate(now, budget(scheduler, then, cost, draft_s), scheduler.floor)


@dataclass
class _Walk:
    """One request walking its prompt's recorded rounds."""

    rounds: list[Round]
    step: int = 0
    emitted: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class LoadRow:
    scheduler: Scheduler
    concurrency: int
    tokens_per_s: float  # all requests
    per_request_tokens_per_s: float  # mean over requests of its tokens / the seconds of the steps it was in
    verify_tokens_per_step: float  # Σ(ℓ_r + 1) per step
    tau: float  # tokens per request-round
    censored_rounds: int
    steps: int

    def to_dict(self) -> dict:
        return {"scheduler": self.scheduler.name, "label": self.scheduler.label, "value": self.scheduler.value,
                "lag": self.scheduler.lag, "floor": self.scheduler.floor, "concurrency": self.concurrency,
                "tokens_per_s": self.tokens_per_s, "per_request_tokens_per_s": self.per_request_tokens_per_s,
                "verify_tokens_per_step": self.verify_tokens_per_step, "tau": self.tau,
                "censored_rounds": self.censored_rounds, "steps": self.steps, "setting": self.scheduler.setting}


def simulate(prompts: list[list[Round]], scheduler: Scheduler, concurrency: int, cost: CostTable,
             temperatures: Sequence[float] | None = None) -> LoadRow:
    """The prompts' rounds at `concurrency` requests at a time under `scheduler` (module docstring)."""
    waiting, active, done = deque(_Walk(list(p)) for p in prompts if p), [], []
    steps = tokens = censored = 0
    seconds = 0.0
    while waiting or active:
        while waiting and len(active) < concurrency:
            active.append(waiting.popleft())
        step_s, step_tokens, step_censored = _step(active, scheduler, cost, temperatures)
        steps, tokens, censored, seconds = steps + 1, tokens + step_tokens, censored + step_censored, seconds + step_s
        done += [w for w in active if w.step == len(w.rounds)]
        active = [w for w in active if w.step < len(w.rounds)]
    emitted = sum(w.emitted for w in done)
    return LoadRow(scheduler, concurrency, emitted / seconds, sum(w.emitted / w.seconds for w in done) / len(done),
                   tokens / steps, emitted / sum(len(w.rounds) for w in done), censored, steps)


def _step(active: list[_Walk], scheduler: Scheduler, cost: CostTable,
          temperatures: Sequence[float] | None) -> tuple[float, int, int]:
    """One verify step of the active requests: (seconds, tokens scored, censored rounds); advances each walk."""
    current = [w.rounds[w.step] for w in active]
    lagged = [w.rounds[w.step - scheduler.lag] if w.step >= scheduler.lag else None for w in active]
    draft_s = sum(r.overhead_s for r in current) / len(current)
    lengths = verify_lengths(scheduler, current, lagged, cost, temperatures, draft_s)
    outcomes = [replay_round(r, n) for r, n in zip(current, lengths)]
    tokens = sum(o.verified + 1 for o in outcomes)
    step_s = draft_s + cost.seconds(len(active), tokens)
    for walk, outcome in zip(active, outcomes):
        walk.emitted += outcome.emitted
        walk.seconds += step_s
        walk.step += 1
    return step_s, tokens, sum(o.censored for o in outcomes)


@dataclass
class LoadPlan:
    """`dspark plan --concurrency`: one list of rows per concurrency."""

    runs: list[str]
    block_size: int
    costs_source: str
    costs_kind: str
    calibration_source: str | None
    loads: dict[int, list[LoadRow]]
    notes: list[str]

    def to_dict(self) -> dict:
        return {"format": LOAD_FORMAT, "runs": self.runs, "block_size": self.block_size, "costs": self.costs_source,
                "costs_kind": self.costs_kind, "calibration": self.calibration_source,
                "exact": "per round: the tokens a chosen verify length emits (censored rounds: a lower bound)",
                "estimates": ESTIMATES,
                "loads": [{"concurrency": c, "best": max(rows, key=lambda r: r.tokens_per_s).to_dict(),
                           "rows": [row.to_dict() for row in rows]} for c, rows in self.loads.items()],
                "notes": self.notes}


LOAD_FORMAT = "dspark-plan-load/1"
ESTIMATES = ("the order of blocks after a different commit (the recorded rounds are walked as recorded), the draft "
             "time of a batched draft pass (the batch-1 record), and the cost table")


def plan_loads(runs: list, cost: CostTable, concurrencies: Sequence[int], names: Sequence[str],
               temperatures: Sequence[float] | None = None) -> tuple[int, dict[int, list[LoadRow]], list[str]]:
    """(block size, rows per concurrency, notes) for eval runs (evaluation.EvalRun): the runs of the largest block
    size are replayed under each scheduler named."""
    block = max(run.settings["block_size"] for run in runs)
    prompts = [replay.rounds_of_result(result) for run in runs if run.settings["block_size"] == block
               for result in run.results]
    if not any(prompts):
        raise DsparkError("the runs hold no rounds to replay; run `dspark eval` with the json option on some "
                          "prompts first.")
    if cost.batch_one and max(concurrencies) > 1:
        raise DsparkError(f"the {cost.kind} times one request per step; give an SGLang or TensorRT-LLM cost table "
                          "measured at the batch sizes of the concurrency option.")
    if temperatures is not None and len(temperatures) < block:
        raise DsparkError(f"the calibration has {len(temperatures)} temperatures but the runs' block has {block} "
                          "positions; calibrate runs of this block size.")
    notes = _load_notes(runs, prompts, cost, max(concurrencies) * (block + 1))
    has_logits = all(r.logits is not None for rounds in prompts for r in rounds)
    chosen = [s for s in schedulers_for(names, block) if has_logits or s.rule == "fixed"]
    loads = {c: [simulate(prompts, s, c, cost, temperatures) for s in chosen] for c in concurrencies}
    return block, loads, notes


def _load_notes(runs: list, prompts: list[list[Round]], cost: CostTable, most_tokens: int) -> list[str]:
    notes = []
    if not all(r.logits is not None for rounds in prompts for r in rounds):
        notes.append("the runs carry no raw confidence logits: only the fixed-k scheduler can be replayed.")
    if any(run.settings.get("confidence_threshold") is not None for run in runs):
        notes.append("the runs were cut by a confidence threshold, so longer verification than recorded is censored "
                     "(a lower bound); replay runs without the confidence-threshold option.")
    if cost.largest_probe < most_tokens:
        notes.append(f"the cost table's largest probe is {cost.largest_probe} tokens, but a step may score up to "
                     f"{most_tokens}: longer steps cost as much as the largest probe (an underestimate).")
    return notes
