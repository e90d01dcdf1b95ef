"""`dspark bench audit`: is a live engine's speculative output the output it gives without speculation?

    config = AuditConfig(speculative="http://127.0.0.1:8081", plain="http://127.0.0.1:8080",
                         prompts=shipped_prompts(), reference=("target/", "draft/"))
    report = run_audit(config)              # AuditReport; .verdict, .exit_code, .to_dict() (the --json document)

At T = 0, each prompt (tokenized by the plain server) goes to both servers as token ids, `max_tokens` generated
with end of sequence ignored, and every generated token is compared: with the plain server's, and with dspark's
reference (the target's own greedy decoding of the same ids through `Pair.baseline`, float32) when a pair is given.
Per prompt: identical, differs (the first differing position, both tokens, the text decoded from there) or
inconclusive (no difference, but the engine drafted no token or accepted none for it, so equality proves nothing;
the engine's own counters, audit_client.py). A difference where the reference scores both candidates within
`tie_margin` logits is a near tie float32 rounding may break either way (a verify pass and a decode step sum in
another order): recorded, and both servers continue from the reference's token (`audit_prompt`). The run's
verdict: differs when a prompt differs, else inconclusive when a prompt is, else identical.

At T > 0 (`samples` > 0), a distribution check: a context (one prompt followed by the plain server's first
FORCED_PREFIX greedy tokens) is sampled `samples` times on each server under each of SAMPLING_CHECKS (one with a
binding top-p, one with a binding top-k), each request with its own seed (disjoint between the servers, so the
samples are independent); the token at each of POSITIONS is compared between the servers by Pearson's chi-square
test of homogeneity (audit_stats.py), failing at p < alpha / (number of tests) (Bonferroni). Position 0 is sampled
from the prompt pass (no draft involved: it checks that the settings reach the engine); later positions after a
draft block could have been verified (lossless speculative sampling keeps every position's distribution).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dspark_cli.errors import EXIT_FINDINGS, EXIT_INCONCLUSIVE, EXIT_OK, DsparkError
from dspark_cli.runtime.bench.audit_client import GREEDY, AuditServer, Sampling, connect_audit
from dspark_cli.runtime.bench.audit_stats import HistogramTest, homogeneity_test

AUDIT_FORMAT = "dspark-bench-audit/1"
PROMPTS_ASSET = "runtime/assets/audit/prompts.jsonl"
SAMPLING_CHECKS = (("top-p", Sampling(temperature=1.0, top_p=0.5, top_k=0)),
                   ("top-k", Sampling(temperature=1.0, top_p=1.0, top_k=4)))
POSITIONS = (0, 3)  # generated-token positions compared at T > 0
FORCED_PREFIX = 8  # greedy tokens of the plain server appended to the sampled prompt
SHOWN_TOKENS = 8  # tokens decoded from a divergence on, for the report
TOP_LOGITS = 8  # of each reference step, kept to measure a near tie
TIE_MARGIN = 0.01  # logits: two candidates closer than this are a tie float32 rounding may break either way
MAX_TIES = 8  # per prompt; past them the rest of the prompt is left uncompared
MAX_PROMPTS = 1000
MAX_SAMPLES = 100_000
SEED_LIMIT = 1 << 31  # llama.cpp's seed is a uint32 (0xFFFFFFFF: random): seeds stay below 2^31


@dataclass(frozen=True)
class AuditPrompt:
    kind: str  # code, prose, tool_call, json, chat, long (the shipped set); prompt (a file's)
    text: str


def shipped_prompts() -> list[AuditPrompt]:
    """The shipped set: short code and prose, tool calls and JSON, chat-template prompts, two long ones."""
    text = resources.files("dspark_cli").joinpath(PROMPTS_ASSET).read_text()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [AuditPrompt(record["kind"], record["prompt"]) for record in records]


def read_audit_prompts(path: Path) -> list[AuditPrompt]:
    """A prompt set as `dspark eval` reads it (measure/evaluation.read_prompt_set), each of kind "prompt"."""
    from dspark_cli.runtime.measure.evaluation import read_prompt_set

    return [AuditPrompt("prompt", text) for text in read_prompt_set(path).prompts]


@dataclass(frozen=True)
class AuditConfig:
    speculative: str
    plain: str
    prompts: Sequence[AuditPrompt]
    reference: tuple[str, str] | None = None  # (target, draft): dspark's greedy decoding of the target
    max_tokens: int = 64
    samples: int = 400  # per server and sampling check; 0: no T > 0 check
    alpha: float = 0.01
    sample_prompt: int = 0  # index of the prompt the T > 0 check continues
    seed: int = 0
    concurrency: int = 2  # requests in flight while sampling
    timeout_s: float = 120.0
    engine: str = "auto"
    model: str | None = None
    device: str = "auto"  # of the reference decoding
    tie_margin: float = TIE_MARGIN


# --- T = 0 ----------------------------------------------------------------------------------------------------


def divergence(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The first position where two generated sequences differ, every token compared (the shorter one's length
    when one is a prefix of the other); None when they are equal."""
    for position, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return position
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


