"""The decode settings of a pair, resolved and checked once, torch-free.

    settings = resolve_settings(draft_config, MarkovHead.of_config(draft_config, nvfp4=False), on_cuda=False,
                                requested=Requested(block_size=4, temperature=1.0))
    settings.block_size, settings.markov, settings.sampling, settings.verify

`Requested` is what a caller asked for (None / "auto": the draft's own value); `resolve_settings` is the one place
that turns it into `DecodeSettings` (the block size used and the one trained, the draft top-k, the Markov strategy
that runs, the sampling, the verify rule, the length rule). Every problem is a `SettingError` naming the setting;
the CLI adds the flag. The loop (decode/speculative.py), the reports, eval's run file, `plan` and `serve` read
`DecodeSettings`; a run file stores `Requested` beside it, so that `eval --resume` compares requests with requests.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from dspark_cli.errors import SettingError
from dspark_cli.runtime.rounds import CONFIDENCE_RULES, LENGTH_RULES

STRATEGIES = ("dense", "topk", "nvfp4", "fused")  # the Markov stage's implementations (decode/markov.py)
SELECTOR = "selector"  # what a DFlash2 draft runs instead: its path selector's walk (decode/selector.py)
MARKOV_CHOICES = ("auto", *STRATEGIES)
MIN_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS (v1/sample/sampler): below it vLLM samples greedily


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution. temperature 0 means greedy; top_k 0 and top_p 1 mean off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SettingError("temperature", f"must be a finite number >= 0 (0 means greedy), got {self.temperature}.")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise SettingError("temperature", f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got "
                                              f"{self.temperature:g}: dividing logits by it overflows.")
        if not 0.0 < self.top_p <= 1.0:
            raise SettingError("top_p", f"must be in (0, 1] (1 means off), got {self.top_p}.")
        if self.top_k < 0:
            raise SettingError("top_k", f"must be >= 0 (0 means off), got {self.top_k}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        """Sampling with a top-k or top-p cut (what the fused walk cannot apply)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


@dataclass(frozen=True)
class VerifyRule:
    """How many drafted positions the target scores each round: all of them (threshold None), or the prefix a
    confidence threshold keeps under `rule` (rounds.scored_length). temperatures: STS temperatures T_1..T_N,
    c_i = sigmoid(logit_i / T_i) for the threshold and the recorded confidences (None: T_i = 1)."""

    threshold: float | None = None
    rule: str = "survival"
    temperatures: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Requested:
    """What the caller asked for; None / "auto" take the draft's own value. Stored in a run file as it is."""

    block_size: int | None = None
    draft_topk: int | None = None
    markov: str = "auto"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    confidence_threshold: float | None = None
    confidence_rule: str = "survival"
    length_rule: str = "stop"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "Requested":
        """The fields this class knows, from a dict that may hold more (a run file's settings)."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


@dataclass(frozen=True)
class MarkovHead:
    """What the Markov strategy depends on: whether the draft has a head, its type, whether markov_w2 is NVFP4."""

    present: bool
    head_type: str = "vanilla"
    nvfp4: bool = False

    @classmethod
    def of_config(cls, config, nvfp4: bool) -> "MarkovHead":
        """From a DraftConfig and whether its checkpoint stores markov_w2 as NVFP4."""
        return cls(config.has_markov, config.markov_head_type or "vanilla", nvfp4 and config.has_markov)


@dataclass(frozen=True)
class DecodeSettings:
    """A pair's decode settings, resolved: what the loop runs and what every report and file says it ran."""

    block_size: int  # draft tokens per round
    trained_block_size: int | None  # the most the draft was trained for (None: its config does not say)
    draft_topk: int | None  # candidates per position: the gathered Markov strategies' (None: dense), a selector's k
    markov: str  # the strategy that runs: one of STRATEGIES, or SELECTOR for a DFlash2 draft
    sampling: SamplingParams = field(default_factory=SamplingParams)
    verify: VerifyRule = field(default_factory=VerifyRule)
    length_rule: str = "stop"  # "stop": end at max_new_tokens; "deepspec": DeepSpec's one extra round
    requested: Requested = field(default_factory=Requested)


def trained_block_size(config) -> int | None:
    """The most draft tokens per round a DraftConfig was trained for: block_size query slots, one of them the
    anchor's own slot in the DFlash layout (sample_from_anchor false). None when the config says nothing."""
    trained = config.block_size.value
    if trained is None:
        return None
    return trained if config.sample_from_anchor else trained - 1


def resolve_block_size(config, requested: int | None) -> int:
    """The block size that runs: the trained one by default; SettingError below 1 or above the trained one."""
    trained = trained_block_size(config)
    if requested is None:
        if trained is None:
            raise SettingError("block_size", "is not in the draft's config.json; give one.")
        return trained
    if requested < 1:
        raise SettingError("block_size", f"must be at least 1, got {requested}.")
    if trained is not None and requested > trained:
        raise SettingError("block_size", f"{requested} is larger than the {trained} draft tokens per round the draft "
                                         f"was trained for; use {trained} or less.")
    return requested


