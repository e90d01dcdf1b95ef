"""`dspark bench serve`: a client for a running OpenAI-compatible engine, with and without speculation.

    config = ServeConfig(url="http://127.0.0.1:8080", prompts=[...], concurrencies=(1, 2, 4), max_tokens=64,
                         baseline="http://127.0.0.1:8081")
    report = run_serve_bench(config, on_request=print)     # ServeReport; .to_dict() is the --json document

For each concurrency C, the prompts go to the speculative server with C requests in flight (a closed loop: a
worker sends its next prompt when its previous one ends), then the same to the baseline (the same target without a
draft). Each request is a streamed `POST /v1/completions` (temperature 0, `ignore_eos`, `max_tokens`): the client
times the first streamed text (TTFT), the mean gap between tokens after it (ITL, (last - first) / (tokens - 1)),
and the request's tokens/s; the level's throughput is its generated tokens over its wall time (first send to last
end). Generated tokens are the engine's `usage.completion_tokens` (the prompt's tokens are never counted), else
the streamed chunks that carried text (a lower bound).

Acceptance is what the engine reports (engine_metrics.py): llama.cpp's per-response `timings.draft_n` /
`draft_n_accepted` (and its /metrics counters when started with `--metrics`), vLLM's Prometheus counters scraped
before and after each level, SGLang's gauges and server info. The client talks only to the URLs it is given (no
redirects followed), sends a bounded number of requests (the prompts, once per level and server, plus one warm-up
request per server), and bounds each request by a timeout on its whole duration. Stdlib HTTP and threads only;
torch-free. An interrupt (Ctrl-C, SIGTERM) stops the run: the report holds the requests that finished.
"""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dspark_cli.errors import DsparkError, Terminated
from dspark_cli.runtime.bench.engine_metrics import (
    SPEC_PREFIXES,
    SglangSpec,
    SpecCounters,
    llamacpp_draft_counts,
    sglang_avg_accept_length,
    sglang_gauges,
    spec_counters,
)
from dspark_cli.runtime.io.reading import server_error_message

SERVE_FORMAT = "dspark-bench-serve/1"
ENGINES = ("auto", "llamacpp", "vllm", "sglang", "openai")
MAX_LINE = 1 << 20  # bytes of one streamed event line
MAX_BODY = 16 << 20  # bytes of a /metrics, /v1/models or error body
PROBE_TIMEOUT_S = 10.0
WARMUP_TOKENS = 4
MAX_PROMPTS = 10_000  # prompts per level and server: a bench, not a load generator


@dataclass(frozen=True)
class ServeConfig:
    url: str
    prompts: Sequence[str]
    concurrencies: Sequence[int]
    max_tokens: int
    baseline: str | None = None
    timeout_s: float = 120.0  # one request's whole duration
    engine: str = "auto"
    model: str | None = None  # the `model` field of each request (default: the server's first /v1/models id)
    warmup: bool = True