@dataclass(frozen=True)
class Difference:
    position: int
    speculative: int | None  # the token there (None: the sequence ended)
    other: int | None
    speculative_text: str | None = None  # decoded from `position` on, SHOWN_TOKENS tokens
    other_text: str | None = None

    def to_dict(self) -> dict:
        return {"position": self.position, "speculative_token": self.speculative, "other_token": self.other,
                "speculative_text": self.speculative_text, "other_text": self.other_text}


def difference(ours: Sequence[int], theirs: Sequence[int],
               decode: Callable[[Sequence[int]], str | None] | None = None) -> Difference | None:
    position = divergence(ours, theirs)
    if position is None:
        return None
    token = lambda ids: ids[position] if position < len(ids) else None  # noqa: E731
    text = (lambda ids: decode(ids[position:position + SHOWN_TOKENS])) if decode else (lambda ids: None)
    return Difference(position, token(ours), token(theirs), text(ours), text(theirs))


@dataclass(frozen=True)
class Tie:
    """A position where the servers or the reference took different tokens that the reference scores within the
    tie margin: rounding, not speculation, can break it either way; the comparison resumes after it."""

    position: int
    speculative: int
    plain: int
    reference: int
    margin: float  # logits below the reference's token, the larger of the two servers' tokens

    def to_dict(self) -> dict:
        return {"position": self.position, "speculative_token": self.speculative, "plain_token": self.plain,
                "reference_token": self.reference, "margin": self.margin}


@dataclass
class PromptResult:
    index: int
    kind: str
    prompt_ids: list[int]
    speculative: list[int]
    plain: list[int]
    drafted: int | None  # the engine's draft tokens for this request (None: not reported per request)
    accepted: int | None
    reference: list[int] | None = None
    vs_plain: Difference | None = None
    vs_reference: Difference | None = None
    plain_vs_reference: Difference | None = None  # the engine's own numerics, not speculation
    ties: list[Tie] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.vs_plain is not None or self.vs_reference is not None:
            return "differs"
        if self.drafted == 0 or self.accepted == 0 or len(self.ties) > MAX_TIES:
            return "inconclusive"
        return "identical"

    def to_dict(self) -> dict:
        def diff(d: Difference | None) -> dict | None:
            return None if d is None else d.to_dict()

        return {"index": self.index, "kind": self.kind, "prompt_tokens": len(self.prompt_ids),
                "generated": len(self.speculative), "verdict": self.verdict, "drafted": self.drafted,
                "accepted": self.accepted, "vs_plain": diff(self.vs_plain), "vs_reference": diff(self.vs_reference),
                "plain_vs_reference": diff(self.plain_vs_reference), "ties": [t.to_dict() for t in self.ties],
                "speculative_tokens": self.speculative,
                "plain_tokens": self.plain, "reference_tokens": self.reference}


@dataclass(frozen=True)
class ReferenceRun:
    """dspark's greedy decoding of one prompt: the tokens and, per position, the TOP_LOGITS best (token, logit)."""

    tokens: list[int]
    top: list[list[tuple[int, float]]]

    def margin(self, position: int, token: int) -> float:
        """How far `token`'s logit lies below the reference's own token at `position` (inf when not near the top)."""
        logits = dict(self.top[position])
        return logits[self.tokens[position]] - logits[token] if token in logits else float("inf")


