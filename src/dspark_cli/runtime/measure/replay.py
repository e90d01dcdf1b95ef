"""The verify budget from an eval run (`dspark plan`): the recorded rounds re-scored offline under other rules.

    block, rows, notes = replay_runs(runs, costs=read_costs(path), temperatures=load_temperatures(sts))
    best = recommend(rows)                        # the row with the highest predicted tokens/s (vLLM's rules only)

Every recorded round drafted N tokens and the target verified the first `proposed` of them, accepting `accepted`.
A rule that verifies n tokens of the same round instead (a fixed verify length k: n = min(k, N); a confidence threshold:
n = speculative.scored_length(c, X, rule), with c_j = sigmoid(l_j / T_j) from the recorded raw logits) would have
accepted min(accepted, n) tokens and committed one more (the correction or bonus), both **exact** for that round:
acceptance at position j depends only on the target's and the draft's distributions there (greedy: the argmax match;
T > 0: that position's own uniform draw), never on how many later positions were verified. Two cases cannot be
replayed from the record: n > proposed after a round that accepted all it verified (the outcome of the unverified
positions is unknown: such rounds are replayed at n = proposed and counted as `censored`, a lower bound), and
n >= accepted in a round that ended on an accepted stop token (it commits `accepted` and ends, as recorded).

Estimates, not exact: τ of a whole run under the rule (after a different round the next one starts elsewhere, so a
real run's rounds differ); a real `--block-size k` run (the draft's block attends bidirectionally, so a k-slot block
drafts slightly different tokens than the first k slots of an N-slot one); and the predicted tokens/s, which adds the
run's own draft, Markov and bookkeeping time per round to the cost of a target pass over n + 1 tokens (a measured
table, `dspark bench verify`), at batch 1 with prefill left out.

Runs of smaller block sizes on the same prompts, given beside the full-block ones, are not replayed but measured:
each block size k gets a row "block k (measured)" with the run's own τ and, with a cost table, its tokens/s; it
stands in for the replayed "verify k = k" row when the recommendation is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.io.reading import read_json_file
from dspark_cli.runtime.measure.costs import batch_one_ms
from dspark_cli.runtime.measure.evaluation import bootstrap_ratio
from dspark_cli.runtime.measure.run_file import finite_logits, round_place
from dspark_cli.runtime.rounds import scored_length, sigmoid

PLAN_FORMAT = "dspark-plan/1"
VERDICT_PLAN_FORMAT = "dspark-plan-verdict/1"  # verdict.py writes it: a plan from an engine's cost profile
COSTS_FORMAT = "dspark-verify-costs/1"
THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 .. 0.95
VLLM_RULES = ("fixed", "measured", "survival")  # what vLLM's speculative config can express: num_speculative_tokens
# (replayed or measured at that block size), a survival cut
MAX_COSTS_BYTES = 1024 * 1024
MAX_PLAN_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Round:
    """One recorded round: raw confidence logits [N] (None without a head), verified (= proposed), accepted,
    whether it ended on an accepted stop token, and its measured draft + Markov + bookkeeping seconds."""

    logits: tuple[float, ...] | None
    drafted: int
    verified: int
    accepted: int
    stop: bool
    overhead_s: float


@dataclass(frozen=True)
class Outcome:
    verified: int  # n: draft tokens the target scores (it scores n + 1 tokens with the anchor)
    accepted: int
    emitted: int
    censored: bool  # the rule verifies past what was recorded after a fully accepted prefix


def replay_round(r: Round, n: int) -> Outcome:
    """The round re-scored with n verified draft tokens (see the module docstring for what is exact)."""
    n = max(0, min(n, r.drafted))
    censored = n > r.verified and r.accepted == r.verified and not r.stop
    if censored:
        n = r.verified
    accepted = min(r.accepted, n)
    if r.stop and n >= r.accepted:
        return Outcome(n, accepted, accepted, False)  # the accepted stop token ends the round and generation
    return Outcome(n, accepted, accepted + 1, censored)


@dataclass(frozen=True)
class Rule:
    kind: str  # "fixed", "measured" (a run of block size k, as recorded), "survival" or "per-slot"
    value: float  # k for fixed and measured, the threshold X otherwise
    calibrated: bool = False

    @property
    def label(self) -> str:
        if self.kind == "fixed":
            return f"verify k = {int(self.value)}"
        if self.kind == "measured":
            return f"block {int(self.value)} (measured)"
        return f"{self.kind} >= {self.value:g}" + (" (STS)" if self.calibrated else "")

    def verify_length(self, r: Round, temperatures: Sequence[float] | None) -> int:
        if self.kind == "fixed":
            return int(self.value)
        if self.kind == "measured":
            return r.verified
        temps = temperatures if self.calibrated else None
        confidences = [sigmoid(l / (temps[j] if temps else 1.0)) for j, l in enumerate(r.logits)]
        return scored_length(confidences, self.value, self.kind)


@dataclass
class Row:
    rule: Rule
    tau: float | None
    tau_ci: list[float | None]
    accepted_per_round: float | None
    verified_per_round: float | None  # tokens the target scores per round, the anchor included (n + 1)
    censored_rounds: int
    rounds: int
    tokens_per_s: float | None = None
    round_ms: float | None = None

    def to_dict(self) -> dict:
        return {"rule": self.rule.kind, "value": self.rule.value, "calibrated": self.rule.calibrated,
                "label": self.rule.label, "tau": self.tau, "tau_ci": self.tau_ci,
                "accepted_per_round": self.accepted_per_round, "verified_per_round": self.verified_per_round,
                "censored_rounds": self.censored_rounds, "rounds": self.rounds, "per_round": "exact" if
                not self.censored_rounds else "lower bound (censored rounds)", "tokens_per_s": self.tokens_per_s,
                "round_ms": self.round_ms}


def rounds_of_result(result, source: str = "the run") -> list[Round]:
    """A PromptResult's rounds as Rounds (DsparkError naming the round for a NaN or infinite logit)."""
    rounds = []
    for number, r in enumerate(result.rounds):
        logits = finite_logits(r, round_place(source, result, number))
        overhead = sum(r.get(key, 0.0) for key in ("draft_backbone", "markov", "other"))
        rounds.append(Round(None if logits is None else tuple(logits), r["drafted"], r["proposed"], r["accepted"],
                            r["emitted"] == r["accepted"], overhead))
    return rounds


