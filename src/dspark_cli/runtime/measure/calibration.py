"""Sequential Temperature Scaling (STS) of the confidence head, fitted on eval runs (`dspark calibrate`).

    runs = [EvalRun.load(path) for path in paths]
    result = fit_runs(runs, names=[str(p) for p in paths])     # temperatures T_1..T_N, held-out scores before/after
    result.to_json()                                            # the file SGLang and TensorRT-LLM read

The head gives a raw logit l_j per drafted position; calibrated, c_j = sigmoid(l_j / T_j) and the survival
s_j = c_1 · … · c_j estimates P(positions 1..j all accepted). The DSpark paper's STS fits one temperature per position,
left to right, so that the *survival* is calibrated: T_j minimises the ECE of s_j = s_{j-1}(T_1..T_{j-1}) ·
sigmoid(l_j / T) against "accepted > j" over the verified (round, j) pairs, with T_1..T_{j-1} already fixed. The search
is a grid (GRID_SIZE temperatures log-spaced over [GRID_LOW, GRID_HIGH]); ties go to the temperature closest to 1.
ECE uses metrics.expected_calibration_error's ECE_BINS equal-width bins, the same ECE `dspark eval` prints.

Prompts, not rounds, are split into a fitting part and a held-out part (HOLDOUT_FRACTION of each prompt set, a
seeded shuffle of its prompt keys): rounds of one prompt are correlated, so scores on held-out rounds of fitted
prompts would flatter the fit. The written ece_before / ece_after are the held-out ECEs of the survival per
position, and ece_floor the ECE a perfectly calibrated head would show on those held-out pairs (finite samples keep
ECE above 0).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.io.reading import read_json_file
from dspark_cli.runtime.measure.metrics import ECE_BINS, Calibration, calibration
from dspark_cli.runtime.measure.run_file import finite_logits, round_place
from dspark_cli.runtime.rounds import sigmoid

STS_FORMAT = "dspark-sts/1"
GRID_LOW, GRID_HIGH, GRID_SIZE = 0.1, 10.0, 121  # ratio 10^(1/60) ≈ 1.039 between neighbours
HOLDOUT_FRACTION = 0.3
SPLIT_SEED = 0
MAX_STS_BYTES = 1024 * 1024
FLOOR_DRAWS, FLOOR_SEED = 200, 0


@dataclass
class Rounds:
    """The calibration data of some prompts: per round the raw logits [N], how many positions the target verified
    and how many it accepted (accepted > j: positions 0..j all accepted; j >= verified: no outcome)."""

    logits: list[list[float]]
    verified: list[int]
    accepted: list[int]

    def __len__(self) -> int:
        return len(self.logits)


@dataclass
class StsResult:
    temperatures: list[float]
    before: list[Calibration]  # held-out survival calibration per position, T = 1
    after: list[Calibration]  # the same with the fitted temperatures
    floor: list[float | None]  # per position: ece_floor of the held-out survivals with the fitted temperatures
    fit_rounds: int
    fit_prompts: int
    heldout_prompts: int
    dataset: str
    fraction: float  # the held-out share of each prompt set
    seed: int  # of the split
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """SGLang's DSparkStsCalibration keys (temperatures, dataset, num_samples, ece_before, ece_after) plus
        TensorRT-LLM's sts_temperatures spelling; both loaders ignore the other keys."""
        return {
            "temperatures": self.temperatures,
            "sts_temperatures": self.temperatures,
            "ece_before": [c.ece for c in self.before],
            "ece_after": [c.ece for c in self.after],
            "num_samples": self.fit_rounds,
            "dataset": self.dataset,
            "format": STS_FORMAT,
            "block_size": len(self.temperatures),
            "objective": "ECE of the survival prod_{i<=j} sigmoid(logit_i / T_i), position by position",
            "grid": {"low": GRID_LOW, "high": GRID_HIGH, "size": GRID_SIZE, "spacing": "log"},
            "ece_bins": ECE_BINS,
            "holdout": {"fraction": self.fraction, "seed": self.seed, "by": "prompt", "stratified_by": "prompt set",
                        "fit_prompts": self.fit_prompts, "heldout_prompts": self.heldout_prompts,
                        "before": [vars(c) for c in self.before], "after": [vars(c) for c in self.after],
                        "ece_floor": self.floor, "ece_floor_draws": FLOOR_DRAWS},
            "notes": self.notes,
        }


def temperature_grid() -> list[float]:
    step = math.log(GRID_HIGH / GRID_LOW) / (GRID_SIZE - 1)
    return [GRID_LOW * math.exp(step * i) for i in range(GRID_SIZE)]