def reference_runs(pair: tuple[str, str], prompts: Sequence[list[int]], max_tokens: int,
                   device: str) -> list[ReferenceRun]:
    """dspark's reference: the target alone, greedy, float32, one token per forward (as `Pair.baseline`), no stop
    token; the top logits of every step kept to tell a near tie from a difference."""
    import torch

    from dspark_cli.runtime.pair import Pair

    target = Pair.check(pair[0], pair[1], device=device, dtype="float32", temperature=0.0).load(
        progress=False).target
    runs = []
    for ids in prompts:
        logits = target.prefill_plain(torch.tensor(ids, dtype=torch.long, device=target.device))  # [V]
        tokens, top = [], []
        while True:
            values, indices = torch.topk(logits.float(), TOP_LOGITS)  # [TOP_LOGITS]
            tokens.append(int(indices[0]))
            top.append(list(zip(map(int, indices.tolist()), map(float, values.tolist()))))
            if len(tokens) == max_tokens:
                break
            logits = target.decode_one(tokens[-1])
        runs.append(ReferenceRun(tokens, top))
    return runs


def audit_prompt(index: int, prompt: AuditPrompt, ids: list[int], servers: dict[str, AuditServer],
                 reference: ReferenceRun | None, config: AuditConfig) -> PromptResult:
    """Both servers on `ids` at T = 0, compared token by token with each other and the reference. A difference
    where the reference's two candidates lie within `tie_margin` logits is a near tie: recorded, and both servers
    are asked again from the reference's token on (past MAX_TIES ties the rest is left uncompared)."""
    result = PromptResult(index, prompt.kind, ids, [], [], 0, 0, None if reference is None else reference.tokens)
    offset = 0
    while offset < config.max_tokens:
        context = ids + ([] if reference is None else reference.tokens[:offset])
        spec = servers["speculative"].complete(context, config.max_tokens - offset, GREEDY, config.seed)
        base = servers["plain"].complete(context, config.max_tokens - offset, GREEDY, config.seed)
        result.speculative += spec.tokens
        result.plain += base.tokens
        result.drafted = None if spec.drafted is None or result.drafted is None else result.drafted + spec.drafted
        result.accepted = None if spec.accepted is None or result.accepted is None else \
            result.accepted + spec.accepted
        tie = _near_tie(spec.tokens, base.tokens, reference, offset, config.tie_margin)
        if tie is None:
            return result
        result.ties.append(tie)
        offset = tie.position + 1  # both continue from the reference's token there
        result.speculative = result.speculative[:tie.position] + [tie.reference]
        result.plain = result.plain[:tie.position] + [tie.reference]
        if len(result.ties) > MAX_TIES:
            result.reference = result.reference[:offset]  # the rest is left uncompared: inconclusive
            return result
    return result


def _near_tie(spec: list[int], plain: list[int], reference: ReferenceRun | None, offset: int,
              tie_margin: float) -> Tie | None:
    """The first difference of this segment when it is a near tie of the reference (module docstring), else None."""
    if reference is None:
        return None
    ours = reference.tokens[offset:]
    positions = [p for p in (divergence(spec, plain), divergence(spec, ours)) if p is not None]
    if not positions:
        return None
    at = min(positions)
    if at >= min(len(spec), len(plain), len(ours)):
        return None  # a sequence ended early: not a tie
    margins = [reference.margin(offset + at, token) for token in (spec[at], plain[at])]
    if max(margins) > tie_margin:
        return None
    return Tie(offset + at, spec[at], plain[at], ours[at], max(margins))


# --- T > 0 ----------------------------------------------------------------------------------------------------


@dataclass
class DistributionCheck:
    name: str
    sampling: Sampling
    position: int
    test: HistogramTest
    threshold: float  # alpha / number of tests

    @property
    def passed(self) -> bool:
        return self.test.p >= self.threshold

    def to_dict(self) -> dict:
        return {"name": self.name, **self.sampling.to_dict(), "position": self.position, **self.test.to_dict(),
                "threshold": self.threshold, "passed": self.passed}


