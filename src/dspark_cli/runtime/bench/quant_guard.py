"""The acceptance guard of a quantized GGUF: the unquantized pair and the quantized one (the quantized draft beside
the same target, or the quantized target with the same draft), each served by the real llama.cpp, run on held-out
prompts; τ compared, and the quantized file refused (or warned about) when its τ is lower by more than the user's
threshold.

    check = acceptance_guard(GuardSettings(target_gguf, spec_args, prompts, max_tau_drop=0.1))
    figures = check(unquantized_draft_gguf, quantized_draft_gguf)   # GuardRefused when τ dropped too far
    check = acceptance_guard(GuardSettings(draft_gguf, spec_args, prompts, 0.1, quantized_role="target"))

Each pair gets its own llama-server (`--metrics`, one slot); the prompts go one at a time through bench serve's
client (serve.py: streamed /v1/completions, temperature 0, ignore_eos), and llama.cpp's speculation counters
(engine_metrics.py) are read before and after each, so every prompt has its verify steps with drafts, drafted and
accepted tokens. τ is (steps + accepted) / steps pooled over prompts (the bonus token included, the convention of
SpecCounters.accept_length), acceptance accepted / drafted; both with the percentile bootstrap interval over prompts
and the τ difference paired by prompt (measure/evaluation.py).
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.bench.engine_metrics import SpecCounters
from dspark_cli.runtime.bench.serve import Server, probe, stream_completion, warm_up
from dspark_cli.runtime.engines.llamacpp import build_binary, local_server_argv
from dspark_cli.runtime.measure.evaluation import Interval, bootstrap_ratio, bootstrap_ratio_difference

STARTUP_TIMEOUT_S = 120.0


class GuardRefused(DsparkError):
    """The quantized pair's τ fell by more than the threshold: nothing was written."""


@dataclass(frozen=True)
class GuardSettings:
    partner: Path  # the GGUF both pairs share: the target when a draft is quantized, the draft when a target is
    spec_args: tuple[str, ...]  # dspark's llama.cpp flags for the draft (engines/llamacpp.py), after -md
    prompts: tuple[str, ...]
    max_tau_drop: float  # refuse when τ(unquantized) - τ(quantized) exceeds it
    refuse: bool = True  # False: warn and keep the quantized file
    max_tokens: int = 64
    threads: int = 1
    timeout_s: float = 300.0  # one request
    server: Path | None = None  # the llama-server binary (default: engines.llamacpp.build_binary's)
    quantized_role: str = "draft"  # which of the pair was quantized: "draft" or "target"

    def pair(self, model: Path) -> tuple[Path, Path]:
        """(target GGUF, draft GGUF) with `model` in the quantized role."""
        return (self.partner, model) if self.quantized_role == "draft" else (model, self.partner)


@dataclass
class PairFigures:
    """One pair's counts per prompt (SpecCounters between the scrapes around its request)."""

    label: str
    per_prompt: list[SpecCounters] = field(default_factory=list)
    tokens: int = 0

    def tau_pairs(self) -> tuple[list[float], list[float]]:
        """Per prompt (steps + accepted, steps): τ's numerator and denominator."""
        return ([c.drafts + c.accepted for c in self.per_prompt], [c.drafts for c in self.per_prompt])

    def tau(self) -> Interval:
        return bootstrap_ratio(*self.tau_pairs())

    def acceptance(self) -> Interval:
        return bootstrap_ratio([c.accepted for c in self.per_prompt], [c.draft_tokens for c in self.per_prompt])


def acceptance_guard(settings: GuardSettings) -> Callable[[Path, Path], dict]:
    """The check convert runs on (unquantized GGUF, quantized GGUF) before publishing the latter."""
    if not settings.prompts:
        raise DsparkError("the guard's prompt set is empty; give held-out prompts to measure acceptance on.")
    if settings.max_tau_drop < 0:
        raise DsparkError(f"the maximum τ drop must be at least 0, got {settings.max_tau_drop}.")

    def check(unquantized: Path, quantized: Path) -> dict:
        reference = measure_pair(settings, unquantized, "unquantized")
        measured = measure_pair(settings, quantized, "quantized")
        return judge(reference, measured, settings)

    return check