def replay(prompts: list[list[Round]], rule: Rule, temperatures: Sequence[float] | None = None,
           costs: dict[int, float] | None = None) -> Row:
    """One rule over every round of every prompt; τ's interval is the bootstrap over prompts eval uses."""
    emitted, counts, accepted, verified, censored, seconds = [], [], 0, 0, 0, 0.0
    for rounds in prompts:
        total = 0
        for r in rounds:
            outcome = replay_round(r, rule.verify_length(r, temperatures))
            total += outcome.emitted
            accepted += outcome.accepted
            verified += outcome.verified + 1
            censored += outcome.censored
            if costs is not None:
                seconds += r.overhead_s + costs[outcome.verified + 1] / 1000.0
        emitted.append(float(total))
        counts.append(float(len(rounds)))
    rounds_total = int(sum(counts))
    tau = bootstrap_ratio(emitted, counts)
    row = Row(rule, tau.estimate, [tau.low, tau.high], accepted / rounds_total if rounds_total else None,
              verified / rounds_total if rounds_total else None, censored, rounds_total)
    if costs is not None and seconds > 0:
        row.tokens_per_s = sum(emitted) / seconds
        row.round_ms = 1000.0 * seconds / rounds_total
    return row


def rules_for(block_size: int, has_logits: bool, calibrated: bool) -> list[Rule]:
    rules = [Rule("fixed", k) for k in range(1, block_size + 1)]
    if has_logits:
        for sts in (False, True) if calibrated else (False,):
            rules += [Rule(kind, x, sts) for kind in ("survival", "per-slot") for x in THRESHOLDS]
    return rules