def fit_sts(rounds: Rounds, block_size: int, threshold_cut: bool = False) -> list[float]:
    """The STS temperatures T_1..T_N, left to right (see the module docstring). DsparkError when a position was
    never verified (no outcome to fit); threshold_cut: the runs cut verification with a confidence threshold (then
    the message names that cause)."""
    import torch

    logits = torch.tensor(rounds.logits, dtype=torch.float64)  # [R, N]
    verified = torch.tensor(rounds.verified)[:, None] > torch.arange(block_size)  # [R, N]
    outcome = (torch.tensor(rounds.accepted)[:, None] > torch.arange(block_size)).double()  # [R, N]
    grid = torch.tensor(temperature_grid(), dtype=torch.float64)  # [G]
    preference = grid.log().abs()  # ties: closest to T = 1
    survival = torch.ones(len(rounds), dtype=torch.float64)  # [R]
    temperatures = []
    for j in range(block_size):
        rows = verified[:, j]
        if not rows.any():
            cause = ("their confidence threshold cut every round before it; use runs without the "
                     "confidence-threshold option" if threshold_cut else "every round ended before it (a rejection "
                     "or a stop token); calibrate on more prompts or longer generations")
            raise DsparkError(f"position {j + 1} of the block was never verified in the runs, so it has no outcome "
                              f"to calibrate against: {cause}.")
        ece = torch.stack([_ece(survival[rows] * torch.sigmoid(logits[rows, j] / t), outcome[rows, j]) for t in grid])
        best = min(range(len(grid)), key=lambda g: (float(ece[g]), float(preference[g])))
        temperatures.append(float(grid[best]))
        survival = survival * torch.sigmoid(logits[:, j] / grid[best])
    return temperatures


def _ece(predicted, outcome):
    """metrics.expected_calibration_error on tensors: ECE_BINS bins [b/B, (b+1)/B), 1.0 in the last."""
    import torch

    bins = (predicted * ECE_BINS).long().clamp(max=ECE_BINS - 1)
    gap = torch.zeros(ECE_BINS, dtype=torch.float64).index_add_(0, bins, predicted - outcome)
    return gap.abs().sum() / len(predicted)


def survival_pairs(rounds: Rounds, temperatures: Sequence[float], block_size: int
                   ) -> list[tuple[list[float], list[bool]]]:
    """Per position j: (the survivals prod_{i<=j} sigmoid(l_i / T_i), the outcomes "accepted > j"), verified pairs
    only."""
    pairs: list[tuple[list[float], list[bool]]] = [([], []) for _ in range(block_size)]
    for logits, verified, accepted in zip(rounds.logits, rounds.verified, rounds.accepted, strict=True):
        survival = 1.0
        for j in range(min(verified, block_size)):
            survival *= sigmoid(logits[j] / temperatures[j])
            pairs[j][0].append(survival)
            pairs[j][1].append(accepted > j)
    return pairs


def survival_calibration(rounds: Rounds, temperatures: Sequence[float], block_size: int) -> list[Calibration]:
    """Per position: the calibration scores of survival_pairs."""
    return [calibration(predicted, outcomes) for predicted, outcomes in survival_pairs(rounds, temperatures,
                                                                                      block_size)]


def ece_floor(predicted: Sequence[float], draws: int = FLOOR_DRAWS, seed: int = FLOOR_SEED) -> float | None:
    """The ECE that a perfectly calibrated head with these predictions shows on this many pairs, on average: the
    outcomes drawn as Bernoulli(p) `draws` times (seeded), the ECE of each draw averaged. Finite samples put an ECE
    this high on even a perfect head, so an ECE near it is as calibrated as the pairs can tell. None without pairs."""
    import torch

    if not predicted:
        return None
    p = torch.tensor(predicted, dtype=torch.float64)  # [n]
    generator = torch.Generator().manual_seed(seed)
    outcomes = (torch.rand((draws, len(p)), generator=generator, dtype=torch.float64) < p).double()  # [draws, n]
    bins = (p * ECE_BINS).long().clamp(max=ECE_BINS - 1)  # [n]
    gaps = torch.zeros(draws, ECE_BINS, dtype=torch.float64).index_add_(1, bins, p - outcomes)  # [draws, B]
    return float((gaps.abs().sum(dim=1) / len(p)).mean())


def split_prompts(keys: list[tuple], fraction: float = HOLDOUT_FRACTION, seed: int = SPLIT_SEED
                  ) -> tuple[set[tuple], set[tuple]]:
    """(fitting keys, held-out keys), stratified by prompt set (key[0]): each set's sorted keys are shuffled by one
    random.Random(seed) and its first round(fraction · n) are held out, at most n − 1, so both parts hold every set
    in the same proportions (sets differ in acceptance, and a held-out part with another mix would score the fit on
    other data). When that holds out nothing (sets of one prompt), one seeded prompt of all is. DsparkError with
    fewer than 2 prompts."""
    ordered = sorted(set(keys))
    if len(ordered) < 2:
        raise DsparkError(f"calibration needs at least 2 prompts (some are held out to score the fit); the runs "
                          f"hold {len(ordered)}.")
    rng = random.Random(seed)
    fit, held = set(), set()
    for name in sorted({key[0] for key in ordered}):
        members = [key for key in ordered if key[0] == name]
        rng.shuffle(members)
        count = min(len(members) - 1, round(fraction * len(members)))
        held.update(members[:count])
        fit.update(members[count:])
    if not held:
        moved = rng.choice(sorted(fit))
        fit.discard(moved)
        held.add(moved)
    return fit, held