def measure_pair(settings: GuardSettings, model: Path, label: str) -> PairFigures:
    """The prompts, one at a time, through a llama-server on the pair `model` (a draft or a target) makes."""
    figures = PairFigures(label)
    with llama_server(settings, *settings.pair(model)) as url:
        server = probe(url, label, "llamacpp", None)
        warm_up(server, settings.prompts[0], settings.timeout_s)
        for prompt in settings.prompts:
            before = _counters(server)
            result = stream_completion(server.endpoint, server.model, prompt, settings.max_tokens, settings.timeout_s)
            if not result.ok:
                raise DsparkError(f"llama-server on the {label} {settings.quantized_role} failed a guard prompt: "
                                  f"{result.error or 'timed out'}.")
            figures.per_prompt.append(_counters(server).since(before))
            figures.tokens += result.tokens
    return figures


def _counters(server: Server) -> SpecCounters:
    counters = server.snapshot()
    if not isinstance(counters, SpecCounters):
        raise DsparkError(f"llama-server at {server.endpoint.url} reports no speculation counters on /metrics.")
    return counters


def judge(reference: PairFigures, quantized: PairFigures, settings: GuardSettings) -> dict:
    """Both pairs' τ and acceptance with intervals, the paired τ drop; GuardRefused when the drop exceeds the
    threshold and the settings refuse."""
    tau_ref, tau_q = reference.tau(), quantized.tau()
    drop = bootstrap_ratio_difference(reference.tau_pairs(), quantized.tau_pairs(), paired=True)
    passed = drop.estimate is not None and drop.estimate <= settings.max_tau_drop
    figures = {"unquantized": _pair_dict(reference), "quantized": _pair_dict(quantized),
               "tau_drop": {"estimate": drop.estimate, "ci": [drop.low, drop.high]},
               "max_tau_drop": settings.max_tau_drop, "prompts": len(settings.prompts),
               "max_tokens": settings.max_tokens, "passed": passed}
    line = (f"τ {_fmt(tau_q)} quantized against {_fmt(tau_ref)} unquantized (95% intervals over "
            f"{len(settings.prompts)} prompts), a drop of {_fmt(drop)}" if drop.estimate is not None
            else "no speculation counted on the prompts")
    figures["line"] = line
    if not passed and settings.refuse:
        raise GuardRefused(f"the quantized {settings.quantized_role} lost too much acceptance: {line}, more than the "
                           f"{settings.max_tau_drop} allowed; nothing was written (raise the maximum τ drop, keep "
                           "more precision, or ask for a warning instead).")
    return figures


def _pair_dict(figures: PairFigures) -> dict:
    tau, acceptance = figures.tau(), figures.acceptance()
    return {"tau": tau.estimate, "tau_ci": [tau.low, tau.high], "acceptance": acceptance.estimate,
            "acceptance_ci": [acceptance.low, acceptance.high], "tokens": figures.tokens,
            "verify_steps": sum(c.drafts for c in figures.per_prompt)}


def _fmt(interval: Interval) -> str:
    if interval.estimate is None:
        return "none"
    if interval.low is None:
        return f"{interval.estimate:.3f}"
    return f"{interval.estimate:.3f} [{interval.low:.3f}, {interval.high:.3f}]"


@contextmanager
def llama_server(settings: GuardSettings, target_gguf: Path, draft_gguf: Path) -> Iterator[str]:
    """llama-server on 127.0.0.1 (a free port, one slot, --metrics) with the pair; its URL once /health answers,
    stopped after the block."""
    binary = settings.server or build_binary("llama-server")
    if not Path(binary).is_file():
        raise DsparkError(f"the acceptance guard runs llama.cpp's llama-server, and there is none at {binary}; build "
                          "it with scripts/build_llamacpp.sh.")
    port = _free_port()
    argv = local_server_argv(binary, target_gguf, draft_gguf, settings.spec_args, port, settings.threads)
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(f"http://127.0.0.1:{port}", process, log)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_server(process)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, log) -> None:
    import http.client
    import urllib.request

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            tail = " ".join(log.read()[-600:].split())
            raise DsparkError(f"llama-server exited {process.returncode} before serving: {tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, http.client.HTTPException):  # not listening yet, or an answer that is not HTTP yet
            time.sleep(0.25)
    raise DsparkError(f"llama-server did not answer /health within {STARTUP_TIMEOUT_S:.0f} s.")


def stop_server(process: subprocess.Popen) -> None:
    """Terminate a server process, killing it after 30 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def spec_args_for(draft_folder: str, target_folder: str) -> tuple[str, ...]:
    """dspark's llama.cpp flags for a draft folder (the serve plan's argv after -md DRAFT.gguf)."""
    from dspark_cli.runtime.engines import engine
    from dspark_cli.runtime.engines.seam import ServeRequest

    argv = engine("llamacpp").plan(ServeRequest(target=target_folder, draft=draft_folder)).argv
    return tuple(argv[argv.index("-md") + 2:])