def replay_runs(runs: list, costs: dict[int, float] | None = None,
                temperatures: Sequence[float] | None = None) -> tuple[int, list[Row], list[str]]:
    """(block size, one Row per rule, notes) over eval runs (evaluation.EvalRun): the runs of the largest block size
    are replayed; runs of each smaller block size on the same prompts give a measured row."""
    by_block: dict[int, list] = {}
    for run in runs:
        by_block.setdefault(run.settings["block_size"], []).append(run)
    block = max(by_block)
    base = by_block.pop(block)
    prompts = [rounds_of_result(result, run.source) for run in base for result in run.results]
    if not any(prompts):
        raise DsparkError("the runs hold no rounds to replay; run `dspark eval` with the json option on some prompts first.")
    has_logits = all(r.logits is not None for rounds in prompts for r in rounds)
    if temperatures is not None and len(temperatures) < block:
        raise DsparkError(f"the calibration has {len(temperatures)} temperatures but the runs' block has {block} "
                          "positions; calibrate runs of this block size.")
    if costs is not None:
        missing = [t for t in range(1, block + 2) if t not in costs]
        if missing:
            raise DsparkError(f"the verify-cost table has no time for a pass over {missing[0]} tokens; the replay "
                              f"needs 1 to {block + 1} (`dspark bench verify` with the tokens option {block + 1}).")
    notes = []
    if not has_logits:
        notes.append("the runs carry no raw confidence logits (no confidence head, or an older run file): only fixed "
                     "verify lengths are replayed.")
    if any(run.settings.get("confidence_threshold") is not None for run in base):
        notes.append("the runs were cut by a confidence threshold, so longer verification than recorded is censored "
                     "(a lower bound); replay runs without the confidence-threshold option.")
    rules = rules_for(block, has_logits, temperatures is not None)
    rows = [replay(prompts, rule, temperatures, costs) for rule in rules]
    for k, measured in sorted(by_block.items()):
        rows.append(replay(_measured_prompts(measured, base, k, block), Rule("measured", k), costs=costs))
    return block, rows, notes


# What a block-k run must share with the full-block runs to stand in for k (the pair as given, the sampling, the
# length rule's inputs, the prompts' template); the block size, device and timings may differ.
SAME_RUN_SETTINGS = ("target", "draft", "temperature", "top_p", "top_k", "max_new_tokens", "chat", "thinking",
                     "seed", "dtype")


def _setting(run, key: str):
    """A run's setting for comparison; paths compared as paths (a trailing slash is the same folder)."""
    value = run.settings.get(key)
    return str(Path(value)) if key in ("target", "draft") and isinstance(value, str) else value


def _measured_prompts(measured: list, base: list, k: int, block: int) -> list[list[Round]]:
    """The rounds of the block-k runs, checked to be fixed-block runs of the base runs' prompts."""
    if any(run.settings.get("confidence_threshold") is not None for run in measured):
        raise DsparkError(f"the runs of block size {k} cut verification with a confidence threshold; give runs of "
                          f"`dspark eval` with the block-size option {k} and without the confidence-threshold option "
                          f"to measure block {k}.")
    for key in SAME_RUN_SETTINGS:
        ours = {_setting(run, key) for run in base}
        theirs = {_setting(run, key) for run in measured}
        if ours != theirs:
            raise DsparkError(f"the runs of block size {k} were made with {key} {sorted(theirs, key=str)} and the "
                              f"block-{block} runs with {sorted(ours, key=str)}; a measured block stands in only for "
                              "the same pair, sampling and length: run `dspark eval` with the block-size option "
                              f"{k} and the block-{block} runs' other settings.")
    keys = {(r.set_name, r.index, r.prompt) for run in measured for r in run.results}
    base_keys = {(r.set_name, r.index, r.prompt) for run in base for r in run.results}
    if keys != base_keys:
        raise DsparkError(f"the runs of block size {k} hold other prompts than the block-{block} runs "
                          f"({len(keys)} against {len(base_keys)}, {len(keys ^ base_keys)} not in both); run "
                          f"`dspark eval` with the block-size option {k} on the same prompt sets and settings.")
    return [rounds_of_result(result, run.source) for run in measured for result in run.results]


def recommend(rows: list[Row], kinds: Sequence[str] = VLLM_RULES) -> Row | None:
    """The row vLLM can deploy (a fixed verify length, a measured block size, or an uncalibrated survival threshold;
    `kinds` narrows it) with the highest predicted tokens/s; a measured block k stands in for the replayed k. None
    without a cost table."""
    measured = {row.rule.value for row in rows if row.rule.kind == "measured"}
    usable = [row for row in rows if row.tokens_per_s is not None and row.rule.kind in kinds
              and not row.rule.calibrated and not (row.rule.kind == "fixed" and row.rule.value in measured)]
    return max(usable, key=lambda row: row.tokens_per_s, default=None)


