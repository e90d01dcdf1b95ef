"""`dspark eval`'s library half: prompt sets, the per-prompt run loop, the run file, and the statistics.

    sets = [read_prompt_set(path, limit=8, seed=0) for path in paths]
    run = EvalRun(settings={...}, sets=sets)
    save = RunSaver(run, path)                      # saves as prompts finish, under 5% of the time
    for prompt_set in sets:
        run_set(run, prompt_set, generate_one, on_done=save)
    save.flush()
    rows = [set_statistics(run.results_of(s), block_size, max_new_tokens) for s in sets]

The conventions follow DeepSpec's evaluator (docs/eval.md): the first turn of each JSONL record, `--limit` takes
the first N prompts after a shuffle by random.Random(seed), prompt i of a set draws with seed + i, and the run
loop keeps going for one more round when exactly max_new_tokens are committed. τ's confidence interval is a
percentile bootstrap over prompts. Pure Python except where a caller's generate function brings torch.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.demo import DEMO_DIR
from dspark_cli.runtime.io.reading import parse_json_text, read_bounded_text
from dspark_cli.runtime.measure.run_file import RUN_FORMAT, RunFileError, read_run_document
from dspark_cli.runtime.measure.metrics import STAGE_SECTIONS, Calibration, round_dicts, stage_sections, summarize
from dspark_cli.runtime.rounds import GenerationStats, RoundRecord
from dspark_cli.runtime.settings import Requested

# Settings older run files lack, as the runs that wrote them used them: no calibration (before dspark-eval/2), and
# the sampling requests eval did not yet take (the library's defaults, settings.Requested).
OLDER_RUN_DEFAULTS = {"calibration": None, "draft_topk": Requested.draft_topk, "top_p": Requested.top_p,
                      "top_k": Requested.top_k}
SHIPPED_SETS = (DEMO_DIR / "eval_code.jsonl", DEMO_DIR / "eval_prose.jsonl")
MAX_PROMPT_SET_BYTES = 1024**3
SAVE_SPACING = 20  # RunSaver: at most 1/20 of the wall time spent saving
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20260501
CONFIDENCE_LEVEL = 0.95

# --- prompt sets ------------------------------------------------------------------------------------------------


@dataclass
class PromptSet:
    name: str  # the file's stem: one table row
    path: str
    prompts: list[str]


def read_prompt_set(path: Path, limit: int | None = None, seed: int = 0) -> PromptSet:
    """Prompts of a .jsonl file (DeepSpec's `turns` list, first turn used; or a `prompt` string; or a JSON
    string per line) or a .txt file (paragraphs separated by blank lines when it has any, else one per line).
    With `limit`, the first `limit` prompts after shuffling with random.Random(seed), as DeepSpec does."""
    path = Path(path)
    if path.suffix not in (".jsonl", ".txt"):
        raise DsparkError(f"{path}: use a .jsonl file (DeepSpec's eval_datasets layout) or a .txt file.")
    text = read_bounded_text(path, "prompt set", MAX_PROMPT_SET_BYTES)
    prompts = _jsonl_prompts(path, text) if path.suffix == ".jsonl" else _txt_prompts(text)
    if not prompts:
        raise DsparkError(f"{path} holds no prompts; give at least one.")
    if limit is not None and len(prompts) > limit:
        random.Random(seed).shuffle(prompts)
        prompts = prompts[:limit]
    return PromptSet(path.stem, str(path), prompts)


def _jsonl_prompts(path: Path, text: str) -> list[str]:
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        record = parse_json_text(line, f"{path} line {number}", "give one JSON record per line", invalid="is not JSON")
        prompt = prompt_of_record(record)
        if not isinstance(prompt, str) or not prompt:
            raise DsparkError(f"{path} line {number}: give an object with a non-empty 'turns' list of strings "
                              "(the first turn is used) or a 'prompt' string.")
        prompts.append(prompt)
    return prompts


def prompt_of_record(record: object) -> object:
    """The prompt a JSONL record holds: a JSON string, the first of DeepSpec's `turns`, or a `prompt` value
    (returned as found: the caller checks it is a non-empty string)."""
    if isinstance(record, dict):
        turns = record.get("turns")
        return turns[0] if isinstance(turns, list) and turns else record.get("prompt")
    return record


def _txt_prompts(text: str) -> list[str]:
    lines = text.splitlines()
    if any(not line.strip() for line in lines[:-1]) and len([line for line in lines if line.strip()]) > 1:
        paragraphs, current = [], []
        for line in lines + [""]:
            if line.strip():
                current.append(line)
            elif current:
                paragraphs.append("\n".join(current))
                current = []
        return paragraphs
    return [line for line in lines if line.strip()]


def encode_sets(pair, sets: list[PromptSet], chat: bool, thinking: bool | None,
                max_new_tokens: int) -> dict[tuple[str, int], list[int]]:
    """Token ids of every prompt, keyed (set name, index in set), with pair.encode (a pair.CheckedPair);
    DsparkError for a prompt that encodes to nothing or does not fit the target's context with its new tokens."""
    encoded = {}
    for prompt_set in sets:
        for index, text in enumerate(prompt_set.prompts):
            ids = pair.encode(text, chat, thinking)
            if not ids:
                raise DsparkError(f"prompt {index + 1} of {prompt_set.path} encodes to no tokens; remove it.")
            encoded[prompt_set.name, index] = ids
    for prompt_set in sets:
        pair.check_context([len(encoded[prompt_set.name, i]) for i in range(len(prompt_set.prompts))], max_new_tokens)
    return encoded