def rounds_of(results, source: str) -> Rounds:
    """The calibration data of a run's PromptResults; DsparkError for rounds without raw logits (older runs)."""
    data = Rounds([], [], [])
    for result in results:
        for number, r in enumerate(result.rounds):
            logits = finite_logits(r, round_place(source, result, number))
            if logits is None:
                raise DsparkError(f"{source} has rounds without raw confidence logits (a draft without a confidence "
                                  "head, or a run file from an older dspark); run `dspark eval` with the json option "
                                  "again.")
            data.logits.append(logits)
            data.verified.append(r["proposed"])
            data.accepted.append(r["accepted"])
    return data


def fit_runs(runs: list, names: list[str], fraction: float = HOLDOUT_FRACTION, seed: int = SPLIT_SEED) -> StsResult:
    """STS on the prompts of eval runs (evaluation.EvalRun), scored on held-out prompts."""
    blocks = {run.settings["block_size"] for run in runs}
    if len(blocks) != 1:
        raise DsparkError(f"the runs used different block sizes ({', '.join(map(str, sorted(blocks)))}); an STS "
                          "table has one temperature per position, so calibrate runs of one block size.")
    block = blocks.pop()
    by_prompt: dict[tuple, list] = {}  # the same prompt in several runs lands on one side of the split
    for run, name in zip(runs, names, strict=True):
        for r in run.results:
            by_prompt.setdefault((r.set_name, r.index, r.prompt), []).append((name, r))
    fit_keys, held_keys = split_prompts(list(by_prompt), fraction, seed)

    def gather(keys):
        data = Rounds([], [], [])
        for key in sorted(keys):
            for name, result in by_prompt[key]:
                part = rounds_of([result], name)
                data.logits += part.logits
                data.verified += part.verified
                data.accepted += part.accepted
        return data

    fitting, held = gather(fit_keys), gather(held_keys)
    threshold_cut = any(run.settings.get("confidence_threshold") is not None for run in runs)
    temperatures = fit_sts(fitting, block, threshold_cut)
    notes = []
    if threshold_cut:
        notes.append("some runs cut verification with a confidence threshold: the positions the cut skipped have no "
                     "outcome and are left out, which biases the fit; calibrate on runs without "
                     "the confidence-threshold option.")
    sets = sorted({key[0] for key in by_prompt})
    calibrated = survival_pairs(held, temperatures, block)
    before = survival_calibration(held, [1.0] * block, block)
    after = [calibration(predicted, outcomes) for predicted, outcomes in calibrated]
    floor = [ece_floor(predicted) for predicted, _ in calibrated]
    notes += _rise_note(before, after, floor)
    return StsResult(temperatures, before, after, floor, len(fitting), len(fit_keys), len(held_keys), ",".join(sets),
                     fraction, seed, notes)


def _rise_note(before: list[Calibration], after: list[Calibration], floor: list[float | None]) -> list[str]:
    """A note naming the positions whose held-out ECE the fitted temperatures raised; none when none did."""
    rose = [j for j, (b, a) in enumerate(zip(before, after)) if b.ece is not None and a.ece > b.ece]
    if not rose:
        return []
    worst = max(rose, key=lambda j: after[j].ece - before[j].ece)
    return [f"held-out ECE rose at position(s) {', '.join(map(str, rose))} (most at {worst}: "
            f"{before[worst].ece:.3f} → {after[worst].ece:.3f}, floor {floor[worst]:.3f}): there the temperatures "
            "fitted on these prompts do not carry over to unseen ones; fit on more prompts (hundreds per set) before "
            "deploying this table."]


def load_temperatures(path: Path) -> list[float]:
    """The temperatures of an STS file (`temperatures`, SGLang's key, or `sts_temperatures`, TensorRT-LLM's):
    a non-empty list of finite numbers above 0. DsparkError in one sentence otherwise."""
    doc = read_json_file(path, "calibration file", MAX_STS_BYTES, "give a file written by `dspark calibrate`")
    key = next((k for k in ("temperatures", "sts_temperatures") if isinstance(doc, dict) and k in doc), None)
    values = doc.get(key) if key else None
    if not isinstance(values, list) or not values or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in values):
        raise DsparkError(f"{path} needs a 'temperatures' list of numbers above 0 (one per draft position); give a "
                          "file written by `dspark calibrate`.")
    return [float(t) for t in values]


def check_temperatures(temperatures: Sequence[float], block_size: int, source: str) -> list[float]:
    """The first block_size temperatures; DsparkError when the file has fewer positions than the block."""
    if len(temperatures) < block_size:
        raise DsparkError(f"{source} has {len(temperatures)} temperatures but the block has {block_size} positions; "
                          f"calibrate runs of block size {block_size} or more.")
    return list(temperatures[:block_size])