# --- HTTP ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """One server: scheme, host, port and the path prefix before /v1 (an URL given as .../v1 is accepted)."""

    url: str
    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str, role: str = "server") -> "Endpoint":
        parts = urllib.parse.urlsplit(url.strip())
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.query or parts.fragment:
            raise DsparkError(f"the {role} URL {url!r} is not an http(s) address like http://127.0.0.1:8000; give "
                              "the address the engine listens on.")
        prefix = parts.path.rstrip("/").removesuffix("/v1")
        return cls(url.strip().rstrip("/"), parts.scheme, parts.hostname, port or (443 if parts.scheme == "https"
                                                                                    else 80), prefix)

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=timeout)

    def get(self, path: str, timeout: float = PROBE_TIMEOUT_S) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) of GET prefix + path; OSError when the server cannot be reached."""
        connection = self.connect(timeout)
        try:
            connection.request("GET", self.prefix + path, headers={"Accept": "*/*"})
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read(MAX_BODY)
        finally:
            connection.close()


def _unreachable(endpoint: Endpoint, role: str, error: BaseException) -> DsparkError:
    reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
    return DsparkError(f"cannot reach the {role} at {endpoint.url} ({reason}); start the engine or check the "
                       "address.")


# --- one request --------------------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    prompt: int  # index in the prompt list
    concurrency: int
    server: str  # "speculative" or "baseline"
    start_s: float  # since the level started
    latency_s: float
    ttft_s: float | None = None
    last_token_s: float | None = None  # since the request started
    tokens: int = 0
    prompt_tokens: int | None = None
    chunks: int = 0  # streamed events that carried text
    usage: bool = False  # tokens from the engine's usage, not counted chunks
    draft_n: int = 0  # llama.cpp timings of this response
    draft_accepted: int = 0
    error: str | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out

    @property
    def itl_s(self) -> float | None:
        if self.ttft_s is None or self.last_token_s is None or self.tokens < 2:
            return None
        return (self.last_token_s - self.ttft_s) / (self.tokens - 1)

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.latency_s if self.ok and self.latency_s > 0 else None

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "concurrency": self.concurrency, "server": self.server,
                "start_s": self.start_s, "latency_s": self.latency_s, "ttft_s": self.ttft_s, "itl_s": self.itl_s,
                "tokens": self.tokens, "tokens_from_usage": self.usage, "prompt_tokens": self.prompt_tokens,
                "chunks": self.chunks, "tokens_per_s": self.tokens_per_s, "draft_n": self.draft_n,
                "draft_n_accepted": self.draft_accepted, "error": self.error, "timed_out": self.timed_out}


def stream_completion(endpoint: Endpoint, model: str | None, prompt: str, max_tokens: int, timeout_s: float,
                      stop: threading.Event | None = None) -> RequestResult:
    """One streamed completion, bounded by `timeout_s` in all (connect, queueing, every token). Times are
    relative to the request's start; the caller fills in prompt, concurrency, server and start_s."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    result = RequestResult(-1, 0, "", 0.0, 0.0)
    start = time.perf_counter()
    deadline = start + timeout_s
    connection = endpoint.connect(timeout_s)
    try:
        connection.request("POST", endpoint.prefix + "/v1/completions", json.dumps(body).encode(),
                           {"Content-Type": "application/json", "Accept": "text/event-stream"})
        sock = connection.sock  # kept: a response that closes the connection takes it away from `connection`
        sock.settimeout(max(deadline - time.perf_counter(), 1e-3))  # the headers: within the time left too
        response = connection.getresponse()
        if response.status != 200:
            result.error = f"HTTP {response.status}: {_error_text(response.read(MAX_BODY))}"
        else:
            events = _read_stream(response, sock, result, start, deadline, stop)
            if result.ok and result.tokens == 0:
                result.error = _no_tokens(response.getheader("Content-Type"), events)
    except (TimeoutError, socket.timeout):
        result.timed_out = True
    except Exception as error:  # whatever the transport or the server did: this request's failure, not the run's
        result.error = f"{type(error).__name__}: {error}"
    finally:
        connection.close()
    result.latency_s = time.perf_counter() - start
    if result.latency_s > timeout_s:
        result.timed_out = True
    return result


def _read_stream(response, sock: socket.socket, result: RequestResult, start: float, deadline: float,
                 stop: threading.Event | None) -> int:
    """The response's server-sent events into `result`; the number of `data:` events read."""
    events = 0
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            result.timed_out = True
            return events
        if stop is not None and stop.is_set():
            result.error = "interrupted"
            return events
        sock.settimeout(remaining)  # every read waits only for the time left
        line = response.readline(MAX_LINE)
        if not line:
            return events
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        events += 1
        data = line[5:].strip()
        if data == b"[DONE]":
            return events
        try:
            event = json.loads(data)
        except ValueError:
            continue
        if isinstance(event, dict):
            _take_event(event, result, time.perf_counter() - start)


def _no_tokens(content_type: str | None, events: int) -> str:
    """Why a response that ended without an error generated no tokens: it was not a stream, or not this schema."""
    if events == 0:
        return (f"no tokens: the server answered without streaming (Content-Type {content_type or 'none'}, no "
                "server-sent events); bench serve reads streamed /v1/completions")
    return (f"no tokens: {events} streamed event(s) carried no completion text (choices[0].text) and no "
            "usage.completion_tokens; the server streams another event schema than OpenAI's /v1/completions")