def recommendation_notes(row: Row | None, block_size: int) -> list[str]:
    """A note when the recommendation is a fixed k below the recorded block: its τ is an estimate (see the module
    docstring) that the deployed k-slot draft can miss, so it should be measured before it is served."""
    if row is None or row.rule.kind != "fixed" or row.rule.value >= block_size:
        return []
    k = int(row.rule.value)
    return [f"k = {k} replays the first {k} slots of the recorded {block_size}-slot blocks; served with "
            f"num_speculative_tokens = {k}, the draft drafts {k}-slot blocks of its own, whose τ differs (on the demo "
            f"pair 5% higher at k = 3); measure it: run `dspark eval` with the block-size option {k} on the same prompts and give "
            "that run to `dspark plan` as well."]


def speculative_fields(row: Row, block_size: int) -> dict:
    """The `vllm serve --speculative-config` fields of a recommendation: a fixed or measured k drafts k tokens; a
    survival threshold drafts the block and verifies the positions whose survival >= X (dspark_confidence_threshold)."""
    if row.rule.kind in ("fixed", "measured"):
        return {"num_speculative_tokens": int(row.rule.value)}
    return {"num_speculative_tokens": block_size, "dspark_confidence_threshold": row.rule.value}


def read_costs(path: Path) -> dict[int, float]:
    """tokens -> milliseconds of one target pass, from `dspark bench verify --json` or a user's table of the same
    shape ({"tokens": [1, 2, ...], "ms": [...]}). DsparkError in one sentence for anything else."""
    doc = read_json_file(path, "verify-cost table", MAX_COSTS_BYTES, "give the JSON of `dspark bench verify`")
    return batch_one_ms(doc, path)


@dataclass
class Plan:
    runs: list[str]
    block_size: int
    rows: list[Row]
    recommended: Row | None
    costs_source: str | None
    calibration_source: str | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        fields = None if self.recommended is None else speculative_fields(self.recommended, self.block_size)
        return {"format": PLAN_FORMAT, "runs": self.runs, "block_size": self.block_size,
                "costs": self.costs_source, "calibration": self.calibration_source,
                "recommended": None if self.recommended is None else self.recommended.to_dict(),
                "best_fixed": _row_dict(recommend(self.rows, ("fixed", "measured"))),
                "best_threshold": _row_dict(recommend(self.rows, ("survival",))),
                "speculative_config": fields, "rows": [row.to_dict() for row in self.rows], "notes": self.notes}


def _row_dict(row: Row | None) -> dict | None:
    return None if row is None else row.to_dict()


def read_plan_fields(path: Path) -> dict:
    """The speculative-config fields of a plan file (`dspark plan -o`), checked; DsparkError otherwise. A verdict
    plan (planned with an engine's cost profile) adds `engine` and `reason`, and may set num_speculative_tokens 0:
    do not speculate."""
    doc = read_json_file(path, "plan file", MAX_PLAN_BYTES, "give a file written by `dspark plan -o`")
    verdict = isinstance(doc, dict) and doc.get("format") == VERDICT_PLAN_FORMAT
    fields = doc.get("speculative_config") if isinstance(doc, dict) and (
        doc.get("format") == PLAN_FORMAT or verdict) else False
    if fields is None:
        raise DsparkError(f"{path} recommends nothing (planned without a verify-cost table, or for several loads); "
                          "run `dspark plan` with the costs option, and one concurrency and context for a verdict.")
    if not isinstance(fields, dict) or set(fields) - {"num_speculative_tokens", "dspark_confidence_threshold"}:
        raise DsparkError(f"{path} is not a plan of `dspark plan -o` ({PLAN_FORMAT}); give one.")
    k = fields.get("num_speculative_tokens")
    x = fields.get("dspark_confidence_threshold")
    if not isinstance(k, int) or isinstance(k, bool) or k < (0 if verdict else 1):
        raise DsparkError(f"{path}: speculative_config.num_speculative_tokens must be an integer >= "
                          f"{0 if verdict else 1}, not {k!r}.")
    if x is not None and not (isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= 1):
        raise DsparkError(f"{path}: speculative_config.dspark_confidence_threshold must be in (0, 1], not {x!r}.")
    if not verdict:
        return fields
    engine, verdicts = doc.get("engine"), doc.get("verdicts")
    reason = verdicts[0].get("reason") if isinstance(verdicts, list) and verdicts and isinstance(verdicts[0],
                                                                                                dict) else None
    if not isinstance(engine, str) or not isinstance(reason, str):
        raise DsparkError(f"{path}: a verdict plan needs its 'engine' and its verdict's 'reason'; write it again "
                          "with `dspark plan -o`.")
    return {**fields, "engine": engine, "reason": reason}