# --- one prompt's record and the run file -----------------------------------------------------------------------


@dataclass
class PromptResult:
    """What one prompt produced: enough to recompute every figure (the rounds are RoundRecord fields plus the
    round's five stages in seconds, metrics.stage_seconds)."""

    set_name: str
    index: int  # within its set; the prompt drew with seed + index
    prompt: str
    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    total_s: float
    rounds: list[dict]
    tokens: list[int]
    finished_by_stop: bool
    baseline: dict | None = None  # {"new_tokens", "ttft_s", "total_s", "tokens"} of plain decoding

    def stats(self) -> GenerationStats:
        records = [_round_record(r) for r in self.rounds]
        sections = [stage_sections(r) for r in self.rounds]
        return GenerationStats(self.prompt_tokens, self.new_tokens, self.ttft_s, self.total_s, records, sections)

    def baseline_stats(self) -> GenerationStats | None:
        if self.baseline is None:
            return None
        b = self.baseline
        return GenerationStats(self.prompt_tokens, b["new_tokens"], b["ttft_s"], b["total_s"], [])


def _round_record(round_: dict) -> RoundRecord:
    """A run file's round as a RoundRecord; confidences are set after the range check, as the loop records them
    (NaN from a broken head stays, and the report says why it cannot be scored)."""
    fields = {k: v for k, v in round_.items() if k not in STAGE_SECTIONS and k != "confidences"}
    record = RoundRecord(**fields)
    record.confidences = round_.get("confidences")
    return record


def prompt_result(set_name: str, index: int, prompt: str, result, baseline=None) -> PromptResult:
    """From speculative_generate's (and autoregressive_generate's) GenerationResult."""
    stats = result.stats
    plain = None
    if baseline is not None:
        plain = {"new_tokens": baseline.stats.new_tokens, "ttft_s": baseline.stats.ttft_s,
                 "total_s": baseline.stats.total_s, "tokens": baseline.tokens}
    return PromptResult(set_name, index, prompt, stats.prompt_tokens, stats.new_tokens, stats.ttft_s, stats.total_s,
                        round_dicts(stats), list(result.tokens), result.finished_by_stop, plain)