def _take_event(event: dict, result: RequestResult, now: float) -> None:
    if "error" in event:
        result.error = f"engine error: {_error_text(json.dumps(event['error']).encode())}"
        return
    choices = event.get("choices")
    text = choices[0].get("text") if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
    if isinstance(text, str) and text:
        result.chunks += 1
        result.ttft_s = now if result.ttft_s is None else result.ttft_s
        result.last_token_s = now
        if not result.usage:
            result.tokens = result.chunks
    usage = event.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        result.tokens, result.usage = usage["completion_tokens"], True
        if isinstance(usage.get("prompt_tokens"), int):
            result.prompt_tokens = usage["prompt_tokens"]
    if "timings" in event:
        result.draft_n, result.draft_accepted = llamacpp_draft_counts(event["timings"])


def _error_text(body: bytes) -> str:
    text = server_error_message(body.decode("utf-8", "replace").strip())
    return " ".join(text.split())[:300] or "(no body)"


# --- a server: probe, engine, counters ----------------------------------------------------------------------------


@dataclass
class Server:
    role: str  # "speculative" or "baseline"
    endpoint: Endpoint
    engine: str
    model: str | None

    def snapshot(self) -> SpecCounters | SglangSpec | None:
        """The engine's speculation figures now (None when it exposes none)."""
        if self.engine == "sglang":
            gauges = sglang_gauges(self._text("/metrics"))
            info = self._json("/get_server_info") or self._json("/server_info")
            return SglangSpec(gauges.accept_length_gauge, gauges.accept_rate_gauge, sglang_avg_accept_length(info))
        if self.engine in SPEC_PREFIXES:
            return spec_counters(self._text("/metrics"), self.engine)
        return None

    def _text(self, path: str) -> str:
        try:
            status, _, body = self.endpoint.get(path)
        except (OSError, http.client.HTTPException):
            return ""
        return body.decode("utf-8", "replace") if status == 200 else ""

    def _json(self, path: str) -> object:
        try:
            return json.loads(self._text(path) or "null")
        except ValueError:
            return None


def probe(url: str, role: str, engine: str, model: str | None) -> Server:
    """Reach the server (GET /v1/models), pick the model it serves and tell its engine (`engine` auto: the Server
    header llama.cpp sends, else the metric names of /metrics, else SGLang's /get_server_info, else openai)."""
    if engine not in ENGINES:
        raise DsparkError(f"the engine option takes one of {', '.join(ENGINES)}, not {engine!r}.")
    endpoint = Endpoint.parse(url, role)
    try:
        status, headers, body = endpoint.get("/v1/models")
    except (OSError, http.client.HTTPException) as error:
        raise _unreachable(endpoint, f"{role} server", error) from None
    if status != 200:
        raise DsparkError(f"the {role} server at {endpoint.url} answered GET /v1/models with HTTP {status}; "
                          "give the address of an OpenAI-compatible engine (vLLM, SGLang, llama-server).")
    server = Server(role, endpoint, engine, model or _first_model(body))
    if engine == "auto":
        server.engine = _detect(server, headers)
    return server


def _first_model(body: bytes) -> str | None:
    try:
        data = json.loads(body).get("data")
        return data[0]["id"] if isinstance(data, list) and data and isinstance(data[0].get("id"), str) else None
    except (ValueError, AttributeError, KeyError, TypeError):
        return None


def _detect(server: Server, headers: dict[str, str]) -> str:
    if "llama.cpp" in headers.get("server", ""):
        return "llamacpp"
    metrics = server._text("/metrics")
    for name in ("vllm", "sglang", "llamacpp"):
        if f"\n{name}:" in "\n" + metrics:
            return name
    return "sglang" if isinstance(server._json("/get_server_info"), dict) else "openai"


# --- levels and the report ----------------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