def resolve_draft_topk(config, requested: int | None) -> int | None:
    """The draft top-k: the requested one, else the config's dspark_draft_topk; between 1 and the draft vocab."""
    topk = config.dspark_draft_topk if requested is None else requested
    vd = config.draft_vocab_size
    if topk is not None and vd is not None and not 1 <= topk <= vd:
        raise SettingError("draft_topk", f"must be between 1 and the draft vocabulary size {vd}, got {topk}.")
    return topk


def resolve_markov(requested: str, head: MarkovHead, draft_topk: int | None, sampling: SamplingParams,
                   on_cuda: bool) -> str:
    """The Markov strategy that runs. auto: dense without a draft top-k; with one, the fused walk on CUDA (when the
    sampling and the head type allow it: vanilla heads only), else nvfp4 for an NVFP4 head, else topk."""
    vanilla = not head.present or head.head_type == "vanilla"
    if requested == "auto":
        if not head.present or draft_topk is None:
            return "dense"
        if on_cuda and not sampling.filtered and vanilla:
            return "fused"
        return "nvfp4" if head.nvfp4 else "topk"
    if requested not in STRATEGIES:
        raise SettingError("markov", f"must be one of {', '.join(MARKOV_CHOICES)}, got {requested!r}.")
    if requested != "dense" and draft_topk is None:
        raise SettingError("markov", f"{requested}: the {requested} Markov strategy gathers top-k candidates; give a "
                                     "draft top-k.")
    if requested == "nvfp4" and not head.nvfp4:
        raise SettingError("markov", "nvfp4: the nvfp4 Markov strategy needs a draft whose markov_w2 is NVFP4 (see "
                                     "`dspark quantize`).")
    if requested == "fused" and not vanilla:
        raise SettingError("markov", f"fused: the fused Markov walk implements only vanilla heads and this draft's "
                                     f"head is {head.head_type}; pick dense, topk or nvfp4.")
    if requested == "fused" and sampling.filtered:
        raise SettingError("markov", "fused: the fused Markov walk applies only a temperature; drop the top-k and "
                                     "top-p or pick dense or topk.")
    return requested


def resolve_selector(config, requested: Requested) -> tuple[int, str]:
    """A DFlash2 draft's stage: (its selector_top_k, SELECTOR). Its candidate lattice is k x k as trained and as
    every engine builds it, and no Markov strategy applies, so a draft top-k or a strategy is refused."""
    if requested.draft_topk is not None:
        raise SettingError("draft_topk", f"cannot be used with a DFlash2 draft: its path selector walks the "
                                         f"selector_top_k = {config.selector_top_k} candidates it was trained "
                                         "with; drop the draft-topk option.")
    if requested.markov != "auto":
        raise SettingError("markov", f"{requested.markov}: a DFlash2 draft has no Markov head; its path selector's "
                                     "walk is the one stage it runs; drop the markov option.")
    return config.selector_top_k, SELECTOR


def resolve_verify(requested: Requested, has_confidence_head: bool, block_size: int,
                   temperatures: tuple[float, ...] | None) -> VerifyRule:
    """The verify rule: a threshold in (0, 1] needs a confidence head; STS temperatures cover the block."""
    threshold = requested.confidence_threshold
    if requested.confidence_rule not in CONFIDENCE_RULES:
        raise SettingError("confidence_rule", f"must be {' or '.join(CONFIDENCE_RULES)}, got "
                                              f"{requested.confidence_rule!r}.")
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise SettingError("confidence_threshold", f"must be in (0, 1], got {threshold}.")
    if threshold is not None and not has_confidence_head:
        raise SettingError("confidence_threshold", "cannot be used: the draft has no confidence head.")
    if temperatures is not None and len(temperatures) < block_size:
        raise SettingError("calibration", f"has {len(temperatures)} temperatures but the block has {block_size} "
                                          f"positions; calibrate runs of block size {block_size} or more.")
    if temperatures is not None and not all(t > 0 for t in temperatures):
        raise SettingError("calibration", f"temperatures must be above 0, got {list(temperatures)}.")
    kept = None if temperatures is None else tuple(float(t) for t in temperatures[:block_size])
    return VerifyRule(threshold, requested.confidence_rule, kept)


def resolve_settings(config, head: MarkovHead, on_cuda: bool, requested: Requested = Requested(),
                     temperatures: tuple[float, ...] | None = None) -> DecodeSettings:
    """The one resolution of a pair's decode settings from its DraftConfig (SettingError names the setting)."""
    if requested.length_rule not in LENGTH_RULES:
        raise SettingError("length_rule", f"must be one of {', '.join(LENGTH_RULES)}, got {requested.length_rule!r}.")
    sampling = SamplingParams(requested.temperature, requested.top_p, requested.top_k)
    block_size = resolve_block_size(config, requested.block_size)
    if config.has_selector:
        draft_topk, markov = resolve_selector(config, requested)
    else:
        draft_topk = resolve_draft_topk(config, requested.draft_topk)
        markov = resolve_markov(requested.markov, head, draft_topk, sampling, on_cuda)
    verify = resolve_verify(requested, config.has_confidence, block_size, temperatures)
    return DecodeSettings(block_size, trained_block_size(config), draft_topk, markov, sampling, verify,
                          requested.length_rule, requested)