@dataclass
class EvalRun:
    """A run file: the settings, the prompt sets, and the finished prompts (in the order they finished)."""

    settings: dict
    sets: list[PromptSet]
    results: list[PromptResult] = field(default_factory=list)
    encoded: list[tuple[PromptResult, str]] = field(default_factory=list, init=False, repr=False, compare=False)
    # (result, its JSON line) as of the last save
    source: str = field(default="the run", compare=False)  # the file it was loaded from, for messages

    def key(self, set_name: str, index: int, prompt: str) -> tuple[str, int, str]:
        return set_name, index, prompt

    def finished(self) -> dict[tuple[str, int, str], PromptResult]:
        return {self.key(r.set_name, r.index, r.prompt): r for r in self.results}

    def results_of(self, prompt_set: PromptSet) -> list[PromptResult]:
        """The finished prompts of one set, in the set's order."""
        done = self.finished()
        keys = [self.key(prompt_set.name, i, p) for i, p in enumerate(prompt_set.prompts)]
        return [done[k] for k in keys if k in done]

    def to_dict(self, statistics: dict | None = None) -> dict:
        doc = {"format": RUN_FORMAT, "settings": self.settings, "sets": [asdict(s) for s in self.sets]}
        if statistics is not None:
            doc["statistics"] = statistics
        doc["results"] = [vars(r) for r in self.results]  # JSON-ready fields; asdict would deep-copy every round
        return doc

    def save(self, path: Path, statistics: dict | None = None, replace: bool = True) -> None:
        """Write the run file atomically, one result per line; with `replace` False exclusively (a file that exists
        is never replaced). A finished result never changes, so its line is encoded once and reused by later saves
        (re-encoding every result at every save made a long run's saving quadratic)."""
        from dspark_cli.runtime.io.outputs import atomic_write_text

        doc = self.to_dict(statistics)
        del doc["results"]
        head = json.dumps(doc, separators=(",", ":"))[:-1]  # the C encoder (no indent) is fast
        body = ",\n".join(self._encoded_results())
        atomic_write_text(Path(path), f'{head},\n"results":[\n{body}\n]}}\n', replace)

    def _encoded_results(self) -> list[str]:
        """The JSON line of every result, from the cache where the results are the same objects in the same
        order as at the last save (results are only appended), encoded anew from the first that is not."""
        cache = self.encoded
        same = 0
        while same < min(len(cache), len(self.results)) and cache[same][0] is self.results[same]:
            same += 1
        del cache[same:]
        cache += [(r, json.dumps(vars(r), separators=(",", ":"))) for r in self.results[same:]]
        return [line for _, line in cache]

    @classmethod
    def load(cls, path: Path) -> "EvalRun":
        """The run file at `path`, its schema checked (run_file.check_run_document): RunFileError names the first
        problem (the file, the key, what is wrong) in one sentence."""
        doc = read_run_document(Path(path))
        sets = [PromptSet(**s) for s in doc["sets"]]
        results = [PromptResult(**r) for r in doc["results"]]
        settings = {**OLDER_RUN_DEFAULTS, **doc["settings"]}
        run = cls(settings, sets, results, source=str(path))
        for result in results:
            try:
                result.stats()
            except ValueError as error:
                raise RunFileError(f"{path}: a round of prompt {result.index + 1} of {result.set_name} is not "
                                   f"consistent ({error}); fix the value or run the evaluation again.") from None
        return run


GenerateOne = Callable[[int, str], PromptResult]  # (index in set, prompt) -> its result


class RunSaver:
    """Saves a run file as prompts finish, keeping the time spent saving under 1 / SAVE_SPACING of the wall time:
    after a save that took s seconds the next one waits until SAVE_SPACING · s have passed (a small run saves after
    every prompt; a run file of hundreds of MB every few seconds). `flush` writes what is still unsaved (on Ctrl-C,
    on a failure); a process killed outright loses at most the prompts of the last interval."""

    def __init__(self, run: EvalRun, path: Path | None, replace: bool = True):
        self.run, self.path = run, path
        self.replace = replace  # False until the first save: a new run file is created exclusively (no --force)
        self.unsaved = False
        self.last_cost = 0.0  # seconds the last save took
        self.last_end = 0.0  # time.perf_counter() when it ended

    def _ours(self) -> bool:
        from dspark_cli.runtime.io.outputs import written_outputs

        return Path(self.path) in written_outputs()

    def __call__(self, _result=None) -> None:
        self.unsaved = True
        if time.perf_counter() - self.last_end >= SAVE_SPACING * self.last_cost:
            self.flush()

    def flush(self) -> None:
        if self.path is None or not self.unsaved:
            return
        start = time.perf_counter()
        try:
            self.run.save(self.path, replace=self.replace)
        finally:  # once this run has put its file in place (even if Ctrl-C came right after), later saves replace it
            self.replace = self.replace or self._ours()
        self.last_end = time.perf_counter()
        self.last_cost = self.last_end - start
        self.unsaved = False


def run_set(run: EvalRun, prompt_set: PromptSet, generate_one: GenerateOne,
            on_done: Callable[[PromptResult], None] | None = None) -> int:
    """Run the prompts of `prompt_set` that `run` has not finished; -> how many ran. on_done after each."""
    done = run.finished()
    ran = 0
    for index, prompt in enumerate(prompt_set.prompts):
        if run.key(prompt_set.name, index, prompt) in done:
            continue
        result = generate_one(index, prompt)
        run.results.append(result)
        ran += 1
        if on_done is not None:
            on_done(result)
    return ran