@dataclass
class Level:
    """One server at one concurrency."""

    server: str
    engine: str
    concurrency: int
    requests: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    counters: SpecCounters | None = None  # Prometheus counters between the level's start and end
    sglang: SglangSpec | None = None
    complete: bool = True  # False: interrupted before every prompt was sent

    @property
    def done(self) -> list[RequestResult]:
        return [r for r in self.requests if r.ok]

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.done)

    @property
    def throughput(self) -> float | None:
        return self.tokens / self.wall_s if self.done and self.wall_s > 0 else None

    @property
    def response_acceptance(self) -> float | None:
        """llama.cpp: Σ draft_n_accepted / Σ draft_n over the level's responses."""
        drafted = sum(r.draft_n for r in self.done)
        return sum(r.draft_accepted for r in self.done) / drafted if drafted else None

    @property
    def acceptance(self) -> float | None:
        """Accepted / drafted tokens as the engine reports them: its responses (llama.cpp), else its counters,
        else SGLang's accept-rate gauge."""
        if self.response_acceptance is not None:
            return self.response_acceptance
        if self.counters is not None and self.counters.acceptance is not None:
            return self.counters.acceptance
        return self.sglang.accept_rate_gauge if self.sglang is not None else None

    def summary(self) -> dict:
        done = self.done
        ttft = [r.ttft_s for r in done if r.ttft_s is not None]
        itl = [r.itl_s for r in done if r.itl_s is not None]
        rates = [r.tokens_per_s for r in done if r.tokens_per_s is not None]
        return {"server": self.server, "engine": self.engine, "concurrency": self.concurrency,
                "requests": len(self.requests), "ok": len(done),
                "timed_out": sum(r.timed_out for r in self.requests),
                "failed": sum(r.error is not None for r in self.requests), "complete": self.complete,
                "tokens": self.tokens, "wall_s": self.wall_s, "tokens_per_s": self.throughput,
                "ttft_s": {"median": _percentile(ttft, 0.5), "p90": _percentile(ttft, 0.9)},
                "itl_s": {"median": _percentile(itl, 0.5), "p90": _percentile(itl, 0.9)},
                "per_request_tokens_per_s": statistics.fmean(rates) if rates else None,
                "draft_n": sum(r.draft_n for r in done), "draft_n_accepted": sum(r.draft_accepted for r in done),
                "acceptance": self.acceptance,
                "counters": None if self.counters is None else self.counters.to_dict(),
                "sglang": None if self.sglang is None else self.sglang.to_dict()}


@dataclass
class ServeReport:
    config: ServeConfig
    servers: dict[str, Server]
    levels: list[Level] = field(default_factory=list)
    stop: KeyboardInterrupt | Terminated | None = None  # what interrupted the run: Ctrl-C or SIGTERM

    @property
    def interrupted(self) -> bool:
        return self.stop is not None

    def level(self, server: str, concurrency: int) -> Level | None:
        return next((lv for lv in self.levels if lv.server == server and lv.concurrency == concurrency), None)

    def speedup(self, concurrency: int) -> float | None:
        spec, base = self.level("speculative", concurrency), self.level("baseline", concurrency)
        if spec is None or base is None or not spec.throughput or not base.throughput:
            return None
        return spec.throughput / base.throughput

    @property
    def failed(self) -> list[RequestResult]:
        """The requests that failed or timed out (one cut short by an interrupt is not one of them)."""
        return [r for lv in self.levels for r in lv.requests if not r.ok and r.error != "interrupted"]

    @property
    def failures(self) -> int:
        return len(self.failed)

    def to_dict(self) -> dict:
        return {"format": SERVE_FORMAT,
                "servers": {role: {"url": s.endpoint.url, "engine": s.engine, "model": s.model}
                            for role, s in self.servers.items()},
                "settings": {"max_tokens": self.config.max_tokens, "timeout_s": self.config.timeout_s,
                             "concurrency": list(self.config.concurrencies), "prompts": len(self.config.prompts),
                             "temperature": 0.0, "ignore_eos": True, "warmup": self.config.warmup},
                "interrupted": self.interrupted,
                "levels": [lv.summary() for lv in self.levels],
                "speedup": {str(c): self.speedup(c) for c in self.config.concurrencies},
                "requests": [r.to_dict() for lv in self.levels for r in lv.requests]}


def run_level(server: Server, prompts: Sequence[str], config: ServeConfig, level: Level,
              on_request: Callable[[RequestResult], None] | None = None) -> None:
    """The prompts through `level.concurrency` worker threads (closed loop), the engine's counters read around
    them, into `level`. An interrupt stops the workers taking new prompts and is raised again; `level` then holds
    the requests that finished (complete False; one cut short by the interrupt is left out)."""
    before = server.snapshot()
    stop, lock, queue, results = threading.Event(), threading.Lock(), list(range(len(prompts))), []
    origin = time.perf_counter()

    def work() -> None:
        while not stop.is_set():
            with lock:
                if not queue:
                    return
                index = queue.pop(0)
            sent = time.perf_counter() - origin
            result = stream_completion(server.endpoint, server.model, prompts[index], config.max_tokens,
                                       config.timeout_s, stop)
            result.prompt, result.concurrency, result.server, result.start_s = index, level.concurrency, \
                server.role, sent
            with lock:
                results.append(result)
            if on_request is not None and result.error != "interrupted":
                on_request(result)

    workers = [threading.Thread(target=work, daemon=True) for _ in range(min(level.concurrency, len(prompts)))]
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            while worker.is_alive():
                worker.join(0.1)
    except (KeyboardInterrupt, Terminated):
        stop.set()
        raise
    finally:
        with lock:
            level.requests = [r for r in results if r.error != "interrupted"]
            level.complete = not stop.is_set()
        ends = [r.start_s + r.latency_s for r in level.requests if r.ok]
        level.wall_s = max(ends) - min(r.start_s for r in level.requests) if ends else 0.0
    after = server.snapshot()
    if isinstance(after, SpecCounters):
        level.counters = after.since(before if isinstance(before, SpecCounters) else None)
    elif isinstance(after, SglangSpec):
        level.sglang = after