def sample_tokens(server: AuditServer, context: list[int], sampling: Sampling, seeds: Sequence[int],
                  concurrency: int) -> list[list[int]]:
    """One request per seed (max(POSITIONS) + 1 tokens each), `concurrency` in flight; their generated ids. An
    interrupt cancels the requests not yet sent and waits for those in flight (each bounded by the timeout)."""
    def one(seed: int) -> list[int]:
        tokens = server.complete(context, max(POSITIONS) + 1, sampling, seed).tokens
        if len(tokens) <= max(POSITIONS):
            raise DsparkError(f"the {server.role} server at {server.url} generated {len(tokens)} tokens where "
                              f"{max(POSITIONS) + 1} were asked with end of sequence ignored; it cannot be audited "
                              "at T > 0.")
        return tokens

    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        futures = [pool.submit(one, seed) for seed in seeds]
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def seeds_of(config: AuditConfig, check: int, side: int) -> list[int]:
    """Seeds of one server (side 0 speculative, 1 plain) for one check: disjoint across sides and checks."""
    base = config.seed + check * 2 * config.samples
    return [(base + 2 * i + side) % SEED_LIMIT for i in range(config.samples)]


def distribution_checks(servers: dict[str, AuditServer], context: list[int], config: AuditConfig,
                        on_progress: Callable[[str], None] | None = None) -> list[DistributionCheck]:
    threshold = config.alpha / (len(SAMPLING_CHECKS) * len(POSITIONS))
    checks = []
    for index, (name, sampling) in enumerate(SAMPLING_CHECKS):
        drawn = {}
        for side, role in enumerate(("speculative", "plain")):
            if on_progress is not None:
                on_progress(f"T > 0 check {name}: {config.samples} samples from the {role} server")
            drawn[role] = sample_tokens(servers[role], context, sampling, seeds_of(config, index, side),
                                        config.concurrency)
        for position in POSITIONS:
            test = homogeneity_test([t[position] for t in drawn["speculative"]], [t[position] for t in drawn["plain"]])
            checks.append(DistributionCheck(name, sampling, position, test, threshold))
    return checks


# --- the run --------------------------------------------------------------------------------------------------


@dataclass
class AuditReport:
    config: AuditConfig
    servers: dict[str, AuditServer]
    prompts: list[PromptResult] = field(default_factory=list)
    checks: list[DistributionCheck] = field(default_factory=list)
    sglang_accept_length: float | None = None  # SGLang: its mean accept length (no per-request counts)
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def drafting_unknown(self) -> bool:
        """No per-request drafting counts and no server-level evidence that the engine drafted at all."""
        if any(p.drafted is not None for p in self.prompts):
            return False
        return self.sglang_accept_length is None or self.sglang_accept_length <= 1.0

    @property
    def distribution_passed(self) -> bool | None:
        return None if not self.checks else all(c.passed for c in self.checks)

    @property
    def verdict(self) -> str:
        verdicts = {p.verdict for p in self.prompts}
        if "differs" in verdicts or self.distribution_passed is False:
            return "differs"
        if "inconclusive" in verdicts or self.drafting_unknown:
            return "inconclusive"
        return "identical"

    @property
    def exit_code(self) -> int:
        return {"differs": EXIT_FINDINGS, "inconclusive": EXIT_INCONCLUSIVE}.get(self.verdict, EXIT_OK)

    def to_dict(self) -> dict:
        c = self.config
        return {"format": AUDIT_FORMAT, "verdict": self.verdict,
                "servers": {role: {"url": s.url, "engine": s.engine, "model": s.server.model}
                            for role, s in self.servers.items()},
                "settings": {"max_tokens": c.max_tokens, "samples": c.samples, "alpha": c.alpha,
                             "positions": list(POSITIONS), "forced_prefix": FORCED_PREFIX, "seed": c.seed,
                             "sample_prompt": c.sample_prompt, "concurrency": c.concurrency,
                             "tie_margin": c.tie_margin,
                             "reference": None if c.reference is None else {"target": c.reference[0],
                                                                            "draft": c.reference[1]}},
                "greedy": {"prompts": len(self.prompts),
                           "identical": sum(p.verdict == "identical" for p in self.prompts),
                           "differs": sum(p.verdict == "differs" for p in self.prompts),
                           "inconclusive": sum(p.verdict == "inconclusive" for p in self.prompts),
                           "drafted": _total(p.drafted for p in self.prompts),
                           "accepted": _total(p.accepted for p in self.prompts),
                           "sglang_accept_length": self.sglang_accept_length,
                           "drafting_unknown": self.drafting_unknown},
                "sampling": {"passed": self.distribution_passed, "checks": [x.to_dict() for x in self.checks]},
                "timings_s": self.timings_s,
                "prompts": [p.to_dict() for p in self.prompts]}