def pending_prompts(run: EvalRun, sets: list[PromptSet]) -> list[tuple[str, int, str]]:
    """(set name, index, prompt) of every prompt of `sets` that `run` has not finished, set by set in order."""
    done = run.finished()
    return [(s.name, i, p) for s in sets for i, p in enumerate(s.prompts) if run.key(s.name, i, p) not in done]


def shard(items: list, rank: int, world_size: int) -> list:
    """This rank's share of `items`: item i goes to rank i mod world_size (DeepSpec's evaluator), so the shares
    are disjoint, cover every item, and differ in length by at most one."""
    return items[rank::world_size]


# --- statistics -------------------------------------------------------------------------------------------------


@dataclass
class Interval:
    estimate: float | None
    low: float | None
    high: float | None


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 1]."""
    position = q * (len(sorted_values) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(sorted_values) - 1)
    return sorted_values[lower] + (sorted_values[upper] - sorted_values[lower]) * (position - lower)


def _interval(estimate: float | None, replicates: list[float], level: float) -> Interval:
    if estimate is None or not replicates:
        return Interval(estimate, None, None)
    replicates = sorted(replicates)
    tail = (1.0 - level) / 2
    return Interval(estimate, percentile(replicates, tail), percentile(replicates, 1.0 - tail))


def bootstrap_ratio(numerators: list[float], denominators: list[float], resamples: int = BOOTSTRAP_RESAMPLES,
                    seed: int = BOOTSTRAP_SEED, level: float = CONFIDENCE_LEVEL) -> Interval:
    """Σ numerators / Σ denominators (one pair per prompt) with a percentile bootstrap interval over prompts:
    resample prompts with replacement, recompute the pooled ratio. τ is such a ratio (emitted / rounds)."""
    total = sum(denominators)
    estimate = sum(numerators) / total if total else None
    rng = random.Random(seed)
    n = len(numerators)
    replicates = []
    for _ in range(resamples if n else 0):
        picks = [rng.randrange(n) for _ in range(n)]
        d = sum(denominators[i] for i in picks)
        if d:
            replicates.append(sum(numerators[i] for i in picks) / d)
    return _interval(estimate, replicates, level)


def bootstrap_ratio_difference(new: tuple[list[float], list[float]], old: tuple[list[float], list[float]],
                               paired: bool, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                               level: float = CONFIDENCE_LEVEL) -> Interval:
    """(pooled ratio of new) - (pooled ratio of old), each given as (numerators, denominators) per prompt.
    paired: the same prompts in the same order, resampled together; else each side resampled on its own."""
    def ratio(side, picks):
        d = sum(side[1][i] for i in picks)
        return sum(side[0][i] for i in picks) / d if d else None

    n_new, n_old = len(new[0]), len(old[0])
    if paired and n_new != n_old:
        raise ValueError("a paired comparison needs the same number of prompts on both sides")
    first, second = ratio(new, range(n_new)), ratio(old, range(n_old))
    estimate = None if first is None or second is None else first - second
    rng = random.Random(seed)
    replicates = []
    for _ in range(resamples if n_new and n_old else 0):
        picks_new = [rng.randrange(n_new) for _ in range(n_new)]
        picks_old = picks_new if paired else [rng.randrange(n_old) for _ in range(n_old)]
        a, b = ratio(new, picks_new), ratio(old, picks_old)
        if a is not None and b is not None:
            replicates.append(a - b)
    return _interval(estimate, replicates, level)


def position_weighted_mean(per_position: list[Calibration]) -> dict:
    """DeepSpec's summary of per-position calibration: each score averaged over positions weighted by their
    pair counts (AUROC over the positions where it is defined)."""
    def mean(name: str) -> float | None:
        pairs = [(getattr(c, name), c.count) for c in per_position if c.count and getattr(c, name) is not None]
        weight = sum(count for _, count in pairs)
        return sum(value * count for value, count in pairs) / weight if weight else None

    return {name: mean(name) for name in ("ece", "auroc", "brier", "mean_predicted", "observed_rate")}


def extra_rounds(result: PromptResult, max_new_tokens: int) -> int:
    """Rounds that started with max_new_tokens already committed (DeepSpec's one extra round; 0 or 1)."""
    committed = 1
    extra = 0
    for r in result.rounds:
        extra += committed >= max_new_tokens
        committed += r["emitted"]
    return extra


def set_statistics(results: list[PromptResult], block_size: int, max_new_tokens: int) -> dict:
    """Every figure of one prompt set (or of all sets pooled): summarize()'s Summary plus τ's interval, τ
    without DeepSpec's extra round, verify_rate, and calibration as DeepSpec summarises it."""
    baseline = [r.baseline_stats() for r in results]
    with_baseline = bool(results) and all(b is not None for b in baseline)
    summary = summarize([r.stats() for r in results], baseline if with_baseline else None, block_size).to_dict()
    emitted = [float(sum(r["emitted"] for r in p.rounds)) for p in results]
    rounds = [float(len(p.rounds)) for p in results]
    extra = [extra_rounds(p, max_new_tokens) for p in results]
    within_emitted = sum(sum(r["emitted"] for r in p.rounds[: len(p.rounds) - x]) for p, x in zip(results, extra))
    within_rounds = sum(rounds) - sum(extra)
    tau = bootstrap_ratio(emitted, rounds)
    proposed = sum(r["proposed"] for p in results for r in p.rounds)
    calibration = summary["calibration"]
    per_position_mean = None
    if calibration is not None:
        positions = [Calibration(**c) for c in calibration["survival_per_position"]]
        per_position_mean = position_weighted_mean(positions)
    return {
        "prompts": len(results),
        "tau": tau.estimate,
        "tau_ci": [tau.low, tau.high],
        "tau_within_limit": within_emitted / within_rounds if within_rounds else None,
        "extra_rounds": sum(extra),
        "verify_rate": sum(emitted) / (proposed + sum(rounds)) if rounds and sum(rounds) else None,
        "calibration_per_position_mean": per_position_mean,
        "summary": summary,
    }


def stats_tau_interval(stats: list[GenerationStats]) -> Interval:
    """τ of prompts' GenerationStats with its bootstrap interval over prompts (for `dspark generate --json`)."""
    emitted = [float(sum(r.emitted for r in s.rounds)) for s in stats]
    return bootstrap_ratio(emitted, [float(len(s.rounds)) for s in stats])


def tau_pairs(results: list[PromptResult]) -> tuple[list[float], list[float]]:
    """Per prompt (Σ emitted, rounds): τ's numerator and denominator."""
    return ([float(sum(r["emitted"] for r in p.rounds)) for p in results], [float(len(p.rounds)) for p in results])


def compare_tau(new: list[PromptResult], old: list[PromptResult]) -> dict:
    """τ(new) - τ(old) with a bootstrap interval: paired by prompt when both ran the same prompts in the same
    order, unpaired otherwise. Significant when the interval excludes 0."""
    paired = [p.prompt for p in new] == [p.prompt for p in old] and bool(new)
    difference = bootstrap_ratio_difference(tau_pairs(new), tau_pairs(old), paired)
    significant = None
    if difference.low is not None:
        significant = difference.low > 0 or difference.high < 0
    return {"difference": difference.estimate, "ci": [difference.low, difference.high], "paired": paired,
            "significant": significant}


# --- markdown ---------------------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(rows: list[tuple[str, dict]], block_size: int, settings: dict) -> str:
    """The acceptance table for a model card: one row per set plus "all"."""
    header = ["dataset", "prompts", "τ", "95% CI", *(f"acc@{j}" for j in range(block_size)), "tokens/s", "speedup",
              "ECE (per-pos / pooled)", "AUROC (per-pos / pooled)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, stats in rows:
        summary = stats["summary"]
        baseline = summary["baseline"]
        pooled = summary["calibration"]["survival"] if summary["calibration"] else None
        mean = stats["calibration_per_position_mean"]
        low, high = stats["tau_ci"]
        cells = [name, str(stats["prompts"]), _fmt(stats["tau"]), f"{_fmt(low)}–{_fmt(high)}",
                 *(_fmt(v) for v in summary["accept_rate"]), _fmt(summary["tokens_per_s"], 1),
                 _fmt(baseline["speedup"]) + "×" if baseline and baseline["speedup"] else "-",
                 f"{_fmt(mean and mean['ece'], 3)} / {_fmt(pooled and pooled['ece'], 3)}",
                 f"{_fmt(mean and mean['auroc'], 3)} / {_fmt(pooled and pooled['auroc'], 3)}"]
        lines.append("| " + " | ".join(cells) + " |")
    s = settings
    lines.append("")
    lines.append(f"`dspark eval`: block {s['block_size']}, T = {s['temperature']}, {s['max_new_tokens']} new tokens "
                 f"per prompt, seed {s['seed']}, {s['device']} {s['dtype']}; τ = tokens per target forward (incl. "
                 "bonus), 95% CI by bootstrap over prompts; acc@j = DeepSpec's accept_rate@j.")
    return "\n".join(lines) + "\n"