def warm_up(server: Server, prompt: str, timeout_s: float) -> None:
    """One short untimed request, so that a lazy first-request cost is not in the first level."""
    result = stream_completion(server.endpoint, server.model, prompt, WARMUP_TOKENS, timeout_s)
    if result.error is not None:
        raise DsparkError(f"the {server.role} server at {server.endpoint.url} failed the warm-up completion: "
                          f"{result.error}; check the model option and that the engine streams /v1/completions.")


def run_serve_bench(config: ServeConfig, on_request: Callable[[RequestResult], None] | None = None) -> ServeReport:
    """Every concurrency on the speculative server, then on the baseline (module docstring). An interrupt returns
    the report so far with `interrupted` set."""
    check_config(config)
    servers = {"speculative": probe(config.url, "speculative", config.engine, config.model)}
    if config.baseline is not None:
        servers["baseline"] = probe(config.baseline, "baseline", config.engine, config.model)
    report = ServeReport(config, servers)
    try:
        if config.warmup:
            for server in servers.values():
                warm_up(server, config.prompts[0], config.timeout_s)
        for concurrency in config.concurrencies:
            for server in servers.values():
                level = Level(server.role, server.engine, concurrency)
                report.levels.append(level)
                run_level(server, config.prompts, config, level, on_request)
    except (KeyboardInterrupt, Terminated) as stop:
        report.stop = stop
    return report


def check_config(config: ServeConfig) -> None:
    if not config.prompts:
        raise DsparkError("there are no prompts to send; give a prompts file with at least one prompt.")
    if len(config.prompts) > MAX_PROMPTS:
        raise DsparkError(f"{len(config.prompts)} prompts would be sent at every concurrency; at most {MAX_PROMPTS} "
                          "are: pass the requests option to send the first N.")
    if config.max_tokens < 1:
        raise DsparkError(f"the max-tokens option must be at least 1, got {config.max_tokens}.")
    if not (config.timeout_s > 0 and config.timeout_s < float("inf")):
        raise DsparkError(f"the timeout option must be a finite number of seconds above 0, got {config.timeout_s}.")
    if not config.concurrencies or min(config.concurrencies) < 1:
        raise DsparkError("the concurrency option takes integers >= 1 separated by commas, like 1,2,4.")


def has_chart(report: ServeReport) -> bool:
    """Whether some level measured a throughput: what write_serve_chart draws."""
    return any(level.throughput for level in report.levels)


def write_serve_chart(report: ServeReport, path) -> None:
    """PNG of tokens/s against concurrency: all requests (throughput) and per request, one line per server (at
    least one level must have measured a throughput: has_chart)."""
    from dspark_cli.runtime.bench.lineplot import Panel, Series, write_line_chart

    def series(measure: Callable[[Level], float | None]) -> list[Series]:
        lines = []
        for role in report.servers:
            points = [(lv.concurrency, measure(lv)) for lv in report.levels if lv.server == role]
            points = [(c, v) for c, v in points if v]
            if points:
                lines.append(Series(role, points))
        return lines

    url = report.servers["speculative"].endpoint.url
    panels = [Panel(f"throughput  {url}  max tokens {report.config.max_tokens}", series(lambda lv: lv.throughput)),
              Panel("tokens per second of one request (mean)",
                    series(lambda lv: lv.summary()["per_request_tokens_per_s"]))]
    write_line_chart(path, [p for p in panels if p.series], x_label="concurrency", y_label="tokens per second")