def _total(values) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def check_config(config: AuditConfig) -> None:
    if not config.prompts:
        raise DsparkError("there are no prompts to audit; give a prompts file with at least one prompt.")
    if len(config.prompts) > MAX_PROMPTS:
        raise DsparkError(f"{len(config.prompts)} prompts given; the audit takes at most {MAX_PROMPTS}: pass the "
                          "requests option to audit the first N.")
    if config.max_tokens < max(POSITIONS) + FORCED_PREFIX + 1:
        raise DsparkError(f"the max-tokens option must be at least {max(POSITIONS) + FORCED_PREFIX + 1} (a "
                          f"difference after the first draft block must be reachable), got {config.max_tokens}.")
    if not 0 <= config.samples <= MAX_SAMPLES:
        raise DsparkError(f"the samples option takes 0 (no T > 0 check) to {MAX_SAMPLES}, got {config.samples}.")
    if not 0 < config.alpha < 1:
        raise DsparkError(f"the alpha option must be between 0 and 1, got {config.alpha}.")
    if not 0 <= config.sample_prompt < len(config.prompts):
        raise DsparkError(f"the sample-prompt option must index one of the {len(config.prompts)} prompts (0 to "
                          f"{len(config.prompts) - 1}), got {config.sample_prompt}.")
    if config.concurrency < 1:
        raise DsparkError(f"the concurrency option must be at least 1, got {config.concurrency}.")
    if not config.tie_margin >= 0:
        raise DsparkError(f"the tie-margin option must be a number of logits of at least 0, got {config.tie_margin}.")
    if not (config.timeout_s > 0 and config.timeout_s < float("inf")):
        raise DsparkError(f"the timeout option must be a finite number of seconds above 0, got {config.timeout_s}.")


def run_audit(config: AuditConfig, on_progress: Callable[[str], None] | None = None) -> AuditReport:
    """Both servers probed, every prompt at T = 0 on both, the reference, then the T > 0 check (module docstring)."""
    check_config(config)
    servers = {role: connect_audit(url, role, config.engine, config.model, config.timeout_s)
               for role, url in (("speculative", config.speculative), ("plain", config.plain))}
    report = AuditReport(config, servers)
    prompt_ids = []
    for index, prompt in enumerate(config.prompts):
        ids = servers["plain"].tokenize(prompt.text)
        if servers["speculative"].tokenize(prompt.text) != ids:
            raise DsparkError(f"the two servers tokenize prompt {index} differently: they do not serve the same "
                              "target; start both on one model.")
        prompt_ids.append(ids)
    references: list[ReferenceRun | None] = [None] * len(prompt_ids)
    if config.reference is not None:
        if on_progress is not None:
            on_progress("dspark's reference decoding of the target (float32)")
        start = time.perf_counter()
        references = reference_runs(config.reference, prompt_ids, config.max_tokens, config.device)
        report.timings_s["reference"] = time.perf_counter() - start
    start = time.perf_counter()
    for index, (prompt, ids, reference) in enumerate(zip(config.prompts, prompt_ids, references)):
        if on_progress is not None:
            on_progress(f"T = 0: prompt {index + 1} of {len(config.prompts)} ({prompt.kind})")
        report.prompts.append(audit_prompt(index, prompt, ids, servers, reference, config))
    report.sglang_accept_length = servers["speculative"].mean_accept_length()
    report.timings_s["greedy"] = time.perf_counter() - start
    decode = _decoder(servers["plain"])
    for result in report.prompts:
        result.vs_plain = difference(result.speculative, result.plain, decode)
        if result.reference is not None:
            result.vs_reference = difference(result.speculative, result.reference, decode)
            result.plain_vs_reference = difference(result.plain, result.reference, decode)
    if config.samples:
        start = time.perf_counter()
        chosen = report.prompts[config.sample_prompt]
        context = chosen.prompt_ids + chosen.plain[:FORCED_PREFIX]
        report.checks = distribution_checks(servers, context, config, on_progress)
        report.timings_s["sampling"] = time.perf_counter() - start
    return report


def _decoder(server: AuditServer) -> Callable[[Sequence[int]], str | None]:
    """Token ids to text by the server's own detokenizer (llama.cpp's /detokenize; vLLM's), None when it has none."""
    def decode(ids: Sequence[int]) -> str | None:
        try:
            return server.detokenize(list(ids))
        except DsparkError:
            return None

    return decode
